"""The engine's one drafter: a registered name or a drafter object, resolved to a
:class:`~specdec.protocols.SlotDrafter` (:func:`make_slot_drafter`).

What each drafter becomes:

- a registered name whose factory takes ``num_slots`` (every built-in drafter;
  :func:`specdec.registry.builds_slot_drafter`): that slot drafter, built once with
  ``num_slots`` and the options; any object that implements the protocol is used as it is (it must
  have at least ``num_slots`` slots);
- a drafter written for one request (:class:`~specdec.protocols.Drafter`: ``begin`` / ``propose`` /
  ``observe``), by name or as an object, through one adapter
  (:mod:`specdec.drafters.request_slots`): one instance for every row where it declares
  ``batched_rows = True`` (the toy Markov drafters of :mod:`specdec.testing`), else an
  instance per request (a registered factory builds each; an object serves the first request itself,
  every other request at the same time gets a deep copy of it, the target shared, never copied). A
  registered factory's first instance is built here, so bad options fail before the first request.

The engine reports :func:`drafter_name`: the name as resolved (``default`` included), or the
object's class name.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping
from typing import Any

from specdec.drafters.ngram_eagle import default_name
from specdec.drafters.request_slots import CohortSlots, RequestSlots
from specdec.protocols import Drafter, SlotDrafter
from specdec.registry import DRAFTERS, builds_slot_drafter, create_drafter

__all__ = ["drafter_name", "make_slot_drafter"]


def make_slot_drafter(
    target: Any,
    drafter: str | Drafter | SlotDrafter,
    options: Mapping[str, Any] | None = None,
    *,
    num_slots: int,
    clock: Callable[[], float] = time.perf_counter,
) -> SlotDrafter:
    """The engine's one drafter for ``target`` with ``num_slots`` rows: ``drafter`` a registered name
    (built with ``options``) or a drafter object (see the module doc for what each becomes);
    ``clock`` times the lazy ``begin`` of instances written for one request."""
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
    vocab_size = int(target.vocab_size)
    if not isinstance(drafter, str):
        return _from_object(target, drafter, options, num_slots, vocab_size, clock)
    DRAFTERS.get(drafter)  # an unknown name fails now, listing the known ones
    name = default_name(target) if drafter == "default" else drafter
    options = dict(options or {})
    if "num_slots" in options:
        raise ValueError("drafter_options must not set 'num_slots': the engine sets it (max_num_seqs)")
    if builds_slot_drafter(DRAFTERS.get(name)):
        built = create_drafter(name, target, num_slots=num_slots, **options)
        if not isinstance(built, SlotDrafter):
            raise ValueError(
                f"drafter {name!r} takes num_slots but built {type(built).__name__}, not a SlotDrafter"
            )
        return built
    first = _one_request(target, name, options)  # bad options fail now, not at the first request
    if _batched(first):
        return CohortSlots(first, num_slots=num_slots, vocab_size=vocab_size, name=name)
    spare = [first]
    make = lambda slot: spare.pop() if spare else _one_request(target, name, options)  # noqa: E731
    return RequestSlots(make, num_slots=num_slots, vocab_size=vocab_size, clock=clock, name=name)


def drafter_name(target: Any, drafter: str | Drafter | SlotDrafter) -> str:
    """What the engine reports as its drafter: a registered name as resolved (``default``: the name it
    stands for with ``target``), or a drafter object's class name."""
    if isinstance(drafter, str):
        return default_name(target) if drafter == "default" else drafter
    return type(drafter).__name__


def _one_request(target: Any, name: str, options: dict[str, Any]) -> Drafter:
    drafter = create_drafter(name, target, **options)
    if not isinstance(drafter, Drafter):
        raise ValueError(f"drafter {name!r} built {type(drafter).__name__}, not a Drafter")
    return drafter


def _from_object(
    target: Any,
    drafter: Any,
    options: Mapping[str, Any] | None,
    num_slots: int,
    vocab_size: int,
    clock: Callable[[], float],
) -> SlotDrafter:
    """A drafter given as an object: used as it is (a slot drafter), one instance for every row
    (``batched_rows``), or itself and deep copies of it."""
    if options:
        raise ValueError("drafter_options only apply when drafter is given by name")
    if isinstance(drafter, SlotDrafter):
        if drafter.num_slots < num_slots:
            raise ValueError(
                f"drafter has {drafter.num_slots} slots, the engine needs {num_slots} (max_num_seqs)"
            )
        return drafter
    if not isinstance(drafter, Drafter):
        raise ValueError(
            "drafter must be a registered name or an object with begin/propose/observe, "
            f"got {type(drafter).__name__}"
        )
    name = type(drafter).__name__
    if _batched(drafter):
        return CohortSlots(drafter, num_slots=num_slots, vocab_size=vocab_size, name=name)
    copies = _Copies(drafter, target)
    return RequestSlots(copies, num_slots=num_slots, vocab_size=vocab_size, reuse=True, clock=clock,
                        name=name)  # fmt: skip


def _batched(drafter: Any) -> bool:
    """One instance serves every row (``batched_rows = True``: it keeps no per-row state and draws
    randomness only from the keyed ``noise`` its ``propose`` takes)."""
    return getattr(drafter, "batched_rows", False) is True


class _Copies:
    """The object itself for the first request, deep copies for the requests that overlap it."""

    def __init__(self, drafter: Drafter, target: Any) -> None:
        self.drafter, self.target, self.served = drafter, target, False

    def __call__(self, slot: int) -> Drafter:
        if not self.served:
            self.served = True
            return self.drafter
        return copy.deepcopy(self.drafter, memo={id(self.target): self.target})  # the target is shared
