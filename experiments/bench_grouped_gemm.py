"""CPU benchmark of the grouped-GEMM torch backend against the alternatives, measured side by side.

    python -m experiments.bench_grouped_gemm [--tokens 1 8 512 2048] [--backward] [--rounds 7] [--threads N]

Legend: T tokens, E experts, K input features, N output features, M = T * top_k rows.
For each T and each of the two matrix products of a SwiGLU expert (D=576 -> 2F=3072 for the fused
gate/up projection, F=1536 -> D=576 for the down projection; E=8, top-2, the issue's shapes) it times:
  torch-backend   kernels.grouped_gemm(..., backend="torch"): one torch.mm per non-empty group, out=
  _grouped_mm     torch._grouped_mm(x, w, offs=...), PyTorch's own grouped kernel
  reference       the split / matmul / cat oracle
  dense           one torch.mm of the same M rows by one [K, N] matrix: the same FLOPs, no grouping
Variants run interleaved, call after call (``specdec.bench.interleave.time_interleaved``: at least
--rounds calls each, about 0.05 s per variant and round), and the median call is reported, so that a
noisy shared machine slows all of them alike; the ratios are what to read.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from kernels.grouped_gemm import grouped_gemm
from kernels.grouped_gemm.reference import grouped_gemm_reference
from specdec.bench.interleave import time_interleaved

SHAPES = {"gate_up": (576, 3072), "down": (1536, 576)}


def _variants(x_MK, w_EKN, group_sizes_E, backward: bool) -> dict[str, Callable[[], object]]:
    offsets_E = torch.cumsum(group_sizes_E, 0).to(torch.int32)
    w_dense_KN = w_EKN[0].clone()
    if backward:
        x_MK = x_MK.clone().requires_grad_()
        w_EKN = w_EKN.clone().requires_grad_()
        w_dense_KN.requires_grad_()

    def run(f):
        def call():
            y = f()
            if backward:
                y.backward(torch.ones_like(y))
            return y

        return call

    variants = {
        "torch-backend": run(lambda: grouped_gemm(x_MK, w_EKN, group_sizes_E, backend="torch")),
        "reference": run(lambda: grouped_gemm_reference(x_MK, w_EKN, group_sizes_E)),
        "dense": run(lambda: x_MK @ w_dense_KN),
    }
    if hasattr(torch, "_grouped_mm"):
        variants["_grouped_mm"] = run(lambda: torch._grouped_mm(x_MK, w_EKN, offs=offsets_E))
    return variants


def main(argv: list[str] | None = None) -> None:
    """Print a table of GFLOP/s and ratios for every T and GEMM shape."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 512, 2048])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7, help="at least this many timed calls per variant")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, backward={args.backward}")
    header = f"{'T':>5} {'gemm':>8} " + " ".join(
        f"{n:>14}" for n in ("torch-backend", "_grouped_mm", "reference", "dense")
    )
    print(header + "   backend/_grouped_mm  backend/dense  (GFLOP/s)")
    for num_tokens in args.tokens:
        # routing of a random router: roughly balanced groups, as in a trained model
        logits_TE = torch.randn(num_tokens, args.experts, generator=gen)
        experts_TK = logits_TE.topk(args.top_k, dim=-1).indices
        group_sizes_E = torch.bincount(experts_TK.reshape(-1), minlength=args.experts)
        rows = num_tokens * args.top_k
        for name, (k, n) in SHAPES.items():
            x_MK = torch.randn(rows, k, generator=gen)
            w_EKN = torch.randn(args.experts, k, n, generator=gen) / k**0.5
            variants = _variants(x_MK, w_EKN, group_sizes_E, args.backward)
            samples = time_interleaved(
                variants, seconds=0.05 * args.rounds * len(variants), min_reps=args.rounds, max_reps=10_000
            )
            flops = 2 * rows * k * n * (3 if args.backward else 1)
            gflops = {v: flops / statistics.median(s) / 1e9 for v, s in samples.items()}
            cells = " ".join(
                f"{gflops.get(v, float('nan')):>14.1f}"
                for v in ("torch-backend", "_grouped_mm", "reference", "dense")
            )
            ratio_g = gflops["torch-backend"] / gflops.get("_grouped_mm", float("nan"))
            ratio_d = gflops["torch-backend"] / gflops["dense"]
            print(f"{num_tokens:>5} {name:>8} {cells}   {ratio_g:>19.2f}  {ratio_d:>13.2f}", flush=True)


if __name__ == "__main__":
    main()
