"""The expert-parallel training demo runs under torchrun (2 gloo ranks, a few steps) and learns."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # torchrun: ~12 s

ROOT = Path(__file__).resolve().parents[1]


def test_demo_trains_under_torchrun(tmp_path):
    log = tmp_path / "steps.jsonl"
    steps, batch, seq_len, world, layers, top_k, dim = 4, 4, 32, 2, 2, 2, 32
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
        "-m", "experiments.moe_ep_demo", f"--steps={steps}", f"--batch={batch}", f"--seq-len={seq_len}",
        f"--layers={layers}", f"--top-k={top_k}", f"--dim={dim}", "--hidden=64", f"--jsonl={log}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "replicated parameters identical on all ranks: yes" in proc.stdout, proc.stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert abs(records[0]["loss"] - math.log(256)) < 0.3  # starts near uniform over bytes
    assert records[-1]["loss"] < records[0]["loss"] - 0.1  # and learns
    slots = batch * seq_len * world * top_k
    for r in records:
        assert len(r["expert_load"]) == layers and all(sum(row) == slots for row in r["expert_load"])
        # bytes between ranks: every slot at most once each way, per layer, fp32 rows of dim floats
        assert 0 < r["a2a_forward_bytes"] <= 2 * layers * slots * dim * 4
        assert r["a2a_forward_backward_bytes"] == 2 * r["a2a_forward_bytes"]
