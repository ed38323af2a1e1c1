"""The resumable runner: run folder layout, skipping finished runs, interrupted sweeps, shards, publish."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from rich.console import Console

from experiments.config import run_id, validate_config
from experiments.experiment import Experiment
from experiments.runner import plan_configs, run_experiment
from experiments.store import DONE_FILE, is_finished
from experiments.sweep import Sweep
from specdec.summary import SCHEMA, Summary, table_from_rows

CALLS: list[tuple[int, float]] = []
FAIL_AT: dict[str, object] = {}


@dataclass(frozen=True, kw_only=True)
class ToyConfig:
    gamma: int
    temperature: float = 0.0
    steps: int = 3

    def __post_init__(self) -> None:
        validate_config(self)


def run_toy(config: ToyConfig, ctx) -> dict:
    CALLS.append((config.gamma, config.temperature))
    (ctx.run_dir / "partial.txt").write_text("work in progress")
    for step in range(config.steps):
        ctx.log({"loss": 1.0 / (step + 1), "gamma": config.gamma})
    if FAIL_AT.get("gamma") == config.gamma:
        raise FAIL_AT["error"]  # type: ignore[misc]
    return {"score": config.gamma * 10 + config.temperature}


def toy_plan(*, smoke: bool = False) -> Sweep:
    return Sweep(ToyConfig(gamma=1), {"gamma": [1, 2] if smoke else [1, 2, 3, 4], "temperature": [0.0, 1.0]})


def toy_summary(records) -> Summary:
    rows = [{"gamma": r.config.gamma, "temperature": r.config.temperature, **r.result} for r in records]
    table = table_from_rows("toy", "Toy.", [("gamma", "$\\gamma$", "d"), ("score", "Score", ".1f")], rows)
    return Summary(title="Toy", tables=(table,))


TOY = Experiment(
    name="toy", description="toy", plan=toy_plan, runners={ToyConfig: run_toy}, summarize=toy_summary
)


@pytest.fixture(autouse=True)
def _reset():
    CALLS.clear()
    FAIL_AT.clear()
    yield
    CALLS.clear()
    FAIL_AT.clear()


def quiet() -> Console:
    return Console(quiet=True)


def test_layout_of_a_run_folder_and_the_summary(tmp_path):
    report = run_experiment(TOY, out=tmp_path, console=quiet())
    assert len(report.ran) == 8 and not report.skipped and not report.failed
    config = ToyConfig(gamma=3, temperature=1.0)
    run_dir = tmp_path / "toy" / run_id(config)
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "DONE",
        "config.json",
        "env.json",
        "metrics.jsonl",
        "partial.txt",
        "result.json",
    ]
    stored = json.loads((run_dir / "config.json").read_text())
    assert stored == {
        "experiment": "toy",
        "run_id": run_id(config),
        "type": f"{ToyConfig.__module__}:ToyConfig",
        "config": {"gamma": 3, "temperature": 1.0, "steps": 3},
    }
    env = json.loads((run_dir / "env.json").read_text())
    for key in ("python", "torch", "transformers", "triton", "git_commit", "device", "hostname", "cpu_count"):
        assert key in env
    assert env["cpu_count"] >= 1 and env["device"] in ("cpu", "cuda")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2] and lines[2]["loss"] == pytest.approx(1 / 3)
    assert json.loads((run_dir / "result.json").read_text()) == {
        "run_id": run_id(config),
        "result": {"score": 31.0},
    }
    assert json.loads((run_dir / DONE_FILE).read_text())["run_id"] == run_id(config)
    summary = json.loads(report.summary_path.read_text())
    assert summary["schema"] == SCHEMA and summary["experiment"] == "toy" and summary["complete"]
    assert summary["num_runs"] == summary["num_planned_runs"] == 8 and summary["missing_run_ids"] == []
    assert summary["machine"] and summary["env"]["hostname"] and not summary["smoke"]
    assert [row["score"] for row in summary["tables"][0]["rows"]][:3] == [10.0, 11.0, 20.0]


def test_rerun_skips_finished_runs(tmp_path):
    run_experiment(TOY, out=tmp_path, smoke=True, console=quiet())
    assert len(CALLS) == 4
    report = run_experiment(TOY, out=tmp_path, smoke=True, console=quiet())
    assert len(CALLS) == 4 and len(report.skipped) == 4 and not report.ran


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("boom")])
def test_an_interrupted_sweep_loses_no_finished_run_and_redoes_the_unfinished_one(tmp_path, error):
    FAIL_AT.update(gamma=2, error=error)
    with pytest.raises(type(error)):
        run_experiment(TOY, out=tmp_path, smoke=True, console=quiet())
    finished = [c for c in toy_plan(smoke=True).configs() if is_finished(tmp_path / "toy" / run_id(c))]
    assert [(c.gamma, c.temperature) for c in finished] == [(1, 0.0), (1, 1.0)]
    broken = tmp_path / "toy" / run_id(ToyConfig(gamma=2, temperature=0.0))
    assert not is_finished(broken) and "Traceback" in (broken / "error.txt").read_text()
    (broken / "stale.bin").write_text("left over from the crash")
    FAIL_AT.clear()
    CALLS.clear()
    report = run_experiment(TOY, out=tmp_path, smoke=True, console=quiet())
    assert CALLS == [(2, 0.0), (2, 1.0)] and len(report.skipped) == 2
    assert not (broken / "stale.bin").exists() and not (broken / "error.txt").exists() and is_finished(broken)
    lines = (broken / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3  # the redone run starts a clean metrics.jsonl


def test_keep_going_reports_the_failure_and_finishes_the_rest(tmp_path):
    FAIL_AT.update(gamma=1, error=RuntimeError("boom"))
    report = run_experiment(TOY, out=tmp_path, smoke=True, keep_going=True, console=quiet())
    assert len(report.failed) == 2 and len(report.ran) == 2
    summary = json.loads(report.summary_path.read_text())
    assert not summary["complete"] and sorted(summary["missing_run_ids"]) == sorted(report.failed)


def test_shards_split_the_work_and_the_summary_completes_when_all_are_in(tmp_path):
    first = run_experiment(TOY, out=tmp_path, shard_spec=(0, 3), console=quiet())
    summary = json.loads(first.summary_path.read_text())
    assert first.in_shard == len(first.ran) and not summary["complete"]
    assert summary["num_runs"] == len(first.ran) and len(summary["missing_run_ids"]) == 8 - len(first.ran)
    ran = set(first.ran)
    for i in (1, 2):
        report = run_experiment(TOY, out=tmp_path, shard_spec=(i, 3), console=quiet())
        assert not ran & set(report.ran)
        ran |= set(report.ran)
    assert len(ran) == 8 and len(CALLS) == 8
    assert json.loads((tmp_path / "toy" / "summary.json").read_text())["complete"]


def test_a_tampered_run_folder_is_refused(tmp_path):
    run_experiment(TOY, out=tmp_path, smoke=True, console=quiet())
    path = tmp_path / "toy" / run_id(ToyConfig(gamma=1)) / "config.json"
    data = json.loads(path.read_text())
    data["config"]["gamma"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="does not match the config with this run id"):
        run_experiment(TOY, out=tmp_path, smoke=True, console=quiet())


def test_publish_copies_complete_summaries_and_refuses_smoke(tmp_path):
    report = run_experiment(
        TOY, out=tmp_path / "out", publish=True, publish_dir=tmp_path / "pub", console=quiet()
    )
    assert report.published_path == tmp_path / "pub" / "toy.json"
    assert json.loads(report.published_path.read_text())["num_runs"] == 8
    with pytest.raises(ValueError, match="--smoke run"):
        run_experiment(
            TOY,
            out=tmp_path / "smoke",
            smoke=True,
            publish=True,
            publish_dir=tmp_path / "pub",
            console=quiet(),
        )


def test_overrides_apply_to_sweeps_that_have_the_field():
    configs = plan_configs(TOY, smoke=True, base_overrides={"steps": 5}, axis_overrides={"gamma": [7, 8, 9]})
    assert {(c.gamma, c.steps) for c in configs} == {(g, 5) for g in (7, 8, 9)} and len(configs) == 6
    with pytest.raises(ValueError, match="'stepz' matches no config field"):
        plan_configs(TOY, base_overrides={"stepz": 5})
    with pytest.raises(ValueError, match="matches no config"):
        plan_configs(TOY, axis_overrides={"nope": [1]})


def test_a_config_type_without_run_function_fails_before_running(tmp_path):
    @dataclass(frozen=True, kw_only=True)
    class Stray:
        x: int = 1

    bad = Experiment(
        name="bad",
        description="",
        plan=lambda smoke=False: (toy_plan(smoke=smoke), Sweep(Stray())),
        runners={ToyConfig: run_toy},
        summarize=toy_summary,
    )
    with pytest.raises(ValueError, match="no run function for Stray; known: ToyConfig"):
        run_experiment(bad, out=tmp_path, console=quiet())
    assert CALLS == []
