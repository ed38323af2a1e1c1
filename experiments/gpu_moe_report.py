"""The GPU MoE benchmark's report in the one results schema (``specdec.summary/1``): its grouped-GEMM
table beside the raw report. Kept apart from the benchmark script, which nothing imports."""

from __future__ import annotations

from specdec.summary import Summary, summary_document, table_from_rows

__all__ = ["summarize", "gpu_document"]


def summarize(report: dict) -> Summary:
    """The grouped-GEMM table (TFLOP/s of ours, ``torch._grouped_mm``'s better layout and cuBLAS on the
    same FLOPs, and the goal ratios) in the results schema."""
    rows = []
    for row in report["gemm"]:
        if "skipped" in row:
            continue
        tf = row["tflops"]
        best_gmm = max(tf.get("grouped_mm", 0.0), tf.get("grouped_mm_ENK", 0.0)) or None
        cells = {"triton": tf.get("triton"), "grouped_mm": best_gmm, "cublas": tf.get("cublas_dense")}
        rows.append({k: row[k] for k in ("model", "T", "gemm")} | cells | row["ratios"])
    columns = [
        ("model", "shape", ""),
        ("T", "$T$", "d"),
        ("gemm", "GEMM", ""),
        ("triton", "triton", ".1f"),
        ("grouped_mm", "\\texttt{\\_grouped\\_mm}", ".1f"),
        ("cublas", "cuBLAS", ".1f"),
        ("triton_vs_cublas", "$\\times$ cuBLAS", ".2f"),
        ("triton_vs_grouped_mm", "$\\times$ \\texttt{\\_grouped\\_mm}", ".2f"),
        ("triton_fraction_of_peak", "$\\times$ peak", ".2f"),
    ]
    peak = (report.get("peak") or {}).get("tflops")
    caption = (
        f"Grouped GEMM of MoE expert shapes on {report['device']}, bf16, TFLOP/s (CUDA events, L2 "
        "flushed): our Triton kernel against \\texttt{torch.\\_grouped\\_mm} (the better of its two "
        "weight layouts) and one cuBLAS GEMM of the same FLOPs"
        + (f"; measured bf16 peak {peak:.0f}." if peak else ".")
    )
    return Summary(title="Grouped GEMM on the GPU", tables=(table_from_rows("gemm", caption, columns, rows),))


def gpu_document(report: dict, command: str) -> dict:
    """The results file: ``report`` beside its ``specdec.summary/1`` part (a dry run is a smoke run)."""
    env = {k: report.get(k) for k in ("device", "torch", "triton", "cuda")} | {"git_commit": None}
    document = summary_document(
        experiment="gpu-moe-bench",
        summary=summarize(report),
        command=command,
        machine=f"{report['device']}, torch {report['torch']}, triton {report['triton']}, "
        f"CUDA {report['cuda']}",
        env=env,
        description="Grouped GEMM and routing kernels on the GPU against torch and cuBLAS",
        smoke=report["mode"] != "gpu",
    )
    return {**report, **document}
