"""Optional Weights & Biases logging that never breaks a run.

- Offline by default: with neither ``WANDB_MODE`` nor ``WANDB_API_KEY`` set, runs are written offline
  (``wandb/offline-run-*`` under the run's folder) and can be uploaded later with ``wandb sync``.
- wandb not installed, or ``wandb.init`` failing (not logged in, no network): one warning, then the
  experiment continues without W&B. A logging call that fails later disables W&B for that run.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["wandb_mode", "open_wandb_run", "WandbRun", "NullRun"]


def wandb_mode() -> str:
    """``$WANDB_MODE`` if set, else ``online`` when ``$WANDB_API_KEY`` is set, else ``offline``."""
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class NullRun:
    """Stands in for a W&B run when W&B is off or unavailable: every call does nothing."""

    active = False
    directory: Path | None = None

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Do nothing."""

    def log_table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """Do nothing."""

    def log_image(self, key: str, path: Path, caption: str = "") -> None:
        """Do nothing."""

    def set_summary(self, values: Mapping[str, Any]) -> None:
        """Do nothing."""

    def finish(self, exit_code: int = 0) -> None:
        """Do nothing."""


class WandbRun(NullRun):
    """A live (online or offline) W&B run; each call is guarded so W&B trouble cannot stop the run."""

    active = True

    def __init__(self, wandb_module: Any, run: Any, directory: Path) -> None:
        self._wandb = wandb_module
        self._run = run
        self.directory = directory

    def _guard(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        if not self.active:
            return
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - W&B must never break an experiment
            warnings.warn(f"W&B {what} failed ({e!r}); continuing without W&B for this run", stacklevel=3)
            self.active = False

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log per-step metrics (numbers only; other values are left to metrics.jsonl)."""
        numbers = {
            k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if numbers:
            self._guard("log", self._run.log, numbers, step=step)

    def log_table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """Log a table."""
        self._guard(
            "log_table",
            lambda: self._run.log({key: self._wandb.Table(columns=list(columns), data=list(rows))}),
        )

    def log_image(self, key: str, path: Path, caption: str = "") -> None:
        """Log an image file (a rendered plot)."""
        self._guard("log_image", lambda: self._run.log({key: self._wandb.Image(str(path), caption=caption)}))

    def set_summary(self, values: Mapping[str, Any]) -> None:
        """Put final values in the run summary."""
        self._guard("summary", self._run.summary.update, dict(values))

    def finish(self, exit_code: int = 0) -> None:
        """Close the run (flushes the offline files)."""
        try:
            self._run.finish(exit_code=exit_code)
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"W&B finish failed ({e!r})", stacklevel=2)
        self.active = False


_warned_missing = False


def open_wandb_run(
    *,
    directory: Path,
    project: str,
    name: str,
    group: str,
    job_type: str,
    config: Mapping[str, Any],
) -> NullRun:
    """Start a W&B run with its files under ``directory/wandb``; a :class:`NullRun` if W&B is unavailable."""
    global _warned_missing
    try:
        import wandb
    except ImportError:
        if not _warned_missing:
            warnings.warn(
                "--wandb: wandb is not installed (pip install wandb); continuing without W&B", stacklevel=2
            )
            _warned_missing = True
        return NullRun()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        run = wandb.init(
            project=project,
            name=name,
            group=group,
            job_type=job_type,
            config=dict(config),
            dir=str(directory),
            mode=wandb_mode(),
            settings=wandb.Settings(silent=os.environ.get("WANDB_SILENT", "true") != "false", console="off"),
        )
    except Exception as e:  # noqa: BLE001 - not logged in, no network, bad settings: never fatal
        warnings.warn(f"--wandb: wandb.init failed ({e!r}); continuing without W&B", stacklevel=2)
        return NullRun()
    if run is None:
        return NullRun()
    return WandbRun(wandb, run, directory)
