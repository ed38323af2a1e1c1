"""The ``none`` drafter: proposes nothing, so every step is a plain decode step (the baseline).

Legend: G rows of a call.

Running plain autoregressive decoding through the same engine as speculative decoding makes the
baseline share every cost that is not speculation (sampling, bookkeeping, cache handling).
"""

from __future__ import annotations

import torch

from specdec.drafters.slot_table import StatelessSlots
from specdec.protocols import DraftCall, SlotProposal, Target

__all__ = ["NoDrafter"]


class NoDrafter(StatelessSlots):
    """A :class:`~specdec.protocols.SlotDrafter` that never drafts (no token for any row of any call)."""

    def __init__(self, target: Target, *, num_slots: int = 1, **options: object) -> None:
        if options:
            raise ValueError(f"drafter 'none' takes no options, got {sorted(options)}")
        super().__init__(num_slots)

    def propose(self, call: DraftCall) -> SlotProposal:
        self.check_propose(call, keyed=False)
        return SlotProposal(torch.zeros(0, dtype=torch.long), [0] * call.size)
