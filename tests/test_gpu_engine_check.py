"""The prepared accelerator check of the engine (experiments/gpu_engine_check.py), run on the CPU."""

from __future__ import annotations

import json

import pytest

from experiments import gpu_engine_check


@pytest.mark.slow
def test_engine_check_passes_on_the_cpu_and_writes_its_record(tmp_path):
    assert gpu_engine_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gpu_engine_check.json").read_text())
    assert record["passed"] and record["device_name"] == "cpu"
    names = {(c["check"], c["drafter"]) for c in record["checks"]}
    assert len(names) == 4 * len(gpu_engine_check.DRAFTERS)
    assert all(c["ok"] for c in record["checks"])


def test_a_failing_check_is_recorded_and_fails_the_run(tmp_path, monkeypatch):
    import specdec

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(specdec, "generate", broken)
    assert gpu_engine_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 1
    record = json.loads((tmp_path / "gpu_engine_check.json").read_text())
    assert not record["passed"] and not any(c["ok"] for c in record["checks"])
    assert "planted" in record["checks"][0]["error"] and "traceback" in record["checks"][0]
