"""The on-disk layout of experiment runs.

::

    <out>/<experiment>/
        summary.json              the experiment's tables and figures over its finished runs
        <run_id>/                 one run (run_id = hash of the config, see experiments.config.run_id)
            config.json           {"experiment", "run_id", "type", "config": {...fields...}}
            env.json              versions, git commit, device, host, CPU count (experiments.env)
            metrics.jsonl         append-only, one {"step", "time", ...metrics} object per line
            result.json           {"run_id", "result": {...}} what the run function returned
            DONE                  completion marker, written atomically last:
                                  {"run_id", "finished_at", "wall_s"}
            error.txt             traceback, only if the run failed
            wandb/                the W&B run (with --wandb)

A run is written in a working folder ``<out>/<experiment>/.<run_id>.partial/`` and renamed to
``<run_id>/`` when it ends (finished, or failed with ``error.txt``), while the process holds the
run's lock ``<out>/<experiment>/.<run_id>.lock`` (:func:`run_lock`): so two processes on one ``--out``
never write one run at once, and ``<run_id>/`` never holds a half-written run of a live process.

A run directory counts as finished only when it has ``DONE`` *and* every file above that a run
always writes, with ``config.json``, ``env.json`` and ``result.json`` readable (:func:`damage` says
what is wrong otherwise). Anything else is unfinished: the next invocation runs it again.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from experiments.config import config_to_dict, config_type_name, run_id
from experiments.run_result import read_json, read_result
from specdec.summary import atomic_write_text, utc_now, write_json

__all__ = [
    "CONFIG_FILE",
    "ENV_FILE",
    "METRICS_FILE",
    "RESULT_FILE",
    "DONE_FILE",
    "ERROR_FILE",
    "SUMMARY_FILE",
    "REQUIRED_FILES",
    "RunRecord",
    "experiment_dir",
    "is_marked_done",
    "damage",
    "missing_files",
    "is_finished",
    "run_lock",
    "drop_lock_if_finished",
    "check_not_a_link",
    "start_run",
    "MetricsWriter",
    "finish_run",
    "fail_run",
    "load_record",
]

CONFIG_FILE = "config.json"
ENV_FILE = "env.json"
METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"
DONE_FILE = "DONE"
ERROR_FILE = "error.txt"
SUMMARY_FILE = "summary.json"


def experiment_dir(out: Path, experiment: str) -> Path:
    """``<out>/<experiment>``."""
    return Path(out) / experiment


REQUIRED_FILES = (CONFIG_FILE, ENV_FILE, METRICS_FILE, RESULT_FILE, DONE_FILE)
"""The files every finished run has."""


def is_marked_done(run_dir: Path) -> bool:
    """Whether the run's completion marker exists (the run may still lack other files: :func:`damage`)."""
    return (Path(run_dir) / DONE_FILE).is_file()


def missing_files(run_dir: Path) -> list[str]:
    """The :data:`REQUIRED_FILES` that ``run_dir`` lacks."""
    return [name for name in REQUIRED_FILES if not (Path(run_dir) / name).is_file()]


def _read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file holding an object; ``ValueError`` naming the file otherwise."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def damage(run_dir: Path) -> str | None:
    """What is wrong with a run folder marked ``DONE``: the files it lacks, or the first of
    ``config.json``, ``env.json``, ``result.json`` that cannot be read; None when nothing is."""
    run_dir = Path(run_dir)
    missing = missing_files(run_dir)
    if missing:
        return f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing"
    try:
        _read_json_object(run_dir / CONFIG_FILE)
        _read_json_object(run_dir / ENV_FILE)
        read_result(run_dir / RESULT_FILE, run_dir.name)
    except ValueError as err:
        return str(err)
    return None


def is_finished(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a finished run: marked ``DONE``, with every file there and readable."""
    return is_marked_done(run_dir) and damage(run_dir) is None


def _lock_path(exp_dir: Path, rid: str) -> Path:
    return Path(exp_dir) / f".{rid}.lock"


def run_lock(exp_dir: Path, rid: str) -> FileLock:
    """The lock held while a process runs ``rid``: ``<exp_dir>/.<rid>.lock`` (released by the OS if
    the process dies). Check :func:`is_finished` again once it is held."""
    Path(exp_dir).mkdir(parents=True, exist_ok=True)
    return FileLock(str(_lock_path(exp_dir, rid)))


def drop_lock_if_finished(exp_dir: Path, rid: str) -> None:
    """Delete the lock file of a finished run. Safe while other processes use it: a finished run is
    never run again, so whoever holds or takes the lock (through the old file or a new one) finds
    it finished and leaves it alone. The lock file of an unfinished run stays."""
    path = _lock_path(exp_dir, rid)
    if path.exists() and is_finished(Path(exp_dir) / rid):
        path.unlink(missing_ok=True)


def check_not_a_link(run_dir: Path) -> None:
    """Refuse a run folder that is a symbolic link: an unfinished run is deleted and rewritten, and the
    runner neither deletes what a link points to nor drops a link someone made on purpose."""
    run_dir = Path(run_dir)
    if run_dir.is_symlink():
        raise ValueError(
            f"{run_dir} is a symbolic link (to {os.readlink(run_dir)}) to a run that is not finished; "
            "the runner does not delete or rewrite runs through links: remove the link (or replace it "
            "with a real folder) and run again"
        )


def _config_payload(experiment: str, config: Any) -> dict[str, Any]:
    return {
        "experiment": experiment,
        "run_id": run_id(config),
        "type": config_type_name(config),
        "config": config_to_dict(config),
    }


def start_run(exp_dir: Path, rid: str, experiment: str, config: Any, env: Mapping[str, Any]) -> Path:
    """Create a clean working folder ``<exp_dir>/.<rid>.partial/`` for a run (removing a stale one
    left by a process that died) with ``config.json``, ``env.json`` and ``metrics.jsonl``; returns it.

    Call it holding :func:`run_lock`; :func:`finish_run` or :func:`fail_run` moves the folder to
    ``<exp_dir>/<rid>``.
    """
    work = Path(exp_dir) / f".{rid}.partial"
    if work.is_symlink():
        work.unlink()
    elif work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    write_json(work / CONFIG_FILE, _config_payload(experiment, config))
    write_json(work / ENV_FILE, dict(env))
    (work / METRICS_FILE).touch()
    return work


class MetricsWriter:
    """Appends one JSON object per line to ``metrics.jsonl`` and flushes it at once."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as a line."""
        self._file.write(json.dumps(dict(record), allow_nan=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def _move_into_place(work: Path, run_dir: Path) -> None:
    """Replace ``run_dir`` (an unfinished or damaged run, if any) by the working folder ``work``."""
    check_not_a_link(run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    os.rename(work, run_dir)


def finish_run(work: Path, run_dir: Path, result: Mapping[str, Any], wall_s: float) -> None:
    """Write ``result.json``, then the ``DONE`` marker (atomically, last), into the working folder
    ``work``, and rename it to ``run_dir``."""
    work, run_dir = Path(work), Path(run_dir)
    write_json(work / RESULT_FILE, {"run_id": run_dir.name, "result": dict(result)})
    marker = {"run_id": run_dir.name, "finished_at": utc_now(), "wall_s": round(wall_s, 6)}
    atomic_write_text(work / DONE_FILE, json.dumps(marker) + "\n")
    _move_into_place(work, run_dir)


def fail_run(work: Path, run_dir: Path, text: str) -> None:
    """Leave the traceback of a failed run beside its partial files, and move them to ``run_dir``
    (unfinished: the next invocation runs it again)."""
    atomic_write_text(Path(work) / ERROR_FILE, text)
    _move_into_place(Path(work), Path(run_dir))


@dataclass(frozen=True)
class RunRecord:
    """A finished run as the summary sees it: config object, returned result, and its files."""

    run_id: str
    run_dir: Path
    config: Any
    result: dict[str, Any]

    def metrics(self) -> list[dict[str, Any]]:
        """The run's ``metrics.jsonl`` lines, in order."""
        path = self.run_dir / METRICS_FILE
        out = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}: line {number} is not valid JSON ({err})") from None
        return out

    def env(self) -> dict[str, Any]:
        """The run's ``env.json``."""
        return _read_json_object(self.run_dir / ENV_FILE)


def load_record(run_dir: Path, experiment: str, config: Any) -> RunRecord:
    """Read a finished run, checking that its ``config.json`` is the config asked for and that its
    ``result.json`` has the layout above (``ValueError`` naming the file and the field otherwise)."""
    run_dir = Path(run_dir)
    stored = _read_json_object(run_dir / CONFIG_FILE)
    expected = json.loads(json.dumps(_config_payload(experiment, config)))
    if stored != expected:
        raise ValueError(
            f"{run_dir / CONFIG_FILE} does not match the config with this run id "
            f"(stored {stored.get('config')}, expected {expected['config']}); use a fresh --out directory"
        )
    result = read_result(run_dir / RESULT_FILE, run_dir.name)
    return RunRecord(run_id=run_dir.name, run_dir=run_dir, config=config, result=result)
