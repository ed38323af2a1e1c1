"""What every slot drafter shares: which slots hold a request, the argument checks, a row's keyed draft.

A :class:`~specdec.protocols.SlotDrafter` keeps state per engine cache row (slot). :class:`SlotTable`
is the part that is the same for all of them: ``num_slots``, which slots are in use (``active``), and
the checks of ``add`` / ``drop`` / ``propose`` / ``observe`` arguments (a slot is an int in range; a
call's slots are distinct and in use; ``add`` takes a free slot and a non-empty prompt; ``propose``
takes one depth, setting and state row per slot, and keyed noise where a row is sampled).
:func:`draw_draft` is one row's draft token from its logits: the argmax, or a draw from the processed
distribution keyed by the row's seed and output position (stream ``"draft"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specdec.protocols import DraftCall, SlotProposal
from specdec.sampling import SamplingParams, sampling_probs
from specdec.verify.noise import PositionNoise, sample_keyed

__all__ = ["SlotTable", "StatelessSlots", "draw_draft", "ragged_proposal"]


def draw_draft(
    logits_V: torch.Tensor, params: SamplingParams, noise: PositionNoise | None, row: int, position: int
) -> tuple[int, torch.Tensor | None]:
    """Row ``row``'s draft token at output ``position`` from its logits ``[V]``, and the distribution it
    was drawn from (None for a greedy row: its argmax, a point mass)."""
    if params.greedy:
        return int(logits_V.argmax()), None
    probs_1V = sampling_probs(logits_V[None], params)
    one = PositionNoise(noise.seeds_B[[row]])
    token = sample_keyed(probs_1V, one, torch.tensor([position]), stream="draft")
    return int(token[0]), probs_1V[0]


def ragged_proposal(
    drafted: list[list[Any]],
    probs: list[list[torch.Tensor | None]],
    sampling: Sequence[SamplingParams],
    vocab_size: int,
    device: Any = "cpu",
) -> SlotProposal:
    """Each row's drafts (ints or 0-d tensors) and the distributions they were drawn from (None: a
    greedy row's point mass) as one :class:`~specdec.protocols.SlotProposal`: rows back to back;
    probabilities ``[T, V]`` where a row of the call is sampled, a greedy row's entries zeros."""
    flat = [t for row in drafted for t in row]
    if flat and isinstance(flat[0], torch.Tensor):
        tokens_T = torch.stack(flat)
    else:
        tokens_T = torch.tensor(flat, dtype=torch.long, device=device)
    probs_TV = None
    if any(not s.greedy for s in sampling):
        zero_V = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        rows = [zero_V if p is None else p for row in probs for p in row]
        probs_TV = torch.stack(rows) if rows else torch.zeros(0, vocab_size, device=device)
    return SlotProposal(tokens_T, [len(row) for row in drafted], probs_TV)


class SlotTable:
    """``num_slots`` engine rows, each free or holding one request (``active``)."""

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.num_slots = num_slots
        self.active = [False] * num_slots

    def _check_slot(self, slot: int, name: str = "slot") -> int:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"{name} must be an int in [0, {self.num_slots}), got {slot!r}")
        return slot

    def _check_slots(self, slots: Sequence[int]) -> list[int]:
        """A call's slots: in range, distinct, each holding a request."""
        slots = [self._check_slot(s, "slots") for s in slots]
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots must be distinct, got {slots}")
        idle = [s for s in slots if not self.active[s]]
        if idle:
            raise ValueError(f"slots {idle} hold no request (add them first)")
        return slots

    def check_propose(self, call: DraftCall, *, keyed: bool = True) -> list[int]:
        """``propose``'s call: its slots (:meth:`_check_slots`; the call checks its own shapes) and,
        where ``keyed`` and a row is sampled, its noise; returns the slots."""
        if not isinstance(call, DraftCall):
            raise ValueError(f"call must be a DraftCall, got {type(call).__name__}")
        slots = self._check_slots(call.slots)
        if keyed and call.noise is None and any(not s.greedy for s in call.sampling):
            raise ValueError("noise: sampled rows need a PositionNoise with one seed per slot")
        return slots

    def _take(self, slot: int, prompt_ids: Sequence[int]) -> None:
        """``add``'s checks (a free slot in range, a non-empty prompt), then mark the slot in use."""
        self._check_slot(slot)
        if self.active[slot]:
            raise ValueError(f"slot {slot} is in use: drop it before adding another request there")
        if not prompt_ids:
            raise ValueError("prompt_ids must be non-empty")
        self.active[slot] = True

    def _free(self, slot: int) -> None:
        """``drop``: the slot (checked) holds no request any more."""
        self._check_slot(slot)
        self.active[slot] = False


class StatelessSlots(SlotTable):
    """A slot drafter that keeps nothing per slot but whether it holds a request (``ngram``,
    ``layerskip``): ``add``, ``drop`` and ``observe`` only check and mark the slots."""

    def add(self, slot: int, prompt_ids: Sequence[int], prefill_out: Any) -> None:
        self._take(slot, prompt_ids)

    def drop(self, slot: int) -> None:
        self._free(slot)

    def observe(
        self, slots: Sequence[int], num_accepted: Sequence[int], features: Any, *, state: Any
    ) -> None:
        self._check_slots(slots)
