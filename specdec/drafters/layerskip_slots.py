"""``layerskip`` in the engine: one drafter, one early-exit forward per draft position for all rows.

Legend: S engine slots, G rows of a call, K a row's draft depth, V vocabulary.

:class:`LayerSkipSlotDrafter` is a :class:`~specdec.protocols.SlotDrafter` over the target's own first
``num_layers`` layers (:mod:`specdec.drafters.layerskip`: LayerSkip's self-speculation with cache
reuse). It keeps nothing per slot but whether the slot holds a request: each draft position is **one**
``forward_layers`` call over every row still drafting, each at its own row of the target's cache, past
the row's length, where that row's verify block then overwrites the layer-< N keys and values it wrote.
A row's drafts depend on that row only (the native target gives a row the same logits whatever the
other rows); sampled rows draw from the keyed ``noise`` (stream ``"draft"``, by output position).
"""

from __future__ import annotations

import torch

from specdec.drafters.layerskip import LayerSkipDrafter
from specdec.drafters.slot_table import StatelessSlots, draw_draft
from specdec.protocols import DraftCall, SlotProposal, Target

__all__ = ["LayerSkipSlotDrafter"]


class LayerSkipSlotDrafter(StatelessSlots):
    """The target's first ``num_layers`` layers drafting for ``num_slots`` engine rows (see the module
    doc); ``num_layers`` as :class:`~specdec.drafters.layerskip.LayerSkipDrafter` (checked there)."""

    def __init__(self, target: Target, *, num_slots: int, num_layers: int | None = None) -> None:
        super().__init__(num_slots)
        one = LayerSkipDrafter(target, num_layers=num_layers, slot=0)  # the target's and the option's checks
        self.target, self.num_layers = target, one.num_layers
        self.vocab_size = int(target.vocab_size)

    @torch.inference_mode()
    def propose(self, call: DraftCall) -> SlotProposal:
        """``depths[i]`` tokens for row ``slots[i]``: one early-exit forward per position over the rows
        still drafting, at cache slots ``lengths - 1 + k``."""
        slots = self.check_propose(call)
        depths, state, sampling, noise = call.depths, call.state, call.sampling, call.noise
        G = len(slots)
        sampled = any(not s.greedy for s in sampling)
        drafted: list[list[int]] = [[] for _ in range(G)]
        probs: list[list[torch.Tensor | None]] = [[] for _ in range(G)]
        rows = [i for i in range(G) if depths[i] > 0]
        lengths = state.lengths_B.tolist()
        outputs = (state.lengths_B - state.prompt_lengths_B).tolist()
        last = state.last_tokens_B().tolist()
        tokens = {i: last[i] for i in rows}
        for k in range(max((depths[i] for i in rows), default=0)):
            rows = [i for i in rows if depths[i] > k]
            out = self.target.forward_layers(
                torch.tensor([[tokens[i]] for i in rows], dtype=torch.long),
                torch.tensor([lengths[i] - 1 + k for i in rows], dtype=torch.long),
                num_layers=self.num_layers,
                rows_B=torch.tensor([slots[i] for i in rows]),
            )
            logits_GV = out.logits_BTV[:, -1].float().cpu()
            for j, i in enumerate(rows):
                tokens[i], p = draw_draft(logits_GV[j], sampling[i], noise, i, outputs[i] + k)
                drafted[i].append(tokens[i])
                probs[i].append(p)
        tokens_T = torch.tensor([t for d in drafted for t in d], dtype=torch.long)
        probs_TV = None
        if sampled and tokens_T.numel():
            zero_V = torch.zeros(self.vocab_size)
            probs_TV = torch.stack([zero_V if p is None else p for row in probs for p in row])
        return SlotProposal(tokens_T, [len(d) for d in drafted], probs_TV)
