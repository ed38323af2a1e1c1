"""``ngram`` in the engine: prompt lookup for every row in one call, ragged.

Legend: G rows of a call, K a row's draft depth.

:class:`NGramSlotDrafter` is a :class:`~specdec.protocols.SlotDrafter` over
:class:`~specdec.drafters.ngram.NGramDrafter`'s lookup: each row looks up its own tokens and proposes
what it finds, up to its depth (a point mass), so rows of one call need not share a depth and a row's
proposal depends on its tokens only. There is no state but which slots hold a request.
"""

from __future__ import annotations

import torch

from specdec.drafters.ngram import NGramDrafter
from specdec.drafters.slot_table import StatelessSlots
from specdec.protocols import DraftCall, SlotProposal, Target

__all__ = ["NGramSlotDrafter"]


class NGramSlotDrafter(StatelessSlots):
    """Prompt lookup over ``num_slots`` engine rows; ``max_ngram``, ``min_ngram``, ``search`` as
    :class:`~specdec.drafters.ngram.NGramDrafter` (checked there)."""

    def __init__(
        self,
        target: Target,
        *,
        num_slots: int,
        max_ngram: int = 3,
        min_ngram: int = 1,
        search: str = "latest",
    ) -> None:
        super().__init__(num_slots)
        self.lookup = NGramDrafter(target, max_ngram=max_ngram, min_ngram=min_ngram, search=search)
        self.vocab_size = int(target.vocab_size)

    def propose(self, call: DraftCall) -> SlotProposal:
        """Row i's lookup, up to ``depths[i]`` tokens (point masses: one-hot probabilities where a row of
        the call is sampled)."""
        self.check_propose(call, keyed=False)  # lookups draw nothing
        depths = call.depths
        found = self.lookup.lookups(call.state, max(depths, default=0))
        rows = [f[:k] for f, k in zip(found, depths, strict=True)]
        tokens_T = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        probs_TV = None
        if any(not s.greedy for s in call.sampling) and tokens_T.numel():
            probs_TV = torch.nn.functional.one_hot(tokens_T, self.vocab_size).float()
        return SlotProposal(tokens_T, [len(r) for r in rows], probs_TV)
