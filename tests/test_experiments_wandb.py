"""W&B logging: offline runs under --out, and nothing breaks without wandb or without a login."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console

from experiments.catalog.leviathan_table1 import PUBLISHED
from experiments.experiment import Experiment
from experiments.runner import run_experiment
from experiments.sweep import Sweep
from experiments.wandb_log import NullRun, open_wandb_run, wandb_mode
from specdec.summary import Summary

REPO = Path(__file__).resolve().parent.parent


def test_wandb_mode_defaults_to_offline_without_a_key(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"


@pytest.mark.slow
def test_leviathan_table1_cli_writes_the_table_and_offline_wandb_runs(tmp_path):
    """The done-when command (with --smoke: same six table rows, coarser figure grid)."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("WANDB_API_KEY", None)
    out = tmp_path / "out"
    argv = ["run", "leviathan-table1", "--out", str(out), "--wandb", "--smoke"]
    done = subprocess.run(
        [sys.executable, "-m", "experiments", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    exp_dir = out / "leviathan-table1"
    summary = json.loads((exp_dir / "summary.json").read_text())
    rows = summary["tables"][0]["rows"]
    assert len(rows) == 6
    for row in rows:
        ops, speed = PUBLISHED[(row["alpha"], row["gamma"])]
        assert row["ops_paper"] == ops and row["wall_paper"] == speed
        assert abs(row["ops_ours"] - ops) <= 0.005 and abs(row["wall_ours"] - speed) <= 0.005
    run_dirs = [p for p in exp_dir.iterdir() if (p / "DONE").exists()]
    assert len(run_dirs) == summary["num_runs"] == 8
    for run_dir in run_dirs:
        offline = list((run_dir / "wandb").glob("offline-run-*"))
        assert len(offline) == 1, run_dir
        log = next(offline[0].glob("*.wandb")).read_bytes()
        assert b"leviathan-table1" in log  # group / config
        metric = b"walltime_improvement"
        assert metric in log
    summary_runs = list((exp_dir / "wandb").glob("offline-run-*"))
    assert len(summary_runs) == 1
    media = summary_runs[0] / "files" / "media"
    assert list(media.glob("table/**/*.json")) and list(media.glob("images/**/*.png"))


@dataclass(frozen=True, kw_only=True)
class StepConfig:
    index: int


def _run_step(config: StepConfig, ctx) -> dict:
    ctx.log({"value": float(config.index)})
    return {"value": config.index}


TINY = Experiment(
    name="toy",
    description="four trivial runs",
    plan=lambda smoke=False: Sweep(StepConfig(index=0), {"index": [0, 1, 2, 3]}),
    runners={StepConfig: _run_step},
    summarize=lambda records: Summary(title="tiny"),
)


def _toy_run(tmp_path: Path):
    return run_experiment(TINY, out=tmp_path, smoke=True, use_wandb=True, console=Console(quiet=True))


def test_missing_wandb_warns_and_continues(tmp_path, monkeypatch):
    import experiments.wandb_log as wandb_log

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    monkeypatch.setattr(wandb_log, "_warned_missing", False)
    with pytest.warns(UserWarning, match="wandb is not installed"):
        report = _toy_run(tmp_path)
    assert len(report.ran) == 4 and not report.failed
    assert not list(tmp_path.glob("toy/*/wandb"))


def test_failing_wandb_init_warns_and_continues(tmp_path, monkeypatch):
    fake = types.ModuleType("wandb")

    def init(**kwargs):
        raise RuntimeError("api key not configured (no-tty)")

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with pytest.warns(UserWarning, match="wandb.init failed"):
        report = _toy_run(tmp_path)
    assert len(report.ran) == 4 and not report.failed


def test_failing_wandb_log_disables_wandb_for_the_run(tmp_path, monkeypatch):
    class Run:
        summary: dict = {}

        def log(self, *args, **kwargs):
            raise OSError("disk full")

        def finish(self, exit_code=0):
            pass

    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: Run()
    fake.Settings = lambda **kwargs: None
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = open_wandb_run(directory=tmp_path, project="p", name="n", group="g", job_type="run", config={})
    assert run.active
    with pytest.warns(UserWarning, match="W&B log failed"):
        run.log({"x": 1.0}, step=0)
    assert not run.active
    run.log({"x": 2.0}, step=1)  # silently ignored now
    assert isinstance(NullRun(), NullRun) and not NullRun.active
