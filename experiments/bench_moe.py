"""CPU benchmark of moe.MoE against transformers' MixtralSparseMoeBlock and a dense equal-FLOP SwiGLU.

    python -m experiments.bench_moe --out results/bench_moe

For each token count T (default 1, 8, 512, 2048), with E=8 experts, top-2, dim 576, hidden 1536 (fp32):

    ours        moe.MoE.from_hf(block) as it runs by default: on CPU in float32 without autograd, the
                fused native path (moe/native_cpu.py: routing and sort in one C call, experts on
                oneDNN-packed weights one at a time, combine read from the experts' outputs in place)
    ours_general  the same layer with native_cpu = False: the general path (kernels' routing ops,
                kernels.grouped_swiglu_onednn, unpermute); what "ours" was before the native path
    ours_mkl    the same layer with the "torch" grouped-GEMM backend (torch.mm, i.e. MKL)
    hf_eager    MixtralSparseMoeBlock, experts_implementation="eager" (a loop over the hit experts)
    hf_grouped  MixtralSparseMoeBlock, experts_implementation="grouped_mm" (torch's grouped_mm)
    dense       one SwiGLU with hidden = top_k * hidden: the same FLOPs per token, no routing
                (moe.SharedExperts: oneDNN on packed weights on CPU in float32)
    dense_mkl   the same dense SwiGLU with torch.mm (MKL)

The goals compare ours with the better of each pair, so a faster BLAS path for us is matched by the
same path for the dense baseline.

The MoE implementations share one set of weights (the dense ones have their own); all run under
torch.inference_mode, timed in interleaved repetitions (the order rotates every repetition) so machine
noise hits them alike; we report medians. GFLOP/s counts the routed SwiGLU FLOPs,
6 * T * top_k * dim * hidden, for every implementation (the router's 2*T*dim*E is left out). Ratios
are measured in this one run.

Goals (issue 5): ours >= best transformers path at every T, and ours >= 0.9x dense at T >= 512.
Writes bench_moe.json and bench_moe.md to --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from specdec.bench.interleave import time_interleaved
from specdec.bench.report import benchmark_document
from specdec.cli_args import positive_int_list, seed_int
from specdec.summary import Summary, table_from_rows, write_results

IMPLS = ("ours", "ours_general", "ours_mkl", "hf_eager", "hf_grouped", "dense", "dense_mkl")


class DenseSwiGLUMkl(torch.nn.Module):
    """A dense SwiGLU on another module's weights through torch.mm (MKL on CPU)."""

    def __init__(self, dense) -> None:
        super().__init__()
        self.dense = dense

    def forward(self, x):
        from moe.experts import swiglu

        d = self.dense
        return swiglu(x @ d.w_gate_up, d.hidden_dim) @ d.w_down


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(prog="python -m experiments.bench_moe", description=__doc__.split("\n")[0])
    p.add_argument(
        "--tokens", type=positive_int_list, default=[1, 8, 512, 2048], help="token counts T (1,8,512,2048)"
    )
    p.add_argument("--experts", type=int, default=8, help="number of experts E (8)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (2)")
    p.add_argument("--dim", type=int, default=576, help="model dim (576)")
    p.add_argument("--hidden", type=int, default=1536, help="expert hidden dim (1536)")
    p.add_argument("--seconds", type=float, default=20.0, help="timing budget per token count (20)")
    p.add_argument("--min-reps", type=int, default=5, help="minimum interleaved repetitions (5)")
    p.add_argument("--max-reps", type=int, default=300, help="maximum interleaved repetitions (300)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--out", type=Path, default=None, help="directory for bench_moe.json / bench_moe.md")
    return p


def _validate(args: argparse.Namespace) -> None:
    for name in ("experts", "top_k", "dim", "hidden", "min_reps", "max_reps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.top_k > args.experts:
        raise ValueError(f"--top-k must be <= --experts={args.experts}, got {args.top_k}")
    if args.seconds <= 0:
        raise ValueError(f"--seconds must be > 0, got {args.seconds}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")


def build_impls(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    """The implementations by name; the MoE ones share the routed weights."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    import moe

    def block(experts_implementation: str) -> MixtralSparseMoeBlock:
        config = MixtralConfig(
            hidden_size=args.dim,
            intermediate_size=args.hidden,
            num_local_experts=args.experts,
            num_experts_per_tok=args.top_k,
        )
        # How transformers picks the experts forward: config._experts_implementation ("eager" runs the
        # class's own loop; "grouped_mm" dispatches to integrations.moe.grouped_mm_experts_forward).
        config._experts_implementation = experts_implementation
        return MixtralSparseMoeBlock(config).eval()

    torch.manual_seed(args.seed)
    hf_eager = block("eager")
    with torch.no_grad():
        hf_eager.gate.weight.normal_(std=1.0 / args.dim**0.5)  # logits ~ N(0, 1): realistic, varied routing
        hf_eager.experts.gate_up_proj.normal_(std=1.0 / args.dim**0.5)
        hf_eager.experts.down_proj.normal_(std=1.0 / args.hidden**0.5)
    hf_grouped = block("grouped_mm")
    hf_grouped.load_state_dict(hf_eager.state_dict())
    ours = moe.MoE.from_hf(hf_eager).eval()
    ours_general = moe.MoE.from_hf(hf_eager).eval()
    ours_general.native_cpu = False
    ours_mkl = moe.MoE.from_hf(hf_eager).eval()
    ours_mkl.experts.backend = "torch"
    dense = moe.SharedExperts(args.dim, args.top_k * args.hidden).eval()  # SwiGLU, fused gate/up GEMM
    return {
        "ours": ours,
        "ours_general": ours_general,
        "ours_mkl": ours_mkl,
        "hf_eager": hf_eager,
        "hf_grouped": hf_grouped,
        "dense": dense,
        "dense_mkl": DenseSwiGLUMkl(dense),
    }


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the result record (also written to --out when given)."""
    _validate(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    impls = build_impls(args)
    names = list(IMPLS)

    flop_per_token = 6 * args.top_k * args.dim * args.hidden
    rows = []
    with torch.inference_mode():
        for num_tokens in args.tokens:
            x = torch.randn(
                1, num_tokens, args.dim, generator=torch.Generator().manual_seed(args.seed + num_tokens)
            )
            reference = impls["hf_eager"](x)
            max_abs_diff = {
                name: float((impls[name](x) - reference).abs().max())
                for name in ("ours", "ours_general", "ours_mkl", "hf_grouped")
            }
            fns = {name: (lambda m=impls[name], x=x: m(x)) for name in IMPLS}
            times = time_interleaved(
                fns, seconds=args.seconds, min_reps=args.min_reps, max_reps=args.max_reps
            )
            median_s = {name: statistics.median(times[name]) for name in names}
            gflops = {name: flop_per_token * num_tokens / median_s[name] / 1e9 for name in names}
            hf_best = max(("hf_eager", "hf_grouped"), key=lambda n: gflops[n])
            dense_best = max(("dense", "dense_mkl"), key=lambda n: gflops[n])
            row = {
                "tokens": num_tokens,
                "reps": len(times["ours"]),
                "median_ms": {name: median_s[name] * 1e3 for name in names},
                "gflops": gflops,
                "hf_best": hf_best,
                "dense_best": dense_best,
                "ours_vs_hf_best": gflops["ours"] / gflops[hf_best],
                "ours_vs_dense": gflops["ours"] / gflops[dense_best],
                "ours_vs_ours_mkl": gflops["ours"] / gflops["ours_mkl"],
                "ours_vs_ours_general": gflops["ours"] / gflops["ours_general"],
                "max_abs_diff_vs_hf_eager": max_abs_diff,
            }
            row["goal_met"] = row["ours_vs_hf_best"] >= 1.0 and (
                num_tokens < 512 or row["ours_vs_dense"] >= 0.9
            )
            rows.append(row)
            print(_row_text(row), flush=True)
    return {
        "benchmark": "bench_moe",
        "command": "python -m experiments.bench_moe " + " ".join(sys.argv[1:]),
        "config": {
            "experts": args.experts,
            "top_k": args.top_k,
            "dim": args.dim,
            "hidden": args.hidden,
            "dtype": "float32",
            "seconds_per_T": args.seconds,
            "seed": args.seed,
        },
        "env": _env(),
        "results": rows,
    }


def _env() -> dict:
    """The CPU model, the kernels' ISA path, the commit and versions (``specdec bench``'s fields)."""
    from specdec.bench.report import environment

    return {**environment(), "threads": torch.get_num_threads()}


def _row_text(row: dict) -> str:
    g = row["gflops"]
    return (
        f"T={row['tokens']:>5}  GFLOP/s  ours {g['ours']:7.2f}  ours_general {g['ours_general']:7.2f}  "
        f"ours_mkl {g['ours_mkl']:7.2f}  "
        f"hf_eager {g['hf_eager']:7.2f}  hf_grouped {g['hf_grouped']:7.2f}  dense {g['dense']:7.2f}  "
        f"dense_mkl {g['dense_mkl']:7.2f}  |  "
        f"ours/hf_best {row['ours_vs_hf_best']:.2f}  ours/dense {row['ours_vs_dense']:.2f}  "
        f"({row['reps']} reps)"
    )


def to_markdown(record: dict) -> str:
    """The result table in Markdown."""
    c = record["config"]
    lines = [
        f"MoE layer on CPU: {record['env'].get('cpu', '?')} (kernels: {record['env'].get('isa', '?')} path), "
        f"commit {record['env'].get('commit')}; E={c['experts']}, top-{c['top_k']}, dim {c['dim']}, "
        f"hidden {c['hidden']}, fp32, {record['env']['threads']} threads, torch {record['env']['torch']}, "
        f"transformers {record['env']['transformers']}. GFLOP/s (median of interleaved repetitions).",
        "",
        "| T | ours | ours (general path) | ours (MKL) | HF eager | HF grouped_mm | dense equal-FLOP "
        "| dense (MKL) | ours / HF best | ours / dense best | goal |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in record["results"]:
        g = r["gflops"]
        lines.append(
            f"| {r['tokens']} | {g['ours']:.1f} | {g['ours_general']:.1f} | {g['ours_mkl']:.1f} "
            f"| {g['hf_eager']:.1f} "
            f"| {g['hf_grouped']:.1f} | {g['dense']:.1f} | {g['dense_mkl']:.1f} "
            f"| {r['ours_vs_hf_best']:.2f} | {r['ours_vs_dense']:.2f} | {'yes' if r['goal_met'] else 'no'} |"
        )
    lines += ["", f"Command: `{record['command']}`", ""]
    return "\n".join(lines)


def summarize(record: dict) -> Summary:
    """The results table (GFLOP/s per implementation and T, the goal ratios) in the results schema."""
    c, env = record["config"], record["env"]
    rows = [
        {"tokens": r["tokens"], **r["gflops"], **{k: r[k] for k in ("ours_vs_hf_best", "ours_vs_dense")}}
        | {"goal": "yes" if r["goal_met"] else "no"}
        for r in record["results"]
    ]
    caption = (
        f"MoE layer on the CPU, GFLOP/s (median of interleaved repetitions): $E={c['experts']}$, "
        f"top-{c['top_k']}, dim {c['dim']}, hidden {c['hidden']}, fp32, {env.get('threads')} threads; "
        "ours against transformers' MixtralSparseMoeBlock and a dense SwiGLU of equal FLOPs."
    )
    columns = [("tokens", "$T$", "d"), *((k, k.replace("_", " "), ".1f") for k in IMPLS)]
    columns += [("ours_vs_hf_best", "ours / HF best", ".2f"), ("ours_vs_dense", "ours / dense", ".2f")]
    columns += [("goal", "goal", "")]
    return Summary(title="MoE layer on the CPU", tables=(table_from_rows("gflops", caption, columns, rows),))


def main(argv: list[str] | None = None) -> int:
    """Entry point: `python -m experiments.bench_moe [options]`; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        record = run(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if argv is not None:
        record["command"] = "python -m experiments.bench_moe " + " ".join(argv)
    markdown = to_markdown(record)
    print()
    print(markdown)
    if args.out is not None:
        document = benchmark_document(
            record, experiment="bench-moe", summarize=summarize, description=__doc__.split("\n")[0]
        )
        write_results(args.out / "bench_moe.json", document, markdown)
        print(f"wrote {args.out / 'bench_moe.json'} and {args.out / 'bench_moe.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
