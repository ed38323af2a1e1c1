"""``specdec perplexity``: PPL ± stderr per weight format, KL divergence against the first, and
llama.cpp's ``llama-perplexity`` beside (``--peers llama.cpp``).

    specdec perplexity --target smollm2-135m --weights fp32,gguf,gguf-q8 --text FILE --ctx 256 \\
        [--chunks 40] [--threads 2] [--peers llama.cpp] [--peer-logits] [--peer-tokens] [--out F]

The protocol is :mod:`specdec.quality.perplexity`'s (llama.cpp's). The text is read as
``llama-perplexity -f`` reads it (bytes as they are, one trailing newline dropped). A peer's tokens
of the text are compared with ours (:mod:`specdec.quality.tokens`): a line under the table says
whether its PPL is over the same tokens, and where not, where the two first split the text
differently; ``--peer-tokens`` then also scores every format on the peer's tokens. ``--out`` writes
a ``specdec.summary/1`` file with the raw figures beside the table: ``weights`` (name → ``ppl``,
``ppl_stderr``, ``kld_mean``, ``kld_p99``, ``top1_agree``, ...; the reference's KL fields null),
``peers`` (``llama.cpp`` → ``ppl``, ``ppl_stderr``, its command and build, ``tokens``,
``comparable``, ``ours_on_its_tokens``), the target, ctx, text, chunks, machine and commit.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from specdec.cli_args import csv, positive_int

__all__ = ["PEERS", "add_perplexity", "cmd_perplexity", "read_text"]


def read_text(path: str | Path, argument: str = "--text") -> str:
    """The file's text as ``llama-perplexity -f`` reads it: UTF-8, one trailing newline dropped;
    ``ValueError`` naming ``argument`` for a missing, unreadable or empty file."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{argument} {path}: no such file")
    try:
        with open(file, encoding="utf-8", newline="") as f:  # "\r\n" stays, as llama.cpp reads it
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{argument} {path}: not a readable UTF-8 text file ({err})") from None
    if text.endswith("\n"):
        text = text[:-1]
    if not text.strip():
        raise ValueError(f"{argument} {path}: the file is empty")
    return text


def _llama_cpp(args: argparse.Namespace, gguf: Path | None, text_file: Path, work: Path) -> dict[str, Any]:
    from specdec.quality.llama_perplexity import (
        find_llama_perplexity,
        find_llama_tokenize,
        run_llama_perplexity,
        run_llama_tokenize,
    )

    logits = work / "llama-logits.bin" if args.peer_logits else None
    extra = shlex.split(args.peer_args)
    out = run_llama_perplexity(
        gguf,
        text_file,
        ctx=args.ctx,
        chunks=args.chunks,
        threads=args.threads or 1,
        logits_file=logits,
        extra_args=extra,
        timeout_s=args.peer_timeout,
    )
    out = {"weights": "gguf", "gguf": str(gguf), "logits_file": logits, **out}
    assert gguf is not None  # run_llama_perplexity refuses None
    tokenize = find_llama_tokenize(beside=find_llama_perplexity())
    if tokenize is None:
        return out | {
            "tokens": {"reason": "no llama-tokenize beside llama-perplexity, in $LLAMA_TOKENIZE or on PATH"}
        }
    prompt = work / "llama-tokenize.txt"  # the text llama-perplexity reads: one trailing newline dropped
    prompt.write_text(read_text(text_file), encoding="utf-8", newline="")
    try:
        ids = run_llama_tokenize(tokenize, gguf, prompt, perplexity_args=extra, timeout_s=args.peer_timeout)
    except ValueError as err:
        return out | {"tokens": {"reason": str(err)}}
    return out | {"tokenize_binary": str(tokenize), "token_ids": ids}


PEERS: dict[str, Callable[[argparse.Namespace, Path | None, Path, Path], dict[str, Any]]] = {
    "llama.cpp": _llama_cpp,
}
"""Peer name → runner(args, gguf, text file, work dir) returning at least ``ppl`` and ``ppl_stderr``,
and the peer's tokens of the text as ``token_ids`` (else ``tokens``: ``{"reason": why not}``)."""


def _check_args(args: argparse.Namespace) -> list[str]:
    """Everything checkable before a model loads; returns the weight formats."""
    from specdec.quality.perplexity import BOS_MODES
    from specdec.targets.llama_weights import WEIGHT_MODES

    weights = [w for w in args.weights if w]
    unknown = [w for w in weights if w not in WEIGHT_MODES]
    if not weights or unknown:
        raise ValueError(
            f"--weights must list formats from {list(WEIGHT_MODES)}, got {','.join(args.weights)!r}"
        )
    if len(set(weights)) != len(weights):
        raise ValueError(f"--weights names a format twice: {','.join(weights)!r}")
    if args.ctx < 4 or args.ctx % 2:
        raise ValueError(f"--ctx must be an even number >= 4 (half of each chunk is scored), got {args.ctx}")
    unknown_peers = [p for p in args.peers if p not in PEERS]
    if unknown_peers:
        raise ValueError(f"--peers must list peers from {sorted(PEERS)}, got {','.join(args.peers)!r}")
    if args.peer_logits and not args.peers:
        raise ValueError("--peer-logits compares with a peer's log-probs: give --peers llama.cpp")
    if args.peer_tokens and not args.peers:
        raise ValueError("--peer-tokens scores a peer's tokens: give --peers llama.cpp")
    if args.bos not in BOS_MODES:
        raise ValueError(f"--bos must be one of {BOS_MODES}, got {args.bos!r}")
    from specdec.summary import check_experiment_name

    check_experiment_name(args.name, "--name")
    if args.out is not None and not Path(args.out).resolve().parent.is_dir():
        raise ValueError(f"--out {args.out}: its folder does not exist")
    return weights


def _command(args: argparse.Namespace, weights: list[str]) -> str:
    """The command line that reproduces this run."""
    parts = ["specdec", "perplexity", "--target", args.target, "--weights", ",".join(weights)]
    parts += ["--text", str(args.text), "--ctx", str(args.ctx)]
    for flag, value in (("--chunks", args.chunks), ("--threads", args.threads)):
        if value is not None:
            parts += [flag, str(value)]
    if args.bos != "auto":
        parts += ["--bos", args.bos]
    if args.peers:
        parts += ["--peers", ",".join(args.peers)] + (["--peer-logits"] if args.peer_logits else [])
        parts += ["--peer-tokens"] if args.peer_tokens else []
        parts += [f"--peer-args={args.peer_args}"] if args.peer_args else []
    if args.out is not None:
        parts += ["--out", str(args.out)]
    return shlex.join(parts)


def _progress(done: int, total: int, stats: Mapping[str, Any], elapsed_s: float) -> None:
    eta = elapsed_s / done * (total - done)
    running = ", ".join(f"{name} {s.ppl():.3f}" for name, s in stats.items())
    print(
        f"[perplexity] chunk {done}/{total} ({elapsed_s:.0f} s, ETA {eta:.0f} s): {running}", file=sys.stderr
    )


def cmd_perplexity(args: argparse.Namespace) -> int:
    """Run ``specdec perplexity``: see the module docstring."""
    import torch

    from specdec.bench.report import environment
    from specdec.quality import report
    from specdec.quality.perplexity import evaluate_tokens, tokenize_text
    from specdec.quality.text import text_info
    from specdec.quality.tokens import compare_tokens
    from specdec.targets import open_target
    from specdec.targets.loading import gguf_source

    weights = _check_args(args)
    text = read_text(args.text)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    targets = {}
    for w in weights:
        print(f"[perplexity] loading {args.target} ({w})", file=sys.stderr)
        targets[w] = open_target(args.target, weights=w)
    tokenizer = getattr(targets[weights[0]], "tokenizer", None)
    if tokenizer is None:
        raise ValueError(f"--target {args.target}: the checkpoint has no tokenizer to encode --text with")
    ids = tokenize_text(tokenizer, text)
    gguf = gguf_source(args.target)
    peers: dict[str, Any] = {}
    peer_ids: dict[str, list[int]] = {}  # a peer's tokens, where they differ from ours and --peer-tokens
    comparison = None
    with tempfile.TemporaryDirectory(prefix="specdec-ppl-") as work:
        for name in args.peers:
            print(f"[perplexity] running {name}'s perplexity", file=sys.stderr)
            peers[name] = PEERS[name](args, gguf, Path(args.text), Path(work))
            theirs = peers[name].pop("token_ids", None)
            if theirs is not None:
                peers[name]["tokens"] = compare_tokens(
                    ids, theirs, ctx=args.ctx, chunks=args.chunks, tokenizer=tokenizer
                )
                if args.peer_tokens and not peers[name]["tokens"]["scored_equal"]:
                    peer_ids[name] = theirs
            peers[name].setdefault("tokens", {"reason": f"{name} gave no tokens"})
            peers[name]["comparable"] = peers[name]["tokens"].get("scored_equal")

        def start_comparison(chunks_NC: torch.Tensor) -> None:
            nonlocal comparison
            from specdec.quality.llama_perplexity import PeerComparison, read_llama_logits

            for peer in peers.values():
                if peer.get("logits_file"):
                    comparison = PeerComparison(read_llama_logits(peer["logits_file"]), chunks_NC)

        def observe(chunk: int, name: str, scores: Any) -> None:
            if comparison is not None:
                comparison.observe(chunk, name, scores)

        def evaluate(tokens: list[int], compare: bool) -> dict[str, Any]:
            return evaluate_tokens(
                targets,
                tokens,
                tokenizer=tokenizer,
                ctx=args.ctx,
                chunks=args.chunks,
                bos=args.bos,
                reference=weights[0],
                progress=_progress,
                observe=observe if compare else None,
                chunks_hook=start_comparison if compare else None,
            )

        # With --peer-logits, llama.cpp's log-probs are compared on the tokens it scored: ours on its
        # tokens where we score those too, else our own (chunks whose tokens differ are skipped).
        record = evaluate(ids, compare=not peer_ids)
        for name, theirs in peer_ids.items():
            print(f"[perplexity] scoring {name}'s tokens of the text", file=sys.stderr)
            run = evaluate(theirs, compare=True)
            keep = ("n_chunks", "tokens_scored", "text_tokens", "weights")
            peers[name]["ours_on_its_tokens"] = {k: run[k] for k in keep}
        for peer in peers.values():
            peer.pop("logits_file", None)
        if comparison is not None:
            peers["llama.cpp"]["compare"] = comparison.result()
    info = text_info(text)
    record = {
        "command": _command(args, weights),
        "target": args.target,
        **record,
        "chunks_requested": args.chunks,
        "text": {
            "file": str(args.text),
            "name": Path(args.text).name,
            "n_tokens": record["text_tokens"],
            "chars": info["chars"],
            "sha256": info["sha256"],
        },
        "peers": peers,
        "environment": environment(),
        "wall_s": time.perf_counter() - t0,
    }
    print(report.markdown(record))
    if comparison is not None:
        _print_comparison(peers["llama.cpp"]["compare"])
    if args.out is not None:
        from specdec.bench.report import benchmark_document
        from specdec.summary import write_results

        doc = benchmark_document(
            record,
            experiment=args.name,
            summarize=report.summarize,
            description="specdec perplexity: PPL, KL divergence and top-1 agreement per weight format, "
            "llama.cpp's llama-perplexity beside",
        )
        write_results(Path(args.out), doc)
        print(f"[perplexity] wrote {args.out}", file=sys.stderr)
    return 0


def _print_comparison(compare: Mapping[str, Any]) -> None:
    tokens = compare["tokens"]
    print(
        f"\nllama.cpp's tokens: {tokens['compared'] - tokens['different']}/{tokens['compared']} equal to ours"
        + (f" (first difference at token {tokens['first_different']})" if tokens["different"] else "")
    )
    print(
        "\n| weights | chunks | NLL ours - llama.cpp | mean abs | max abs | KL(llama.cpp ‖ ours) "
        "| same top-1 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in compare["weights"].items():
        if "dnll_mean" not in r:
            print(f"| {name} | 0 (skipped {r['skipped_chunks']}) | – | – | – | – | – |")
            continue
        print(
            f"| {name} | {r['chunks']} | {r['dnll_mean']:+.5f} | {r['dnll_abs_mean']:.5f} | "
            f"{r['dnll_abs_max']:.4f} | {r['kld_mean']:.6f} | {r['top1_agree']:.4f} |"
        )


def add_perplexity(sub: argparse._SubParsersAction) -> None:
    """Register ``specdec perplexity``."""
    p = sub.add_parser(
        "perplexity", help="perplexity and KL divergence per weight format (llama-perplexity's protocol)"
    )
    p.add_argument(
        "--target", default="smollm2-135m", help="built-in name or local checkpoint (default: %(default)s)"
    )
    p.add_argument(
        "--weights",
        type=csv(str),
        required=True,
        metavar="W[,W...]",
        help="weight formats, the first the KL reference "
        "(fp32, bf16, gguf, int8, int4, gguf-q8, int8-q8, int4-q8)",
    )
    p.add_argument(
        "--text",
        required=True,
        metavar="FILE",
        help="UTF-8 text (python -m specdec.quality.text FILE writes the held-out pydoc text)",
    )
    p.add_argument(
        "--ctx",
        type=positive_int,
        default=512,
        help="tokens per chunk, even; the second half is scored (default: %(default)s)",
    )
    p.add_argument(
        "--chunks",
        type=positive_int,
        default=None,
        help="at most this many chunks (default: all the text holds)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads, and llama-perplexity's -t (default: torch's)",
    )
    p.add_argument(
        "--bos",
        default="auto",
        help="each chunk's first token: auto (BOS where the tokenizer adds one, as llama.cpp) "
        "| replace | keep",
    )
    p.add_argument(
        "--peers",
        type=csv(str),
        default=(),
        metavar="PEER[,...]",
        help="run beside: llama.cpp (llama-perplexity from $LLAMA_PERPLEXITY or PATH)",
    )
    p.add_argument(
        "--peer-logits",
        action="store_true",
        help="save llama.cpp's log-probs and compare them with ours token by token",
    )
    p.add_argument(
        "--peer-tokens",
        action="store_true",
        help="where llama.cpp's tokens of the text differ from ours, also score every format on its "
        "tokens (a like-for-like PPL; every format runs twice)",
    )
    p.add_argument(
        "--peer-args",
        default="",
        metavar="ARGS",
        help="more arguments for llama-perplexity, e.g. --peer-args=--no-repack (default: none)",
    )
    p.add_argument(
        "--peer-timeout",
        type=positive_int,
        default=3600,
        help="seconds llama-perplexity may run (default: %(default)s)",
    )
    p.add_argument("--out", default=None, metavar="F", help="write the results JSON (specdec.summary/1) here")
    p.add_argument(
        "--name", default="perplexity", help="the results file's experiment name (default: %(default)s)"
    )
    p.set_defaults(func=cmd_perplexity)
