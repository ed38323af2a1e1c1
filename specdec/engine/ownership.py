"""Who holds a target's KV cache: one engine at a time.

An :class:`~specdec.Engine` (``specdec.generate`` runs one too) resets the target's cache to its own
rows and length when it starts and whenever another user of the same target reset it in between; it
may not while that other engine has unfinished requests (a reset would destroy their cache). The
holder is remembered per target, weakly: a dropped engine holds nothing.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

from specdec.engine.request import RequestStatus

__all__ = ["claim_target", "release_target"]

_CACHE_OWNER: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def claim_target(engine: Any, *, force: bool = False) -> None:
    """``engine`` holds its target's cache: reset it to the engine's rows and length unless it already
    is. ``ValueError`` where another engine on the same target has unfinished requests (a reset would
    destroy their cache), or where this engine's requests lost theirs to another user."""
    ref = _CACHE_OWNER.get(engine.target)
    owner = None if ref is None else ref()
    if owner is engine and not force:
        return
    if owner is not None and owner is not engine and owner.has_unfinished():
        del owner
        gc.collect()  # an engine its user dropped may only wait for the collector (cycles)
        owner = ref()
    if owner is not None and owner is not engine and owner.has_unfinished():
        raise ValueError(
            f"target {type(engine.target).__name__} is in use by another Engine (or specdec.generate) "
            f"with {len(owner.requests)} unfinished request(s): each engine holds the target's KV cache, "
            "so finish or abort those first, or load a second target"
        )
    in_cache = [r for r in engine.requests.values() if r.status is not RequestStatus.WAITING]
    if owner is not None and owner is not engine and in_cache:
        raise ValueError(
            "another Engine (or specdec.generate) reset this target's KV cache while this engine had "
            f"requests in it ({len(in_cache)} running): abort them (Engine.abort) and add them again"
        )
    engine.target.reset(engine.max_num_seqs, engine.max_model_len)
    _CACHE_OWNER[engine.target] = weakref.ref(engine)


def release_target(engine: Any) -> None:
    """``engine`` holds its target's cache no more (an engine whose construction failed after it
    claimed the target: it must not stand in the way of the next one)."""
    ref = _CACHE_OWNER.get(engine.target)
    if ref is not None and ref() is engine:
        del _CACHE_OWNER[engine.target]
