"""The runner under misuse: two processes on one --out, damaged or corrupted run folders, symbolic
links, and plans too large to build by accident."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console

import experiments.cli as cli
import experiments.runner as runner
from experiments.config import run_id, validate_config
from experiments.experiment import Experiment
from experiments.run_result import ResultFieldError
from experiments.runner import run_experiment, summarize_experiment
from experiments.store import (
    DONE_FILE,
    ENV_FILE,
    METRICS_FILE,
    REQUIRED_FILES,
    RESULT_FILE,
    is_finished,
    run_lock,
)
from experiments.sweep import Sweep
from specdec.summary import Summary, table_from_rows

REPO = Path(__file__).resolve().parent.parent
CALLS: list[int] = []


@dataclass(frozen=True, kw_only=True)
class PointConfig:
    x: int

    def __post_init__(self) -> None:
        validate_config(self)


def run_point(config: PointConfig, ctx) -> dict:
    CALLS.append(config.x)
    ctx.log({"x": config.x})
    return {"score": config.x * 1.5, "detail": {"half": config.x / 2}}


def summarize_points(records) -> Summary:
    rows = [
        {"x": r.config.x, "double": r.result["score"] * 2.0, "half": r.result["detail"]["half"]}
        for r in records
    ]
    return Summary(title="Points", tables=(table_from_rows("points", "Points.", [("x", "x", "d")], rows),))


POINTS = Experiment(
    name="points",
    description="points",
    plan=lambda smoke=False: Sweep(PointConfig(x=0), {"x": [1, 2, 3, 4]}),
    runners={PointConfig: run_point},
    summarize=summarize_points,
)


@pytest.fixture(autouse=True)
def _reset():
    CALLS.clear()
    yield
    CALLS.clear()


def recording() -> tuple[Console, io.StringIO]:
    text = io.StringIO()
    return Console(file=text, width=400, highlight=False, color_system=None), text


def run_dir_of(out: Path, x: int) -> Path:
    return out / "points" / run_id(PointConfig(x=x))


def _experiments(*args: str) -> list[str]:
    return [sys.executable, "-m", "experiments", *args]


# ------------------------------------------------------------------------------------------- concurrency


@pytest.mark.slow
def test_two_processes_on_one_out_both_finish_and_do_each_run_once(tmp_path):
    """Two real `run` processes on one --out, started together: both exit 0, every run is done by
    exactly one of them and has each of its files, and no working folder or lock file is left."""
    config = tmp_path / "grid.yaml"
    alphas = ", ".join(str(0.5 + i / 100) for i in range(20))
    config.write_text(f"axes:\n  alpha: [{alphas}]\n  gamma: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\n")
    out = tmp_path / "out"
    argv = _experiments("run", "leviathan-table1", "--smoke", "--config", str(config), "--out", str(out))
    procs = [
        subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    exp_dir = out / "leviathan-table1"
    runs = sorted(p for p in exp_dir.iterdir() if p.is_dir())
    assert len(runs) == 202  # 200 grid points + the 2 figure curves of --smoke
    done_by = {}
    for log in logs:
        for line in log.splitlines():
            if " done in " in line:
                rid = line.split("]")[1].split()[0]
                assert rid not in done_by, f"{rid} was run twice"
                done_by[rid] = log
    assert set(done_by) == {p.name for p in runs}
    for run in runs:
        assert sorted(f.name for f in run.iterdir()) == sorted(REQUIRED_FILES), run
        assert is_finished(run)
    assert sorted(p.name for p in exp_dir.iterdir() if p.name.startswith(".")) == []
    assert json.loads((exp_dir / "summary.json").read_text())["complete"]


def test_a_run_held_by_another_process_is_waited_for_and_not_redone(tmp_path):
    """A run whose lock another holder has is left for later; once that holder has finished it (the
    lock released), it is skipped, not run again."""
    run_experiment(POINTS, out=tmp_path, console=Console(quiet=True))
    target = run_dir_of(tmp_path, 3)
    (target / ENV_FILE).unlink()  # damaged: so the second invocation plans to redo it
    CALLS.clear()
    holding = threading.Event()

    def other_holder() -> None:  # stands in for another process (a lock is per thread in one process)
        with run_lock(tmp_path / "points", target.name):
            holding.set()
            time.sleep(0.5)
            (target / ENV_FILE).write_text("{}")  # it finishes the run, then releases the lock

    helper = threading.Thread(target=other_holder)
    helper.start()
    holding.wait(timeout=10)
    console, text = recording()
    report = run_experiment(POINTS, out=tmp_path, console=console)
    helper.join()
    assert CALLS == [] and report.ran == [] and target.name in report.skipped
    log = text.getvalue()
    assert "another process is running it; waiting for it" in log and "finished by another process" in log
    assert not (tmp_path / "points" / f".{target.name}.lock").exists()


# ---------------------------------------------------------------------------------- damaged run folders


def test_a_done_run_with_a_file_missing_is_redone_saying_why(tmp_path):
    run_experiment(POINTS, out=tmp_path, console=Console(quiet=True))
    (run_dir_of(tmp_path, 2) / ENV_FILE).unlink()
    (run_dir_of(tmp_path, 4) / METRICS_FILE).unlink()
    assert (run_dir_of(tmp_path, 2) / DONE_FILE).is_file() and not is_finished(run_dir_of(tmp_path, 2))
    console, text = recording()
    configs = POINTS.configs()
    path = summarize_experiment(POINTS, configs, tmp_path / "points", console=console)
    summary = json.loads(path.read_text())
    assert summary["num_runs"] == 2 and not summary["complete"]
    assert sorted(summary["missing_run_ids"]) == sorted(run_dir_of(tmp_path, x).name for x in (2, 4))
    assert "marked DONE but env.json missing; counted as not finished" in text.getvalue()
    CALLS.clear()
    console, text = recording()
    report = run_experiment(POINTS, out=tmp_path, console=console)
    assert sorted(CALLS) == [2, 4] and len(report.skipped) == 2
    log = text.getvalue()
    assert f"{run_dir_of(tmp_path, 2).name}: marked DONE but env.json is missing; running it again" in log
    assert (
        f"{run_dir_of(tmp_path, 4).name}: marked DONE but metrics.jsonl is missing; running it again" in log
    )
    assert all(is_finished(run_dir_of(tmp_path, x)) for x in (1, 2, 3, 4))
    assert json.loads(report.summary_path.read_text())["complete"]


def test_a_stale_working_folder_of_a_dead_process_is_cleared(tmp_path):
    stale = tmp_path / "points" / f".{run_id(PointConfig(x=1))}.partial"
    stale.mkdir(parents=True)
    (stale / "half-written.bin").write_text("from a process that was killed")
    run_experiment(POINTS, out=tmp_path, console=Console(quiet=True))
    assert not stale.exists() and is_finished(run_dir_of(tmp_path, 1))
    assert not (run_dir_of(tmp_path, 1) / "half-written.bin").exists()


def test_a_corrupted_result_json_is_named_by_summarize_and_redone_by_run(tmp_path):
    run_experiment(POINTS, out=tmp_path, console=Console(quiet=True))
    bad = run_dir_of(tmp_path, 3) / RESULT_FILE
    bad.write_text('{"run_id": "x",\n')  # cut short: "Expecting value: line 2 column 1"
    with pytest.raises(ValueError, match=rf"{bad}: not valid JSON \(Expecting"):
        summarize_experiment(POINTS, POINTS.configs(), tmp_path / "points", console=Console(quiet=True))
    CALLS.clear()
    console, text = recording()
    report = run_experiment(POINTS, out=tmp_path, console=console)
    assert CALLS == [3] and report.ran == [run_dir_of(tmp_path, 3).name]
    assert f"marked DONE but {bad}: not valid JSON" in text.getvalue()
    assert json.loads(report.summary_path.read_text())["complete"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2]", "expected a JSON object with fields run_id and result, got an array"),
        ('{"run_id": "RID"}', "field result is missing (fields: ['run_id'])"),
        ('{"run_id": "RID", "result": [1]}', "field result must be an object, got an array"),
        ('{"run_id": "elsewhere", "result": {}}', "field run_id is 'elsewhere', expected 'RID'"),
    ],
)
def test_a_result_json_of_the_wrong_layout_is_named_with_its_field(tmp_path, content, message):
    run_experiment(POINTS, out=tmp_path, console=Console(quiet=True))
    path = run_dir_of(tmp_path, 1) / RESULT_FILE
    rid = run_dir_of(tmp_path, 1).name
    path.write_text(content.replace("RID", rid))
    with pytest.raises(ValueError) as caught:
        summarize_experiment(POINTS, POINTS.configs(), tmp_path / "points", console=Console(quiet=True))
    assert str(caught.value) == f"{path}: {message.replace('RID', rid)}"


def test_a_result_missing_a_field_the_summary_reads_names_the_file_and_the_field(tmp_path):
    run_experiment(POINTS, out=tmp_path, console=Console(quiet=True))
    path = run_dir_of(tmp_path, 2) / RESULT_FILE
    rid = run_dir_of(tmp_path, 2).name
    path.write_text(json.dumps({"run_id": rid, "result": {"score": 3.0, "detail": {"quarter": 0.5}}}))
    with pytest.raises(ResultFieldError) as caught:
        summarize_experiment(POINTS, POINTS.configs(), tmp_path / "points", console=Console(quiet=True))
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, KeyError)
    assert str(caught.value).startswith(f"{path}: field result.detail.half is missing")


def test_a_result_field_of_the_wrong_type_is_named_when_summarize_fails_on_it(tmp_path):
    run_experiment(POINTS, out=tmp_path, console=Console(quiet=True))
    path = run_dir_of(tmp_path, 4) / RESULT_FILE
    rid = run_dir_of(tmp_path, 4).name
    path.write_text(json.dumps({"run_id": rid, "result": {"score": None, "detail": {"half": 2.0}}}))
    # null is what a run writes for a number it could not measure: not called odd, the error says so
    with pytest.raises(
        ValueError, match="summarize failed on the runs' results \\(TypeError: .*no result.json"
    ):
        summarize_experiment(POINTS, POINTS.configs(), tmp_path / "points", console=Console(quiet=True))
    path.write_text(json.dumps({"run_id": rid, "result": {"score": [6.0], "detail": {"half": 2.0}}}))
    with pytest.raises(ValueError) as caught:
        summarize_experiment(POINTS, POINTS.configs(), tmp_path / "points", console=Console(quiet=True))
    message = str(caught.value)
    assert message.startswith("points: summarize failed on the runs' results (TypeError: ")
    assert message.endswith(f"{path}: field result.score is an array (the other runs: a number)")


# ------------------------------------------------------------------------------------------ symbolic links


def test_an_unfinished_run_behind_a_symbolic_link_is_refused_and_its_target_left_alone(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("not the runner's")
    link = run_dir_of(tmp_path / "out", 2)
    link.parent.mkdir(parents=True)
    link.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(
        ValueError, match=rf"{link} is a symbolic link \(to {elsewhere}\) to a run that is not"
    ):
        run_experiment(POINTS, out=tmp_path / "out", console=Console(quiet=True))
    assert CALLS == []  # refused before anything ran
    assert link.is_symlink() and (elsewhere / "precious.txt").read_text() == "not the runner's"


def test_a_finished_run_behind_a_symbolic_link_is_read_through_it(tmp_path):
    run_experiment(POINTS, out=tmp_path / "a", console=Console(quiet=True))
    finished = run_dir_of(tmp_path / "a", 1)
    link = run_dir_of(tmp_path / "b", 1)
    link.parent.mkdir(parents=True)
    link.symlink_to(finished, target_is_directory=True)
    CALLS.clear()
    report = run_experiment(POINTS, out=tmp_path / "b", console=Console(quiet=True))
    assert sorted(CALLS) == [2, 3, 4] and link.is_symlink() and report.skipped == [link.name]
    assert json.loads(report.summary_path.read_text())["complete"]


# --------------------------------------------------------------------------------------------- large plans


def _million(tmp_path: Path) -> Path:
    """A 1000 x 1000 grid over leviathan-table1's rows (plus its 6 figure curves)."""
    path = tmp_path / "million.yaml"
    alphas = ", ".join(str(i / 1000) for i in range(1000))
    path.write_text(f"axes:\n  alpha: [{alphas}]\n  gamma: [{', '.join(map(str, range(1, 1001)))}]\n")
    return path


def test_a_million_point_plan_is_sized_first_and_refused_without_allow_large(tmp_path, capsys):
    started = time.perf_counter()
    argv = ["run", "leviathan-table1", "--config", str(_million(tmp_path)), "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert time.perf_counter() - started < 10  # sized from the axis lengths, nothing built
    assert len(err.splitlines()) == 1 and "1,000,006 runs" in err and "--allow-large" in err
    assert not (tmp_path / "out").exists()
    assert cli.main(["summarize", *argv[1:]]) == 2 and "--allow-large" in capsys.readouterr().err


def test_allow_large_lets_a_plan_over_the_limit_run(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "LARGE_PLAN_RUNS", 3)
    with pytest.raises(ValueError, match="points: the plan has 4 runs, over the limit of 3; .*--allow-large"):
        run_experiment(POINTS, out=tmp_path, console=Console(quiet=True))
    assert CALLS == []
    console, text = recording()
    report = run_experiment(POINTS, out=tmp_path, allow_large=True, console=console)
    assert len(report.ran) == 4 and text.getvalue().startswith("points: 4 runs in the plan\n")


class _Enough(Exception):
    pass


class _FirstLines(io.StringIO):
    """A stdout that stops the program after ``n`` lines."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def write(self, text: str) -> int:
        written = super().write(text)
        if self.getvalue().count("\n") >= self.n:
            raise _Enough
        return written


def test_dry_run_prints_the_size_then_streams_the_runs(tmp_path, monkeypatch, capsys):
    stdout = _FirstLines(5)
    monkeypatch.setattr(sys, "stdout", stdout)
    started = time.perf_counter()
    with pytest.raises(_Enough):
        cli.main(["run", "leviathan-table1", "--dry-run", "--config", str(_million(tmp_path))])
    assert time.perf_counter() - started < 10  # building the 10**6 configs first takes minutes
    header = "leviathan-table1: 1,000,006 runs in the plan (over 10,000: `run` needs --allow-large)\n"
    assert capsys.readouterr().err == header
    rows = [json.loads(line.split(" ", 2)[2]) for line in stdout.getvalue().splitlines()]
    assert [(r["alpha"], r["gamma"]) for r in rows] == [(0.0, g) for g in range(1, 6)]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads CPU time from /proc")
def test_dry_run_into_a_pipe_streams_and_stops_quietly_when_it_closes(tmp_path):
    """`run --dry-run | head`: the size comes first (stderr), the first runs at once (bounded in
    CPU time, not wall time, so a loaded machine does not fail it), and closing the pipe ends the
    process with status 0 and no traceback."""
    argv = _experiments("run", "leviathan-table1", "--dry-run", "--config", str(_million(tmp_path)))
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(180, proc.kill)  # nothing printed: readline would wait forever
    watchdog.start()
    try:
        header = proc.stderr.readline()
        lines = [proc.stdout.readline() for _ in range(5)]
        cpu_s = _cpu_seconds(proc.pid)
        proc.stdout.close()
        proc.wait(timeout=120)
    finally:
        watchdog.cancel()
        proc.kill()
    assert header.startswith("leviathan-table1: 1,000,006 runs in the plan")
    assert cpu_s < 20  # building all 10**6 configs before the first line takes over a minute of CPU
    rows = [json.loads(line.split(" ", 2)[2]) for line in lines]
    assert [(r["alpha"], r["gamma"]) for r in rows] == [(0.0, g) for g in range(1, 6)]
    assert proc.returncode == 0 and "Traceback" not in proc.stderr.read()
