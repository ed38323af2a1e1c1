"""Where a target's verify-cost grid is kept: for the target object's lifetime, and on disk per machine
and architecture, so every process on one machine drafts from the same grid.

Legend: B rows in a block, T tokens per row.

The grid's shape in T (how much a deeper verify block costs) is one of what sets the depth a request
drafts at (:mod:`specdec.engine.depth`), and a short timing at start-up reads it differently in every
process: on a quiet 2-core EPYC, c(1, 4) / c(1, 1) read 1.07–1.45 between fresh processes. Measured
for longer (:data:`CAREFUL_ROUNDS` rounds, each point the median of its rounds' steady times) it read
1.12–1.25 between processes and within 0.035 inside one. So a target that can say what its forward's
cost depends on (``cost_identity()``: its architecture, weight format, kernels, dtype and device, never
its weights' values) has its grid measured that carefully once per machine and kept in
``cache_root() / "verify-cost"``, keyed by that identity, the machine (CPU model, the kernels' ISA
path, torch's threads and version, an accelerator's name) and the engine's row count: every process
then chooses depths from the same grid (docs/engine.md has what still varies). The engine scales the
level by its own forwards (:class:`~specdec.engine.cost_model.OnlineVerifyCost`); delete the folder to
measure the shape again. ``SPECDEC_VERIFY_COST=measure`` measures at every start without the disk
(the test suite runs so).

Targets without ``cost_identity`` (the ``hf`` target, toy targets) are measured at every start-up,
quickly (2 rounds). Either way the grid only chooses depths: what tokens come out never depends on it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import weakref
from pathlib import Path
from typing import Any

import torch

from specdec.engine.cost_model import VerifyCostModel, measure_verify_cost
from specdec.summary import write_json

__all__ = ["CAREFUL_ROUNDS", "cost_cache_dir", "grid_key", "verify_cost_for"]

_log = logging.getLogger(__name__)

CAREFUL_ROUNDS = 12
"""Rounds over the grid when it is kept on disk (2 when it is not): about 1.2 s at one row of
SmolLM2-135M on a 2-core EPYC, once per machine."""

_VERSION = 1  # of what a kept grid means; a change measures every grid again

_MEASURED: weakref.WeakKeyDictionary[Any, dict[int, VerifyCostModel]] = weakref.WeakKeyDictionary()


def cost_cache_dir() -> Path:
    """Where kept grids live: ``cache_root() / "verify-cost"``."""
    from kernels.native import cache_root

    return cache_root() / "verify-cost"


def grid_key(target: Any, *, max_rows: int) -> dict[str, Any] | None:
    """What a kept grid for ``target`` at ``max_rows`` rows is valid for, or None where the target says
    nothing of its cost (``cost_identity``) or ``SPECDEC_VERIFY_COST=measure``."""
    mode = os.environ.get("SPECDEC_VERIFY_COST", "cache").strip() or "cache"
    if mode not in ("cache", "measure"):
        raise ValueError(f"SPECDEC_VERIFY_COST must be 'cache' or 'measure', got {mode!r}")
    identity = getattr(target, "cost_identity", None)
    if mode == "measure" or not callable(identity):
        return None
    from kernels.native import cpu_isa, cpu_model

    device = torch.device(getattr(target, "device", "cpu"))
    machine = {
        "cpu": cpu_model(),
        "isa": cpu_isa(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        machine["accelerator"] = torch.cuda.get_device_name(device)
    return {"version": _VERSION, "target": identity(), "machine": machine, "max_rows": max_rows}


def _path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cost_cache_dir() / f"{digest}.json"


def _load(path: Path, key: dict[str, Any]) -> VerifyCostModel | None:
    """The grid kept at ``path`` for ``key``, or None (absent, unreadable, or for another key)."""
    try:
        kept = json.loads(path.read_text())
        if kept.get("key") != key:
            return None
        grid = kept["grid"]
        seconds = tuple(tuple(float(x) for x in line) for line in grid["seconds"])
        return VerifyCostModel(tuple(grid["rows"]), tuple(grid["tokens"]), seconds)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        _log.warning("the kept verify-cost grid %s is unreadable (%s): measuring it again", path, err)
        return None


def _store(path: Path, key: dict[str, Any], grid: VerifyCostModel) -> None:
    """Keep ``grid`` at ``path`` (written whole or not at all); a cache that cannot be written is
    logged, never an error."""
    try:
        write_json(path, {"key": key, "grid": grid.to_dict()}, indent=1)
    except OSError as err:
        _log.warning("could not keep the verify-cost grid at %s: %s", path, err)


def _grid(target: Any, max_rows: int) -> VerifyCostModel:
    key = grid_key(target, max_rows=max_rows)
    if key is None:
        return measure_verify_cost(target, max_rows=max_rows)
    path = _path(key)
    grid = _load(path, key)
    if grid is None:
        _log.info("measuring the verify cost once for this machine and target (kept in %s)", path)
        grid = measure_verify_cost(target, max_rows=max_rows, repeats=CAREFUL_ROUNDS)
        _store(path, key, grid)
    return grid


def verify_cost_for(target: Any, *, max_rows: int) -> VerifyCostModel:
    """The target's verify-cost grid up to ``max_rows`` rows: the kept one where the disk has it (module
    doc), else measured (on the target's cache, which must be reset and empty); then kept for the
    target object's lifetime, so engines and ``specdec.generate`` calls on one target share it."""
    try:
        known = _MEASURED.setdefault(target, {})
    except TypeError:  # an object that takes no weak reference
        return _grid(target, max_rows)
    if max_rows not in known:
        known[max_rows] = _grid(target, max_rows)
    return known[max_rows]
