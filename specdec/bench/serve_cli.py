"""``specdec bench-serve``'s command line: its options, the
:class:`~specdec.bench.serve_command.BenchServeConfig` they make, and the command that runs it
(:func:`~specdec.bench.serve_command.run_bench_serve`)."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

from specdec.bench.serve_command import BenchServeConfig, run_bench_serve
from specdec.cli_args import csv, finite_float, positive_int, seed_int

__all__ = ["add_bench_serve", "cmd_bench_serve", "config_from_args", "request_rate"]


def request_rate(text: str) -> float:
    """A request rate for ``--request-rate``: a finite number > 0, or ``inf`` (all at once)."""
    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a rate > 0 (requests per second) or inf, got {text!r}")
    return value


def _goodput_item(text: str) -> str:
    from specdec.bench.serve_report import parse_goodput

    try:
        parse_goodput([text])
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--goodput ")) from None
    return text


def add_bench_serve(sub: argparse._SubParsersAction) -> None:
    """Add ``bench-serve`` to the ``specdec`` subcommands."""
    p = sub.add_parser(
        "bench-serve", help="load OpenAI-compatible servers (ours, llama-server, any URL) and time them"
    )
    p.add_argument(
        "--base-url", default=None, metavar="URL", help="an OpenAI-compatible server already running"
    )
    p.add_argument(
        "--servers",
        type=csv(str),
        default=None,
        help="servers to start, one after another: ours:DRAFTER, llama-server, llama-server:ngram-mod, "
        "llama-server:eagle3 (default: ours:default unless --base-url or --peers is given)",
    )
    p.add_argument(
        "--peers", type=csv(str), default=(), help="peers to start after --servers: llama-server[:MODE]"
    )
    p.add_argument(
        "--target", default="smollm2-135m", help="the model ours serves; llama-server gets its GGUF file"
    )
    p.add_argument(
        "--model", default=None, help="the model name sent (default: the server's first in /v1/models)"
    )
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument(
        "--prompt-set",
        type=csv(str),
        default=("humaneval", "mtbench"),
        help="humaneval, mtbench, mtbench-chat (chat), json (chat, each request with a JSON schema) "
        "(default: humaneval,mtbench)",
    )
    p.add_argument(
        "--num-prompts", type=positive_int, default=8, help="prompts per set, evenly spaced (held out)"
    )
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=finite_float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--seed", type=seed_int, default=0, help="sent with every request; draws the arrivals")
    p.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos: every request runs to --max-tokens"
    )
    p.add_argument("--concurrency", type=csv(positive_int), default=None, help="closed-loop levels (1,2,4,8)")
    p.add_argument(
        "--request-rate", type=csv(request_rate), default=(), help="open-loop levels in req/s (or inf)"
    )
    p.add_argument(
        "--burstiness", type=finite_float, default=1.0, help="gamma shape of the arrivals: 1 = Poisson"
    )
    p.add_argument(
        "--goodput",
        nargs="+",
        type=_goodput_item,
        default=(),
        metavar="METRIC:MS",
        help="SLOs: ttft, tpot, e2el",
    )
    p.add_argument(
        "--threads", type=positive_int, default=2, help="threads of the servers started (default: 2)"
    )
    p.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=None,
        help="their slots (default: the largest --concurrency)",
    )
    p.add_argument(
        "--gamma",
        default="auto",
        help="draft depth of ours:DRAFTER servers: an integer or a depth policy; an integer is also "
        "llama-server:eagle3's --spec-draft-n-max, else 3 (default: %(default)s)",
    )
    p.add_argument(
        "--llama-head",
        default=None,
        metavar="HEAD",
        help="the EAGLE-3 head llama-server:eagle3 drafts with, exported and converted to GGUF once: a head "
        "file (a path or a shipped name) or a speculators / SGLang folder (default: eagle3-smollm2-135m)",
    )
    p.add_argument(
        "--llama-convert",
        default=None,
        metavar="PATH",
        help="llama.cpp's convert_hf_to_gguf.py (default: $LLAMA_CONVERT, else the one of the llama.cpp "
        "tree llama-server was built from)",
    )
    p.add_argument("--warmup-requests", type=int, default=1, help="untimed requests before the levels")
    p.add_argument("--request-timeout", type=finite_float, default=600.0, help="seconds per request")
    p.add_argument(
        "--startup-timeout", type=finite_float, default=600.0, help="seconds a server gets to start"
    )
    p.add_argument("--api-key", default=None, help="Bearer key for --base-url (default: $OPENAI_API_KEY)")
    p.add_argument("--out", default="results/bench-serve", help="results folder (default: %(default)s)")
    p.set_defaults(func=cmd_bench_serve)


def config_from_args(args: argparse.Namespace) -> BenchServeConfig:
    """The config of parsed ``bench-serve`` arguments (its defaults: ``ours:default``, c = 1,2,4,8)."""
    servers = args.servers
    if servers is None:
        servers = () if (args.base_url or args.peers) else ("ours:default",)
    concurrency = args.concurrency
    if concurrency is None:
        concurrency = () if args.request_rate else (1, 2, 4, 8)
    return BenchServeConfig(
        base_url=args.base_url,
        servers=tuple(servers),
        peers=tuple(args.peers),
        target=args.target,
        model=args.model,
        endpoint=args.endpoint,
        prompt_sets=tuple(args.prompt_set),
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        concurrency=tuple(concurrency),
        request_rates=tuple(args.request_rate),
        burstiness=args.burstiness,
        goodput=tuple(args.goodput or ()),
        threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        gamma=args.gamma,
        llama_head=args.llama_head,
        llama_convert=args.llama_convert,
        warmup_requests=args.warmup_requests,
        request_timeout_s=args.request_timeout,
        startup_timeout_s=args.startup_timeout,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        out=args.out,
    )


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Run the benchmark; exit status 1 if a server did not start."""
    from specdec.bench.json_prompts import SCHEMA_PROMPT_SETS

    needed = ["httpx", "matplotlib"] + (
        ["jsonschema"] if set(args.prompt_set) & set(SCHEMA_PROMPT_SETS) else []
    )
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"specdec bench-serve needs {', '.join(missing)} (pip install -e '.[serve,eval]')")
    config = config_from_args(args)
    record = run_bench_serve(config, command=" ".join(["specdec", *sys.argv[1:]]))
    return 1 if any(s.get("error") for s in record["servers"]) else 0
