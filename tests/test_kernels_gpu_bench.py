"""The prepared GPU script (experiments/gpu_moe_bench.py) runs end to end in its CPU interpreter mode.

No GPU here: --dry-run runs every phase (checks, peak, grouped-GEMM benchmark, routing benchmark) on tiny
shapes under TRITON_INTERPRET=1, so a lent H200 only has to run the same code on real shapes.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_bench_dry_run_writes_a_complete_report(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    done = subprocess.run(
        [sys.executable, "-m", "experiments.gpu_moe_bench", "--dry-run", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_moe_bench.json").read_text())
    assert report["report_schema"] == "specdec-gpu-moe-bench/1" and report["mode"].startswith("dry-run")
    assert report["schema"] == "specdec.summary/1" and report["smoke"]  # the one results schema

    checks = report["checks"]
    names = " ".join(c["name"] for c in checks)
    for needle in (
        "grouped_gemm",
        "tma=0",
        "tma=1",
        "ENK",
        "bfloat16",
        "topk",
        "sort_by_expert",
        "permute",
        "bench",
    ):
        assert needle in names
    assert all(c["ok"] for c in checks)

    assert report["peak"]["tflops"] > 0
    assert report["gemm"], "no grouped-GEMM rows"
    for row in report["gemm"]:
        assert row["errors"] == {}
        for variant in ("triton", "triton_no_tma", "triton_ENK", "grouped_mm", "cublas_dense"):
            assert row["ms"][variant] > 0
        assert set(row["ratios"]) >= {"triton_vs_cublas", "triton_vs_grouped_mm", "triton_fraction_of_peak"}
        assert row["flops"] == 2 * row["M"] * row["K"] * row["N"]
    for row in report["routing"]:
        assert set(row["ms"]["triton"]) == {"topk_routing", "sort_by_expert", "permute", "unpermute"}
    assert "x cuBLAS" in done.stdout and "checks:" in done.stdout


def test_gpu_bench_is_imported_by_nothing():
    users = [
        str(path.relative_to(REPO))
        for top in ("specdec", "moe", "kernels", "experiments", "paper", "tests")
        for path in (REPO / top).rglob("*.py")
        if path.name != "gpu_moe_bench.py"
        and "gpu_moe_bench" in path.read_text()
        and path != pathlib.Path(__file__)
    ]
    assert users == []
