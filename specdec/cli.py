"""The ``specdec`` command line: a thin layer over :func:`specdec.generate` and :mod:`specdec.bench`.

    specdec generate --target smollm2-135m --drafter default --prompt "Write a haiku." --chat \\
        --max-new-tokens 64 --temperature 0 --gamma 4 [--json]
    specdec bench --prompt-set humaneval,mtbench --num-prompts 5 --temperatures 0,0.7
    specdec export-head HEAD --format speculators --out DIR
    specdec serve --target smollm2-135m --drafter default --port 8000   # extra [serve]
    specdec bench-serve --servers ours:none,ours:default,llama-server --concurrency 1,2,4,8
    specdec perplexity --target smollm2-135m --weights fp32,gguf-q8 --text FILE --ctx 256 --peers llama.cpp
    specdec train-head --target smollm2-135m --steps 4000 --out head.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from specdec.cli_args import (
    ArgumentParser,
    add_engine_arguments,
    check_text,
    finite_float,
    interrupt_watch,
    parse_options,
    positive_int,
    seed_int,
    stderr_line,
)
from specdec.cli_controls import add_control_arguments
from specdec.detokenize import IncrementalDetokenizer

__all__ = ["main", "build_parser", "IncrementalDetokenizer"]


def _metrics_line(m: Any, drafter: str) -> str:
    return (
        f"[specdec] {m.num_generated_tokens} tokens in {m.total_time_s:.2f} s: "
        f"{m.tokens_per_second:.1f} tok/s | drafter {drafter}: alpha {m.acceptance_rate:.2f}, "
        f"tau {m.mean_accepted_tokens:.2f} | TTFT {m.ttft_s * 1e3:.0f} ms, TPOT {m.tpot_s * 1e3:.1f} ms "
        f"(p50 {m.latency_p50_s * 1e3:.1f}, p99 {m.latency_p99_s * 1e3:.1f}) | "
        f"target {m.target_time_s:.2f} s, draft {m.draft_time_s:.2f} s"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    import specdec
    from specdec.cli_controls import controls_from_args
    from specdec.drafters.ngram_eagle import default_name
    from specdec.engine.depth import make_depth_policy
    from specdec.prompt_sets import encode_prompt
    from specdec.registry import DRAFTERS
    from specdec.sampling import validate_sampling
    from specdec.targets import open_target_from

    prompt = check_text(args.prompt, "--prompt")
    validate_sampling(args.temperature, args.top_k, args.top_p, args.min_p)  # before the model loads
    controls = controls_from_args(args)
    drafter_options = parse_options(args.drafter_option, "--drafter-option")
    gamma_options = {} if args.gamma is None else {"gamma": args.gamma}
    policy = make_depth_policy(args.gamma_policy, gamma_options)
    DRAFTERS.get(args.drafter)  # an unknown name fails before the model loads
    target = open_target_from(args)
    tokenizer = getattr(target, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(f"--target {args.target}: the checkpoint has no tokenizer to encode --prompt with")
    prompt_ids = encode_prompt(tokenizer, prompt, chat=args.chat)

    on_commit = None
    detok = None
    if not args.json:
        detok = IncrementalDetokenizer(tokenizer)

        def on_commit(row: int, ids: list[int]) -> None:
            sys.stdout.write(detok.push(ids))
            sys.stdout.flush()

    # The name reported is the drafter that runs (``default`` picks one for the target).
    drafter = default_name(target) if args.drafter == "default" else args.drafter
    drafter_name = DRAFTERS.resolve(drafter)
    out = specdec.generate(
        target,
        [prompt_ids],
        drafter=drafter,
        drafter_options=drafter_options,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        gamma=policy,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop_strings=args.stop or None,
        tokenizer=tokenizer,
        on_commit=on_commit,
        verify=args.verify,
        verify_options=parse_options(args.verify_option, "--verify-option"),
        **controls,
    )
    token_ids = out.token_ids[0]
    if args.json:
        result = {
            "prompt_token_ids": out.prompt_token_ids[0],
            "token_ids": token_ids,
            "text": tokenizer.decode(token_ids, skip_special_tokens=True),
            "finish_reason": out.finish_reasons[0],
            "target": args.target,
            "drafter": drafter_name,
            "gamma_policy": args.gamma_policy,
            "verify": args.verify,
            "metrics": out.metrics.to_dict(),
        }
        print(json.dumps(result))
    else:
        sys.stdout.write(detok.flush() + "\n")
        sys.stdout.flush()
        print(_metrics_line(out.metrics, drafter_name), file=sys.stderr)
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding")
    add_engine_arguments(p)
    p.add_argument("--prompt", required=True, help="prompt text (raw, or a user turn with --chat)")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=finite_float, default=1.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=positive_int, default=None)
    p.add_argument("--top-p", type=finite_float, default=None)
    p.add_argument("--seed", type=seed_int, default=None, help="an integer in [0, 2**64)")
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_control_arguments(p)
    p.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    """The ``specdec`` argument parser (``generate``, ``bench``, ``export-head``, ``serve``,
    ``bench-serve``, ``perplexity``, ``train-head``)."""
    parser = ArgumentParser(prog="specdec", description="Speculative decoding with exact verification.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    _add_generate(sub)
    from specdec.bench import add_arguments

    bench = sub.add_parser("bench", help="benchmark drafters against plain decoding and transformers")
    add_arguments(bench)
    from specdec.cli_export import add_export_head

    add_export_head(sub)
    from specdec.serve.command import add_serve

    add_serve(sub)
    from specdec.bench.serve_cli import add_bench_serve

    add_bench_serve(sub)
    from specdec.quality.command import add_perplexity

    add_perplexity(sub)
    from specdec.drafters.eagle.train.command import add_train_head

    add_train_head(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``specdec`` command: a user-caused error (``ValueError``: a bad argument,
    file or field) is one line on stderr and exit status 2; an internal error keeps its traceback.
    Ctrl-C at any point, the heavy imports (torch, transformers) included, is one line and exit
    status 130: this module imports only the standard library and :mod:`specdec.cli_args` at load,
    everything else inside the ``try`` below (and an error after a Ctrl-C that a library swallowed
    counts as the interrupt: :func:`specdec.cli_args.interrupt_watch`)."""
    with interrupt_watch() as interrupted:
        try:
            parser = build_parser()  # imports torch (specdec.bench)
            if interrupted():  # a Ctrl-C that an import swallowed
                raise KeyboardInterrupt
            args = parser.parse_args(argv)
            status = int(args.func(args) or 0)
            if interrupted():
                raise KeyboardInterrupt
            return status
        except KeyboardInterrupt:
            pass
        except ValueError as e:
            if not interrupted():
                stderr_line("specdec", e)
                return 2
        except Exception:
            if not interrupted():  # else a library swallowed the interrupt and failed after it
                raise
        print("specdec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
