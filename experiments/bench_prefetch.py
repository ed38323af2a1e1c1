"""End-to-end A/B of the packed kernel's software prefetch: speculative decoding with it and without it.

    python -m experiments.bench_prefetch --out results/bench-prefetch

The packed CPU kernel (``kernels/csrc/packed_gemm.c``) prefetches the weight stream in software when it
multiplies 2 or more rows (a verify block or a tree); one row (plain decode, a chain's draft step) never
uses it. This runs our plain decode and the given drafters on the same held-out prompts (greedy), each
method once with the prefetch at its default distance and once with it off
(``kernels.packed_gemm.set_prefetch_distance(0)``), interleaved per prompt with the order reversed on
every other prompt, and reports tok/s and the speedup over plain decode of the same setting. The first
repetition warms up and is not timed. Greedy outputs must match across all methods and both settings;
a mismatch is an error.

Writes ``bench_prefetch.json`` and ``bench_prefetch.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

__all__ = ["run", "main"]


def _csv(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return items


def build_parser() -> argparse.ArgumentParser:
    prog = "python -m experiments.bench_prefetch"
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--prompt-set", type=_csv, default=["humaneval", "mtbench"], help="humaneval,mtbench")
    p.add_argument("--num-prompts", type=int, default=8, help="per prompt set (8: the held-out ones)")
    p.add_argument("--drafters", type=_csv, default=["ngram-eagle", "eagle", "eagle-tree"])
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="timed repetitions after the warm-up one")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="directory for bench_prefetch.json / .md")
    return p


def _validate(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "gamma", "max_new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def run(args: argparse.Namespace, log=print, command: str = "") -> dict:
    """Time every (method, prefetch setting) pair on the same prompts; returns the result record."""
    import torch

    import specdec
    from kernels.packed_gemm import packed_gemm_available, prefetch_distance, set_prefetch_distance
    from specdec.cli import encode_prompt
    from specdec.prompt_sets import load_prompts

    _validate(args)
    if not packed_gemm_available():
        raise RuntimeError("the packed kernel is not built here (no C compiler): nothing to compare")
    torch.set_num_threads(args.threads)
    target = specdec.load_target(args.target)
    prompts = [
        encode_prompt(target.tokenizer, text, chat=False)
        for set_name in args.prompt_set
        for text in load_prompts(set_name, args.num_prompts)
    ]
    distance = prefetch_distance()
    methods = [
        (f"{drafter}{suffix}", drafter, pf)
        for drafter in ["none", *args.drafters]
        for suffix, pf in (("", distance), (" (no sw prefetch)", 0))
    ]
    seconds = {name: 0.0 for name, _, _ in methods}
    tokens = {name: 0 for name, _, _ in methods}
    try:
        for rep in range(args.repeats + 1):
            for i, ids in enumerate(prompts):
                order = methods if (i + rep) % 2 == 0 else methods[::-1]
                outputs = set()
                for name, drafter, pf in order:
                    set_prefetch_distance(pf)
                    t0 = time.perf_counter()
                    out = specdec.generate(
                        target,
                        [ids],
                        drafter=drafter,
                        gamma=0 if drafter == "none" else args.gamma,
                        max_new_tokens=args.max_new_tokens,
                        temperature=0.0,
                    )
                    elapsed = time.perf_counter() - t0
                    outputs.add(tuple(out.token_ids[0]))
                    if rep > 0:
                        seconds[name] += elapsed
                        tokens[name] += len(out.token_ids[0])
                if len(outputs) != 1:
                    raise RuntimeError(f"greedy outputs differ between methods on prompt {i}")
            log(f"repetition {rep + 1}/{args.repeats + 1} done" + (" (warm-up)" if rep == 0 else ""))
    finally:
        set_prefetch_distance(distance)
    rows = []
    for name, drafter, pf in methods:
        plain = "none" if pf else "none (no sw prefetch)"
        tps = tokens[name] / seconds[name]
        rows.append(
            {
                "method": name,
                "drafter": drafter,
                "prefetch_bytes": pf,
                "tokens": tokens[name],
                "seconds": seconds[name],
                "tokens_per_second": tps,
                "speedup": tps / (tokens[plain] / seconds[plain]),
            }
        )
    return {
        "command": command,
        "target": args.target,
        "prompt_sets": args.prompt_set,
        "num_prompts": len(prompts),
        "gamma": args.gamma,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "greedy_outputs_identical": True,
        "rows": rows,
    }


def to_markdown(record: dict) -> str:
    lines = [
        "# Packed-kernel software prefetch, end to end",
        "",
        f"Command: `{record['command']}`",
        "",
        f"{record['num_prompts']} prompts ({', '.join(record['prompt_sets'])}), greedy, "
        f"γ = {record['gamma']}, {record['max_new_tokens']} new tokens, {record['threads']} threads; "
        "greedy outputs identical across all rows. Speedup is over plain decode with the same prefetch "
        "setting.",
        "",
        "| method | tok/s | speedup |",
        "|---|---:|---:|",
    ]
    for r in record["rows"]:
        lines.append(f"| {r['method']} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f}× |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    command = " ".join(["python -m experiments.bench_prefetch", *argv])
    record = run(args, log=lambda s: print(s, file=sys.stderr, flush=True), command=command)
    text = to_markdown(record)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_prefetch.json").write_text(json.dumps(record, indent=2))
        (args.out / "bench_prefetch.md").write_text(text)
        print(f"wrote {args.out / 'bench_prefetch.json'} and {args.out / 'bench_prefetch.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
