"""``python -m experiments``: list, run flags, YAML overrides, and delegation to other modules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import experiments.cli as cli
from experiments.config import run_id
from experiments.registry import EXPERIMENTS, get_experiment
from specdec.registry import Registry

REPO = Path(__file__).resolve().parent.parent


def test_list_names_every_registered_experiment(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("leviathan-table1", "moe-verify-cost", "switch-tables"):
        assert name in out
    assert "12 runs (8 with --smoke)" in out


def test_unknown_experiment_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown experiment 'nope'; known experiments: .*leviathan-table1"):
        get_experiment("nope")
    assert "leviathan-table1" in EXPERIMENTS.names()


def test_usage_and_unknown_command(capsys):
    assert cli.main([]) == 2
    assert "commands:" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'; known commands:" in capsys.readouterr().err


def test_delegated_command_gets_the_remaining_argv(monkeypatch):
    seen = []
    registry = Registry("command", "none", builtins={})
    registry.register("echo", lambda argv: seen.append(list(argv)) or 7)
    monkeypatch.setattr(cli, "COMMANDS", registry)
    assert cli.main(["echo", "--steps", "3", "x"]) == 7
    assert seen == [["--steps", "3", "x"]]


def test_user_errors_are_one_line_and_ctrl_c_stops_cleanly(monkeypatch, capsys, tmp_path):
    """A bad --set value, a bad YAML file or an unknown command: one line on stderr, exit 2; Ctrl-C
    inside a command: a short message, exit 130, no traceback."""
    assert cli.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'nope'; known commands:" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["run", "leviathan-table1", "--dry-run", "--set", "c=[1, 2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: [1, 2\n")
    assert cli.main(["run", "leviathan-table1", "--dry-run", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and len(err.strip().splitlines()) == 1

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "COMMANDS", Registry("command", "none"))
    cli.COMMANDS.register("ghost", interrupted)
    assert cli.main(["ghost"]) == 130
    assert "interrupted; finished runs are kept" in capsys.readouterr().err


def test_train_drafter_and_bench_moe_delegate_to_their_modules():
    """train-drafter is an alias: the same function as `specdec train-head`."""
    assert cli._BUILTIN_COMMANDS["train-drafter"] == "specdec.drafters.eagle.train.command:main"
    assert cli._BUILTIN_COMMANDS["bench-moe"] == "experiments.bench_moe:main"


def test_train_drafter_is_the_train_head_command(capsys):
    from specdec.drafters.eagle.train.command import main as train_head

    assert cli.COMMANDS.get("train-drafter") is train_head
    assert cli.main(["train-drafter", "--steps", "0"]) == 2
    assert "TrainConfig.steps must be an int >= 1" in capsys.readouterr().err


def test_dry_run_shard_and_yaml_overrides(tmp_path, capsys):
    assert cli.main(["run", "leviathan-table1", "--dry-run"]) == 0
    all_ids = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert len(all_ids) == 12
    shards = []
    for i in range(3):
        assert cli.main(["run", "leviathan-table1", "--dry-run", "--shard", f"{i}/3"]) == 0
        shards.append({line.split()[0] for line in capsys.readouterr().out.splitlines()})
    assert set().union(*shards) == all_ids and sum(map(len, shards)) == 12
    config = tmp_path / "sweep.yaml"
    config.write_text(
        "experiment: leviathan-table1\nbase:\n  c: 0.05\naxes:\n  'alpha,gamma': [[0.5, 1], [0.95, 7]]\n"
    )
    assert (
        cli.main(["run", "leviathan-table1", "--dry-run", "--config", str(config), "--set", "num_alphas=5"])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line.split(" ", 2)[2]) for line in lines if "Table1RowConfig" in line]
    assert [(r["alpha"], r["gamma"], r["c"]) for r in rows] == [(0.5, 1, 0.05), (0.95, 7, 0.05)]
    curves = [json.loads(line.split(" ", 2)[2]) for line in lines if "OptimalGammaConfig" in line]
    assert len(curves) == 6 and {c["num_alphas"] for c in curves} == {5}
    assert sorted(c["c"] for c in curves) == [0.01, 0.02, 0.05, 0.1, 0.2, 0.5]  # the axis overrides base c


def test_bad_flags_exit_with_a_message(capsys):
    for argv, message in [
        (["run", "leviathan-table1", "--shard", "3/2"], "shard must satisfy"),
        (["run", "leviathan-table1", "--smoke", "--publish"], "--publish with --smoke"),
        (["run", "leviathan-table1", "--set", "gamma"], "--set expects KEY=VALUE"),
        (["run", "nope"], "unknown experiment 'nope'"),
    ]:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_run_then_summarize_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["run", "moe-verify-cost", "--smoke", "--out", str(out), "--shard", "0/2"]
    done = subprocess.run(
        [sys.executable, "-m", "experiments", *argv], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    summary_path = out / "moe-verify-cost" / "summary.json"
    assert not json.loads(summary_path.read_text())["complete"]
    assert cli.main(["run", "moe-verify-cost", "--smoke", "--out", str(out), "--shard", "1/2"]) == 0
    summary_path.unlink()
    assert cli.main(["summarize", "moe-verify-cost", "--smoke", "--out", str(out)]) == 0
    summary = json.loads(summary_path.read_text())
    ids = {run_id(c) for c in get_experiment("moe-verify-cost").configs(smoke=True)}
    assert summary["complete"] and summary["smoke"] and summary["num_runs"] == len(ids) > 1
    assert {p.name for p in (out / "moe-verify-cost").iterdir() if p.is_dir()} == ids
