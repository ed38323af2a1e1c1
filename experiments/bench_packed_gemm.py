"""The packed CPU kernel against the machine's read bandwidth, per ISA path and weight format.

    python -m experiments.bench_packed_gemm [--isa avx2,generic] [--megabytes 96] [--rows 1,2,4,7]

Legend: M rows of x, O output features, I input features.

For every ISA path this CPU runs (``kernels.native.runnable_isas``: on an AVX-512 machine that is the
AVX-512 build, the AVX2 build and the generic one) and every weight format (fp32, bf16, q8, q4, and
q8a8 / q4a8: the same weights with 8-bit activations and integer dot products), it
packs one weight matrix of about ``--megabytes`` of packed bytes (far larger than the caches, so every
call streams it from memory) and times ``packed_linear`` on M rows, interleaved round after round with
the machine's read bandwidth (``x.sum()`` over 512 MB). It prints, per path and format, the bytes
streamed per second at each M, that rate over the read bandwidth measured in the same run (the goal is
>= 80 % at one row), and the time of M rows relative to one row. The header names the CPU, the path
this machine picks by default and the commit.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from kernels.native import cpu_isa, cpu_model, runnable_isas
from kernels.packed_gemm import PackedWeight, pack_weight, packed_linear
from kernels.quant import quantize_int4, quantize_int8
from specdec.bench.interleave import time_interleaved
from specdec.bench.report import benchmark_document, command_line
from specdec.cli_args import positive_int_list
from specdec.summary import Summary, table_from_rows, write_results

__all__ = ["pack_format", "main"]

FORMATS = ("f32", "bf16", "q8", "q4", "q8a8", "q4a8")
BYTES_PER_WEIGHT = {"f32": 4.0, "bf16": 2.0, "q8": 1.0 + 2 / 32, "q4": 0.5 + 4 / 32}
BYTES_PER_WEIGHT |= {"q8a8": BYTES_PER_WEIGHT["q8"], "q4a8": BYTES_PER_WEIGHT["q4"]}


def pack_format(fmt: str, w_OI: torch.Tensor, isa: str) -> PackedWeight:
    """``w_OI`` packed in ``fmt`` for the ``isa`` path (q8: per-channel int8; q4: int4 in groups of 32;
    q8a8 / q4a8: those with 8-bit activations)."""
    if fmt == "f32":
        return pack_weight(w_OI, torch.float32, isa=isa)
    if fmt == "bf16":
        return pack_weight(w_OI, torch.bfloat16, isa=isa)
    if fmt in ("q8", "q8a8"):
        return quantize_int8(w_OI).pack(isa, act8=fmt == "q8a8")
    if fmt in ("q4", "q4a8"):
        return quantize_int4(w_OI, 32).pack(isa, act8=fmt == "q4a8")
    raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")


def _median_of_best(times: list[float], per_round: int) -> float:
    """The median over rounds of each round's fastest call (``per_round`` calls a round)."""
    return statistics.median(min(times[i : i + per_round]) for i in range(0, len(times), per_round))


def _bench_path(isa: str, megabytes: float, rows: list[int], rounds: int, log) -> dict:
    I = 4096  # noqa: E741
    out: dict = {}
    big = torch.randn(512 * 2**20 // 4)
    for fmt in FORMATS:
        O = max(64, int(megabytes * 2**20 / (I * BYTES_PER_WEIGHT[fmt])) // 64 * 64)  # noqa: E741
        w = pack_format(fmt, torch.randn(O, I), isa)
        xs = {m: torch.randn(m, I) for m in rows}
        fns = {"read": big.sum} | {m: (lambda x=xs[m], w=w: packed_linear(x, w)) for m in rows}
        # interleaved: the machine's drift hits the bandwidth and every M alike; 3 calls a round
        times = time_interleaved(fns, min_reps=3 * rounds, max_reps=3 * rounds, warmup=0)
        bw = big.numel() * 4 / _median_of_best(times["read"], 3)
        t = {m: _median_of_best(times[m], 3) for m in rows}
        out[fmt] = {
            "out_features": O,
            "in_features": I,
            "packed_bytes": w.nbytes,
            "read_bandwidth_gb_s": bw / 1e9,
            "ms": {m: t[m] * 1e3 for m in rows},
            "gb_s": {m: w.nbytes / t[m] / 1e9 for m in rows},
            "of_bandwidth": {m: w.nbytes / t[m] / bw for m in rows},
            "rel_to_one_row": {m: t[m] / t[rows[0]] for m in rows},
        }
        r = out[fmt]
        log(
            f"{isa:8s} {fmt:5s} {w.nbytes / 2**20:6.1f} MB  "
            + "  ".join(f"M={m}: {r['gb_s'][m]:5.1f} GB/s ({r['of_bandwidth'][m]:4.0%})" for m in rows)
            + f"  | read {bw / 1e9:.1f} GB/s"
        )
    return out


def to_markdown(record: dict) -> str:
    """The result table in Markdown."""
    rows = record["rows"]
    lines = [
        f"Packed CPU kernel, one weight matrix streamed from memory. CPU: {record['cpu']}, default path "
        f"{record['default_isa']}, {record['threads']} threads, commit {record['commit']}.",
        "",
        "| ISA path | format | MB | "
        + " | ".join(f"M={m} GB/s (of read bw)" for m in rows)
        + " | "
        + " | ".join(f"M={m} / M={rows[0]}" for m in rows[1:])
        + " |",
        "|---|---|---:|" + "---:|" * (2 * len(rows) - 1),
    ]
    for isa, formats in record["paths"].items():
        for fmt, r in formats.items():
            cells = [f"{r['gb_s'][m]:.1f} ({r['of_bandwidth'][m]:.0%})" for m in rows]
            rel = [f"{r['rel_to_one_row'][m]:.2f}×" for m in rows[1:]]
            lines.append(
                f"| {isa} | {fmt} | {r['packed_bytes'] / 2**20:.0f} | " + " | ".join(cells + rel) + " |"
            )
    return "\n".join(lines) + "\n"


def summarize(record: dict) -> Summary:
    """The results table (GB/s per ISA path, format and row count M) in the results schema."""
    rows_M = [str(m) for m in record["rows"]]
    rows = []
    for isa, formats in record["paths"].items():
        for fmt, r in formats.items():
            row = {"isa": isa, "format": fmt, "mb": r["packed_bytes"] / 2**20}
            row |= {f"gb_s_{m}": r["gb_s"][m] for m in rows_M}
            row |= {f"of_bw_{m}": r["of_bandwidth"][m] for m in rows_M}
            row |= {f"rel_{m}": r["rel_to_one_row"][m] for m in rows_M[1:]}
            rows.append(row)
    columns = [("isa", "ISA path", ""), ("format", "format", ""), ("mb", "MB", ".0f")]
    for m in rows_M:
        columns += [(f"gb_s_{m}", f"$M={m}$ GB/s", ".1f"), (f"of_bw_{m}", "of read bw", ".0%")]
    columns += [(f"rel_{m}", f"$M={m}$ / $M={rows_M[0]}$", ".2f") for m in rows_M[1:]]
    caption = (
        "Packed CPU kernel, one weight matrix streamed from memory: GB/s of packed weight read per "
        f"product of $M$ rows (median of interleaved rounds), {record['threads']} threads."
    )
    return Summary(
        title="Packed CPU kernel bandwidth", tables=(table_from_rows("bandwidth", caption, columns, rows),)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench_packed_gemm", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--isa", default=",".join(runnable_isas()), help="ISA paths (default: every one this CPU runs)"
    )
    p.add_argument("--megabytes", type=float, default=96.0, help="packed bytes of the weight (96)")
    p.add_argument("--rows", type=positive_int_list, default=[1, 2, 4, 7], help="row counts M (1,2,4,7)")
    p.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds of 3 calls, median of their best (5)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here (and a .md beside)")
    args = p.parse_args(argv)
    isas = [s for s in args.isa.split(",") if s]
    unknown = [s for s in isas if s not in runnable_isas()]
    if unknown:
        p.error(f"--isa: {unknown} not runnable on this CPU; choose from {runnable_isas()}")
    if args.megabytes <= 0 or args.rounds < 1:
        p.error("--megabytes must be > 0 and --rounds >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec.bench.report import environment

    env = environment()
    print(
        f"CPU: {cpu_model()}, default ISA path {cpu_isa()}, {torch.get_num_threads()} threads, "
        f"commit {env['commit']}"
    )
    record = {
        "cpu": cpu_model(),
        "default_isa": cpu_isa(),
        "threads": torch.get_num_threads(),
        "commit": env["commit"],
        "environment": env,
        "command": command_line("python -m experiments.bench_packed_gemm", argv),
        "rows": args.rows,
        "paths": {isa: _bench_path(isa, args.megabytes, args.rows, args.rounds, print) for isa in isas},
    }
    print()
    print(to_markdown(record))
    if args.json is not None:
        document = benchmark_document(
            record, experiment="packed-gemm", summarize=summarize, description=__doc__.split("\n")[0]
        )
        write_results(args.json, document, to_markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
