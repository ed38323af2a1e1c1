"""The CPU benchmark runs end to end at toy sizes; moe/ uses only the public kernels API and never triton."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import bench_moe

ROOT = Path(__file__).resolve().parents[1]


def test_bench_moe_smoke(tmp_path, capsys):
    argv = "--tokens 1,6 --experts 4 --top-k 2 --dim 32 --hidden 48 --seconds 0.05 --min-reps 2 --max-reps 3"
    assert bench_moe.main([*argv.split(), "--threads", "1", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "bench_moe.json").read_text())
    assert [r["tokens"] for r in record["results"]] == [1, 6]
    for row in record["results"]:
        assert set(row["gflops"]) == {
            "ours",
            "ours_general",
            "ours_mkl",
            "hf_eager",
            "hf_grouped",
            "dense",
            "dense_mkl",
        }
        assert all(v > 0 for v in row["gflops"].values())
        assert 2 <= row["reps"] <= 3
        assert max(row["max_abs_diff_vs_hf_eager"].values()) < 1e-4  # the same function, computed 3 ways
        assert row["ours_vs_hf_best"] > 0 and row["ours_vs_dense"] > 0
    assert "| T | ours |" in (tmp_path / "bench_moe.md").read_text()
    assert "ours/hf_best" in capsys.readouterr().out


def test_bench_moe_rejects_bad_arguments(capsys):
    assert bench_moe.main(["--experts", "4", "--top-k", "5"]) == 2
    assert "--top-k" in capsys.readouterr().err


def test_moe_imports_only_the_public_kernels_api():
    for path in sorted((ROOT / "moe").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] != "triton", f"{path.name} imports {name}"
                assert not name.startswith("kernels."), f"{path.name} imports private {name}"


@pytest.mark.slow
def test_importing_moe_does_not_import_triton():
    # (A forward with autograd may: torch's custom-op machinery imports torch._dynamo, which probes triton.)
    code = "import sys, moe; moe.MoE(8, 8, 4, 2); sys.exit('triton' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
