"""One generation per target (and per drafter object) at a time.

A target holds one KV cache and a drafter holds its own state (an EAGLE head's cache, a draft
model's cache), so two generations that share either would overwrite each other's state and both
return wrong tokens. :func:`exclusive` is what :func:`specdec.generate` holds for the whole call:

- a second call from **another thread** on the same object **waits its turn** (a lock per object);
- a second call from **the same thread** while the first is still running (a streaming callback
  that calls ``generate`` on the same target) cannot wait for itself: it raises ``ValueError``.

Several requests that should share one target are a batch: pass them together as one
``generate(target, [prompt_1, prompt_2, ...])`` call.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["exclusive"]

_guard = threading.Lock()
_by_object: weakref.WeakKeyDictionary[Any, _OwnedLock] = weakref.WeakKeyDictionary()
_by_id: dict[int, _OwnedLock] = {}  # objects that take no weak reference (kept for the process)


class _OwnedLock:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner: int | None = None


def _lock_of(obj: Any) -> _OwnedLock:
    with _guard:
        try:
            lock = _by_object.get(obj)
            if lock is None:
                lock = _by_object[obj] = _OwnedLock()
        except TypeError:  # no __weakref__ slot, or unhashable
            lock = _by_id.setdefault(id(obj), _OwnedLock())
        return lock


@contextmanager
def exclusive(*objects: Any) -> Iterator[None]:
    """Hold every object's lock, in order, for the body (``None`` entries are skipped)."""
    held: list[_OwnedLock] = []
    me = threading.get_ident()
    try:
        for obj in objects:
            if obj is None:
                continue
            owned = _lock_of(obj)
            if owned.owner == me:
                raise ValueError(
                    f"this {type(obj).__name__} is already generating in this thread (generate() called "
                    "again from inside a generation, e.g. from on_commit); a target or drafter serves one "
                    "generation at a time; pass several prompts in one call to batch them"
                )
            owned.lock.acquire()
            owned.owner = me
            held.append(owned)
        yield
    finally:
        for owned in reversed(held):
            owned.owner = None
            owned.lock.release()
