"""The prepared GPU check (experiments/gpu_check.py): its CPU mode end to end, and its runner's rules."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments import gpu_check

ROOT = Path(__file__).resolve().parents[1]
CUDA_ONLY = {"compiled_vs_eager", "host_syncs", "forward_inductor"}


@pytest.mark.slow
def test_the_cpu_mode_runs_every_check_and_says_which_it_skipped(tmp_path):
    cmd = [sys.executable, "-m", "experiments.gpu_check", "--device", "cpu", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "CPU mode" in done.stdout
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    assert doc["schema"] == "specdec.summary/1" and doc["experiment"] == "gpu-check"
    assert doc["device"] == "cpu" and doc["passed"] and doc["environment"]["torch"]
    checks = {c["name"]: c for c in doc["checks"]}
    assert list(checks) == [name for name, _, _ in gpu_check.CHECKS]  # every check, in order
    for name in CUDA_ONLY:
        assert checks[name]["status"] == "skipped" and "CUDA" in checks[name]["reason"]
        assert f"SKIPPED {name}" in done.stdout
    for name in set(checks) - CUDA_ONLY:
        assert checks[name]["status"] == "pass", checks[name]
    # the CPU parts measured what they say
    assert checks["greedy_vs_transformers"]["formats"]["fp32"]["equal"] == [True] * len(gpu_check.TEXTS)
    assert checks["greedy_vs_transformers"]["formats"]["gguf"]["status"] == "skipped"
    assert checks["engine"]["checks"].keys() == {
        f"{d}/{c}"
        for d in ("none", "ngram", "eagle", "default")
        for c in ("batch_vs_solo", "staggered_vs_solo", "seed_repeats")
    }
    assert checks["forward_8b"]["eager"]["wall_ms"] > 0 and "skipped" in checks["forward_8b"]["graphs"]
    assert checks["moe_ep"]["backend"] == "gloo"
    assert {row["check"] for row in doc["tables"][0]["rows"]} == set(checks)


def _ctx():
    return gpu_check.Context(device="cpu", target="tiny-random", new_tokens=4, speed_tokens=4)


def test_a_check_that_fails_raises_or_overruns_does_not_stop_the_others(tmp_path, monkeypatch):
    def raises(ctx):
        raise RuntimeError("planted")

    def slow(ctx):
        try:
            time.sleep(5)
        except Exception:  # a check's own broad except does not swallow its time bound
            pass
        return {"ok": True}

    def skips(ctx):
        raise gpu_check.Skip("not here")

    checks = (
        ("raises", raises, 10),
        ("fails", lambda ctx: {"ok": False, "why": 1}, 10),
        ("slow", slow, 0.2),
        ("skips", skips, 10),
        ("passes", lambda ctx: {"ok": True, "figure": 2.5}, 10),
    )
    monkeypatch.setattr(gpu_check, "CHECKS", checks)
    monkeypatch.setattr(gpu_check, "CPU_BOUND_FACTOR", 1)
    record = gpu_check.run(_ctx(), tmp_path, "cmd", budget_s=60)
    status = {c["name"]: c["status"] for c in record["checks"]}
    assert status == {"raises": "fail", "fails": "fail", "slow": "fail", "skips": "skipped", "passes": "pass"}
    by_name = {c["name"]: c for c in record["checks"]}
    assert "planted" in by_name["raises"]["error"] and "traceback" in by_name["raises"]
    assert "time bound" in by_name["slow"]["error"] and by_name["slow"]["seconds"] < 2
    assert by_name["skips"]["reason"] == "not here" and by_name["passes"]["figure"] == 2.5
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    assert not doc["passed"] and [c["name"] for c in doc["checks"]] == [c[0] for c in checks]


def test_the_file_is_written_after_every_check_and_a_spent_budget_skips(tmp_path, monkeypatch):
    seen = []

    def first(ctx):
        time.sleep(0.3)
        return {"ok": True}

    def second(ctx):
        seen.append(json.loads((tmp_path / "gpu-check.json").read_text())["checks"])
        return {"ok": True}

    monkeypatch.setattr(gpu_check, "CHECKS", (("first", first, 10), ("second", second, 10)))
    record = gpu_check.run(_ctx(), tmp_path, "cmd", budget_s=60)
    assert [c["name"] for c in seen[0]] == ["first"]  # on disk before the second began
    assert record["passed"]
    monkeypatch.setattr(gpu_check, "CHECKS", (("first", first, 10), ("second", second, 10)))
    record = gpu_check.run(_ctx(), tmp_path, "cmd", budget_s=0.2)
    assert [c["status"] for c in record["checks"]] == ["skipped", "skipped"]
    assert "budget" in record["checks"][0]["reason"]


def test_hbm_bandwidth_by_device_name():
    assert gpu_check.hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert gpu_check.hbm_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert gpu_check.hbm_bandwidth("NVIDIA H200") == 4.8e12
    assert gpu_check.hbm_bandwidth("NVIDIA GeForce RTX 4090") is None


def test_random_llama_builds_the_shapes_it_is_given():
    import torch

    target = gpu_check.random_llama(gpu_check.SMALL_LLAMA, "cpu")
    c = target.config
    assert (c.hidden_size, c.num_layers, c.vocab_size) == (128, 2, 512)
    assert c.rope_parameters["rope_type"] == "llama3"
    per_layer = 128 * (4 * 32 + 2 * 2 * 32) + 128 * 4 * 32 + 3 * 128 * 256
    assert target.bf16_weight_bytes == 2 * (2 * per_layer + 512 * 128)
    target.reset(1, 8)
    logits = target.forward(torch.tensor([[1, 2, 3]]), torch.tensor([0])).logits_BTV
    assert logits.shape == (1, 3, 512) and torch.isfinite(logits).all()


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--checks", "nope"])
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--budget-s", "0"])
