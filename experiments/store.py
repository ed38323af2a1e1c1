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

A run directory without ``DONE`` is unfinished: the next invocation deletes it and runs it again.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.config import config_to_dict, config_type_name, run_id
from specdec.summary import atomic_write_text, utc_now, write_json

__all__ = [
    "CONFIG_FILE",
    "ENV_FILE",
    "METRICS_FILE",
    "RESULT_FILE",
    "DONE_FILE",
    "ERROR_FILE",
    "SUMMARY_FILE",
    "RunRecord",
    "experiment_dir",
    "is_finished",
    "start_run",
    "MetricsWriter",
    "finish_run",
    "write_error",
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


def is_finished(run_dir: Path) -> bool:
    """Whether the run's completion marker exists."""
    return (Path(run_dir) / DONE_FILE).is_file()


def _config_payload(experiment: str, config: Any) -> dict[str, Any]:
    return {
        "experiment": experiment,
        "run_id": run_id(config),
        "type": config_type_name(config),
        "config": config_to_dict(config),
    }


def start_run(run_dir: Path, experiment: str, config: Any, env: Mapping[str, Any]) -> None:
    """Create a clean run directory (removing an unfinished one) with ``config.json`` and ``env.json``."""
    run_dir = Path(run_dir)
    if is_finished(run_dir):
        raise ValueError(f"{run_dir} is already finished; refusing to overwrite it")
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    write_json(run_dir / CONFIG_FILE, _config_payload(experiment, config))
    write_json(run_dir / ENV_FILE, dict(env))
    (run_dir / METRICS_FILE).touch()


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


def finish_run(run_dir: Path, result: Mapping[str, Any], wall_s: float) -> None:
    """Write ``result.json``, then the ``DONE`` marker (atomically, last)."""
    run_dir = Path(run_dir)
    write_json(run_dir / RESULT_FILE, {"run_id": run_dir.name, "result": dict(result)})
    marker = {"run_id": run_dir.name, "finished_at": utc_now(), "wall_s": round(wall_s, 6)}
    atomic_write_text(run_dir / DONE_FILE, json.dumps(marker) + "\n")


def write_error(run_dir: Path, text: str) -> None:
    """Leave the traceback of a failed run beside its partial files."""
    atomic_write_text(Path(run_dir) / ERROR_FILE, text)


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
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def env(self) -> dict[str, Any]:
        """The run's ``env.json``."""
        return json.loads((self.run_dir / ENV_FILE).read_text())


def load_record(run_dir: Path, experiment: str, config: Any) -> RunRecord:
    """Read a finished run, checking that its ``config.json`` is the config asked for."""
    run_dir = Path(run_dir)
    stored = json.loads((run_dir / CONFIG_FILE).read_text())
    expected = json.loads(json.dumps(_config_payload(experiment, config)))
    if stored != expected:
        raise ValueError(
            f"{run_dir / CONFIG_FILE} does not match the config with this run id "
            f"(stored {stored.get('config')}, expected {expected['config']}); use a fresh --out directory"
        )
    result = json.loads((run_dir / RESULT_FILE).read_text())["result"]
    return RunRecord(run_id=run_dir.name, run_dir=run_dir, config=config, result=result)
