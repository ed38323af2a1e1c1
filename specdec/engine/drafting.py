"""Drafters per request: each request gets its own drafter instance, added when it starts decoding
and dropped when it leaves; or one slot drafter for the engine, holding state per slot.

Legend: B = 1 (a drafter instance sees its request as a batch of one), L sequence capacity.

Instances share what is heavy (:data:`SHARED_PARTS`): the first instance of ``eagle-tree`` or
``ngram-eagle-tree`` loads and packs the head once, later ones get it as ``head=``. A registered
drafter whose factory takes ``slot`` / ``num_slots`` learns its request's cache row and the engine's
number of rows. A drafter given as an object (as ``specdec.generate`` accepts) with a
``slot_factory(num_slots)`` method (``ModelDrafter``, ``LayerSkipDrafter``) gives each request an
instance at its cache row from that factory (built once per pool: a ``ModelDrafter``'s instances
share one draft model with a cache row per slot, :class:`specdec.drafters.model.SharedDraftModel`);
any other object serves the first request itself, every other request at the same time gets a deep
copy of it, and a request that leaves hands its instance back for the next one (``begin`` starts a
drafter afresh). A drafter that declares ``batched_rows = True`` (``none``, the toy Markov drafters
of :mod:`specdec.testing`) is one instance for every row: the engine drafts many rows with one call
(:mod:`specdec.engine.units`).

A **slot drafter** (:class:`specdec.protocols.SlotDrafter`; ``eagle``, ``ngram-eagle``,
``ngram-eagle-auto`` (so ``default``), ``model``, ``qself``, ``layerskip`` and ``ngram`` by name, from
:data:`specdec.registry.SLOT_DRAFTERS`, or any object passed that implements the protocol) is one
instance for the whole engine (``slots``): the pool builds it with ``num_slots``, the engine calls ``add`` on
a request's slot when it starts decoding and ``drop`` on it when it leaves (finished or aborted:
:meth:`DrafterPool.give_back`), and drafts and observes all rows of a step with one call each.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from specdec.drafters.ngram_eagle import default_name
from specdec.protocols import DecodeState, Drafter, SlotDrafter, TargetOutput
from specdec.registry import DRAFTERS, SLOT_DRAFTERS, create_drafter, create_slot_drafter
from specdec.sampling import SamplingParams

__all__ = ["DrafterPool", "SHARES_HEAD", "SHARED_PARTS", "row_state"]

SHARES_HEAD = ("eagle-tree", "ngram-eagle-tree")  # per request (eagle, ngram-eagle*: slot drafters)
SHARED_PARTS = dict.fromkeys(SHARES_HEAD, "head")
"""Drafter name -> the attribute of its first instance that later instances get as the option of
the same name (what is heavy to build: a packed head, a loaded draft model)."""
HEAD_LOADING_OPTIONS = ("weights", "draft_vocab_size", "dtype", "linear_backend", "weight_dtype")
"""Options that load an EAGLE head: later instances get the loaded head instead."""
ENGINE_OPTIONS = ("slot", "num_slots")
"""Options the pool sets on drafters whose factory takes them (never the user's)."""


class DrafterPool:
    """Builds a drafter instance for each request (``fresh``), sharing loaded heads; ``give_back``
    returns a leaving request's instance."""

    def __init__(
        self, target: Any, drafter: str | Drafter, options: Mapping[str, Any] | None, *, num_slots: int
    ) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.num_slots = num_slots
        self._idle: list[Drafter] = []
        self._prototype: Drafter | None = None
        self._per_slot: Any = None  # the object's slot_factory(num_slots), if it has one
        self.batched = False  # one instance serves every row at once (``batched_rows``)
        self.keyed = False  # ... and its propose takes the rows' keyed ``noise``
        self.slots: SlotDrafter | None = None  # one instance with state per slot (the protocol)
        if not isinstance(drafter, str):
            if options:
                raise ValueError("drafter_options only apply when drafter is given by name")
            if isinstance(drafter, SlotDrafter):
                if drafter.num_slots < num_slots:
                    raise ValueError(
                        f"drafter has {drafter.num_slots} slots, the engine needs {num_slots} (max_num_seqs)"
                    )
                self.target, self.name, self.options = target, type(drafter).__name__, {}
                self.slots = drafter
                return
            if not isinstance(drafter, Drafter):
                raise ValueError(
                    "drafter must be a registered name or an object with begin/propose/observe, "
                    f"got {type(drafter).__name__}"
                )
            self.target, self.name, self.options = target, type(drafter).__name__, {}
            self._prototype = drafter
            if self._share(drafter):
                return
            make = getattr(drafter, "slot_factory", None)
            self._per_slot = make(num_slots) if callable(make) else None
            if self._per_slot is None:
                self._idle.append(drafter)
            return
        DRAFTERS.get(drafter)  # an unknown name fails now, listing the known ones
        name = default_name(target) if drafter == "default" else drafter
        self.target, self.name, self.options = target, name, dict(options or {})
        for key in ENGINE_OPTIONS:
            if key in self.options:
                raise ValueError(f"drafter_options must not set {key!r}: the engine sets it per request")
        if name in SLOT_DRAFTERS:
            self.slots = self._slot_drafter(name)
            return
        try:
            params = inspect.signature(DRAFTERS.get(name)).parameters
        except (TypeError, ValueError):  # a factory without a readable signature takes none of them
            params = {}
        self._engine_options = [key for key in ENGINE_OPTIONS if key in params]
        self._shared: dict[str, Any] = {}
        first = self.fresh(0)  # bad options fail at construction, not at the first request
        if self._share(first):
            self._prototype = first

    def _slot_drafter(self, name: str) -> SlotDrafter:
        """The engine's one slot drafter ``name``, built with ``num_slots`` and the options."""
        drafter = create_slot_drafter(name, self.target, num_slots=self.num_slots, **self.options)
        if not isinstance(drafter, SlotDrafter):
            raise ValueError(f"slot drafter {name!r} built {type(drafter).__name__}, not a SlotDrafter")
        return drafter

    def _share(self, drafter: Drafter) -> bool:
        """Serve every row with this one instance if it says it can (``batched_rows = True``: it keeps
        no per-row state and draws randomness only from the keyed ``noise`` its ``propose`` takes,
        :mod:`specdec.engine.units`)."""
        if getattr(drafter, "batched_rows", False) is not True:
            return False
        self.batched = True
        self.keyed = "noise" in inspect.signature(drafter.propose).parameters
        self._idle = [drafter]
        return True

    def fresh(self, slot: int) -> Drafter:
        """A drafter instance for the request at cache row ``slot`` (not for a slot drafter: the
        engine adds the slot to :attr:`slots`)."""
        if self.slots is not None:
            raise ValueError("a slot drafter serves every request: add the slot to DrafterPool.slots")
        if self.batched:
            return self._idle[0]
        if self._prototype is not None:
            if self._per_slot is not None:
                return self._per_slot(slot)
            if self._idle:
                return self._idle.pop()
            # the target is shared, never copied
            return copy.deepcopy(self._prototype, memo={id(self.target): self.target})
        engine = {"slot": slot, "num_slots": self.num_slots}
        engine = {key: engine[key] for key in self._engine_options}
        options = self.options
        if "head" in self._shared:  # the loaded head replaces the options that loaded it
            options = {k: v for k, v in options.items() if k not in HEAD_LOADING_OPTIONS}
        drafter = create_drafter(self.name, self.target, **{**options, **self._shared, **engine})
        key = SHARED_PARTS.get(self.name)
        if key is not None and key not in self._shared and key not in self.options:
            part = getattr(drafter, key, None)
            if part is not None:
                self._shared[key] = part
        if not isinstance(drafter, Drafter):
            raise ValueError(f"drafter {self.name!r} built {type(drafter).__name__}, not a Drafter")
        return drafter

    def give_back(self, drafter: Drafter | SlotDrafter | None, slot: int | None = None) -> None:
        """A leaving request's instance: kept for the next request when the drafter was given as an
        object without a ``slot_factory``; a slot drafter drops the request's ``slot``."""
        if drafter is not None and drafter is self.slots:
            if slot is not None:
                self.slots.drop(slot)
            return
        if (
            drafter is not None
            and self._prototype is not None
            and self._per_slot is None
            and not self.batched
        ):
            self._idle.append(drafter)


def row_state(
    prompt_ids: list[int], capacity: int, sampling: SamplingParams, tokens_1L: torch.Tensor | None = None
) -> DecodeState:
    """A request's tokens as the one-row :class:`DecodeState` its drafter reads; ``tokens_1L``: the
    ``[1, capacity]`` row to hold them (the engine's token table at the request's slot), else a new one."""
    if tokens_1L is None:
        tokens_1L = torch.zeros((1, capacity), dtype=torch.long)
    tokens_1L.numpy()[0, : len(prompt_ids)] = prompt_ids
    n = torch.tensor([len(prompt_ids)], dtype=torch.long)
    return DecodeState(
        tokens_BL=tokens_1L,
        prompt_lengths_B=n,
        lengths_B=n.clone(),
        finished_B=torch.zeros(1, dtype=torch.bool),
        sampling=sampling,
    )


def join_outputs(parts: list[TargetOutput]) -> TargetOutput:
    """The prefill chunks' outputs as one (features concatenated along T; the last chunk's logits)."""
    last = parts[-1]
    hidden = None
    if all(p.hidden_BTD is not None for p in parts):
        hidden = torch.cat([p.hidden_BTD for p in parts], dim=1)
    aux = None
    if last.aux_hidden_BTD:
        aux = {i: torch.cat([p.aux_hidden_BTD[i] for p in parts], dim=1) for i in last.aux_hidden_BTD}
    return TargetOutput(logits_BTV=last.logits_BTV, hidden_BTD=hidden, aux_hidden_BTD=aux)
