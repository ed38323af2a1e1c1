"""The ``none`` drafter: proposes nothing, so every step is a plain decode step (the baseline).

Legend: B batch, K draft length.

Running plain autoregressive decoding through the same engine as speculative decoding makes the
baseline share every cost that is not speculation (sampling, bookkeeping, cache handling).
"""

from __future__ import annotations

import torch

from specdec.protocols import DecodeState, Proposal, Target, TargetOutput

__all__ = ["NoDrafter"]


class NoDrafter:
    """A :class:`specdec.protocols.Drafter` that never drafts (K = 0 at every step)."""

    batched_rows = True  # stateless: the engine drafts every row with this one instance
    observes = False  # its observe does nothing: the engine need not build the rows' state for it

    def __init__(self, target: Target, **options: object) -> None:
        if options:
            raise ValueError(f"drafter 'none' takes no options, got {sorted(options)}")

    def begin(self, state: DecodeState, target_out: TargetOutput) -> None:
        pass

    def propose(self, state: DecodeState, gamma: int, generator: torch.Generator | None = None) -> Proposal:
        return Proposal(tokens_BK=state.tokens_BL.new_empty((state.batch_size, 0)))

    def observe(self, state: DecodeState, num_accepted_B: torch.Tensor, target_out: TargetOutput) -> None:
        pass
