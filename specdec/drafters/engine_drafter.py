"""The engine's one drafter: a registered name or a drafter object, resolved to a
:class:`~specdec.protocols.SlotDrafter` (:func:`make_slot_drafter`).

Legend: B = 1 (an instance per request sees its request as a batch of one).

What each drafter becomes:

- a name in :data:`specdec.registry.SLOT_DRAFTERS` (``eagle``, ``ngram-eagle``, ``ngram-eagle-auto``,
  so ``default`` where the target has a shipped head, ``model``, ``qself``, ``layerskip``, ``ngram``):
  that slot drafter, built once with ``num_slots`` and the options; any object that implements the
  protocol is used as it is (it must have at least ``num_slots`` slots);
- a drafter that declares ``batched_rows = True`` (``none``, the toy Markov drafters of
  :mod:`specdec.testing`), by name or as an object: one instance for every row,
  :class:`~specdec.drafters.request_slots.CohortSlots` (many rows drafted by one call);
- any other name (``eagle-tree``, ``ngram-eagle-tree``, ``unigram``, ``bigram``, third-party names):
  an instance per request, :class:`~specdec.drafters.request_slots.RequestSlots`. A registered
  drafter whose factory takes ``slot`` / ``num_slots`` learns its request's cache row and the
  engine's number of rows. Instances share what is heavy (:data:`SHARED_PARTS`): the first instance
  of ``eagle-tree`` or ``ngram-eagle-tree`` loads and packs the head once, later ones get it as
  ``head=``. The first instance is built here, so bad options fail before the first request;
- a drafter object with a ``slot_factory(num_slots)`` method (``ModelDrafter``, ``LayerSkipDrafter``):
  an instance per request at its cache row from that factory (built once: a ``ModelDrafter``'s
  instances share one draft model with a cache row per slot,
  :class:`specdec.drafters.model.SharedDraftModel`);
- any other drafter object serves the first request itself, every other request at the same time
  gets a deep copy of it (the target is shared, never copied), and a request that leaves hands its
  instance back for the next one (``begin`` starts a drafter afresh).

The engine reports :func:`drafter_name`: the name as resolved (``default`` included), or the
object's class name.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from typing import Any

from specdec.drafters.ngram_eagle import default_name
from specdec.drafters.request_slots import CohortSlots, RequestSlots
from specdec.protocols import Drafter, SlotDrafter
from specdec.registry import DRAFTERS, SLOT_DRAFTERS, create_drafter, create_slot_drafter

__all__ = [
    "ENGINE_OPTIONS",
    "HEAD_LOADING_OPTIONS",
    "SHARED_PARTS",
    "SHARES_HEAD",
    "drafter_name",
    "make_slot_drafter",
]

SHARES_HEAD = ("eagle-tree", "ngram-eagle-tree")  # per request (eagle, ngram-eagle*: slot drafters)
SHARED_PARTS = dict.fromkeys(SHARES_HEAD, "head")
"""Drafter name -> the attribute of its first instance that later instances get as the option of
the same name (what is heavy to build: a packed head, a loaded draft model)."""
HEAD_LOADING_OPTIONS = ("weights", "draft_vocab_size", "dtype", "linear_backend", "weight_dtype")
"""Options that load an EAGLE head: later instances get the loaded head instead."""
ENGINE_OPTIONS = ("slot", "num_slots")
"""Options the engine sets on drafters whose factory takes them (never the user's)."""


def make_slot_drafter(
    target: Any,
    drafter: str | Drafter | SlotDrafter,
    options: Mapping[str, Any] | None = None,
    *,
    num_slots: int,
) -> SlotDrafter:
    """The engine's one drafter for ``target`` with ``num_slots`` rows: ``drafter`` a registered name
    (built with ``options``) or a drafter object (see the module doc for what each becomes)."""
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
    vocab_size = int(target.vocab_size)
    if not isinstance(drafter, str):
        return _from_object(target, drafter, options, num_slots, vocab_size)
    DRAFTERS.get(drafter)  # an unknown name fails now, listing the known ones
    name = default_name(target) if drafter == "default" else drafter
    options = dict(options or {})
    for key in ENGINE_OPTIONS:
        if key in options:
            raise ValueError(f"drafter_options must not set {key!r}: the engine sets it per request")
    if name in SLOT_DRAFTERS:
        built = create_slot_drafter(name, target, num_slots=num_slots, **options)
        if not isinstance(built, SlotDrafter):
            raise ValueError(f"slot drafter {name!r} built {type(built).__name__}, not a SlotDrafter")
        return built
    instances = _NamedInstances(target, name, options, num_slots)
    if _batched(instances.first):
        return CohortSlots(instances.first, num_slots=num_slots, vocab_size=vocab_size, name=name)
    return RequestSlots(instances, num_slots=num_slots, vocab_size=vocab_size, name=name)


def drafter_name(target: Any, drafter: str | Drafter | SlotDrafter) -> str:
    """What the engine reports as its drafter: a registered name as resolved (``default``: the name it
    stands for with ``target``), or a drafter object's class name."""
    if isinstance(drafter, str):
        return default_name(target) if drafter == "default" else drafter
    return type(drafter).__name__


def _from_object(
    target: Any, drafter: Any, options: Mapping[str, Any] | None, num_slots: int, vocab_size: int
) -> SlotDrafter:
    """A drafter given as an object: used as it is (a slot drafter), one instance for every row
    (``batched_rows``), instances from its ``slot_factory``, or itself and deep copies of it."""
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
    make = getattr(drafter, "slot_factory", None)
    per_slot = make(num_slots) if callable(make) else None  # None: no slot API (copies instead)
    if per_slot is not None:
        return RequestSlots(per_slot, num_slots=num_slots, vocab_size=vocab_size, name=name)
    return RequestSlots(
        _Copies(drafter, target), num_slots=num_slots, vocab_size=vocab_size, reuse=True, name=name
    )


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


class _NamedInstances:
    """Instances of the registered drafter ``name`` (``instances(slot)``), sharing :data:`SHARED_PARTS`;
    the first, built now, serves the first request (at slot 0 where the factory takes ``slot``)."""

    def __init__(self, target: Any, name: str, options: dict[str, Any], num_slots: int) -> None:
        self.target, self.name, self.options, self.num_slots = target, name, options, num_slots
        try:
            params = inspect.signature(DRAFTERS.get(name)).parameters
        except (TypeError, ValueError):  # a factory without a readable signature takes none of them
            params = {}
        self.engine_options = [key for key in ENGINE_OPTIONS if key in params]
        self.shared: dict[str, Any] = {}
        self.first = self.build(0)  # bad options fail at construction, not at the first request
        self._spare: Drafter | None = self.first
        self._spare_slot = 0 if "slot" in self.engine_options else None  # None: any slot

    def __call__(self, slot: int) -> Drafter:
        if self._spare is not None and self._spare_slot in (None, slot):
            spare, self._spare = self._spare, None
            return spare
        return self.build(slot)

    def build(self, slot: int) -> Drafter:
        """A new instance for the request at cache row ``slot``."""
        engine = {"slot": slot, "num_slots": self.num_slots}
        engine = {key: engine[key] for key in self.engine_options}
        options = self.options
        if "head" in self.shared:  # the loaded head replaces the options that loaded it
            options = {k: v for k, v in options.items() if k not in HEAD_LOADING_OPTIONS}
        drafter = create_drafter(self.name, self.target, **{**options, **self.shared, **engine})
        key = SHARED_PARTS.get(self.name)
        if key is not None and key not in self.shared and key not in self.options:
            part = getattr(drafter, key, None)
            if part is not None:
                self.shared[key] = part
        if not isinstance(drafter, Drafter):
            raise ValueError(f"drafter {self.name!r} built {type(drafter).__name__}, not a Drafter")
        return drafter
