"""The ``exact`` verification rule: speculative sampling that keeps the target's distribution exactly.

Legend: B batch, K draft length (γ), N tree nodes, V vocabulary.

Chains: rejection sampling (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1;
:func:`specdec.verify.chain.rejection_sample`); trees: SpecInfer's multi-candidate recursive
rejection sampling (arXiv 2305.09781; :func:`specdec.verify.tree.tree_rejection_sample`); greedy
runs: argmax matching. Randomness keyed by each row's seed and sequence positions
(:mod:`specdec.verify.noise`): a request's output depends on its seed and the drafter's proposals,
not on its batch neighbours or step boundaries.
"""

from __future__ import annotations

import torch

from specdec.verify.contract import VerifyResult
from specdec.verify.rule import Rule

__all__ = ["ExactVerify"]


class ExactVerify(Rule):
    """Exact speculative sampling: the shared walks at ``draft_scale`` 1, rejection sampling for
    chains (the default rule), SpecInfer's multi-candidate rejection sampling for trees (module doc)."""

    name = "exact"

    def verify_greedy(
        self,
        target_logits_BKV: torch.Tensor,
        draft_tokens_BK: torch.Tensor,
        draft_probs_BKV: torch.Tensor | None,
    ) -> VerifyResult | None:
        """:func:`specdec.verify.chain.greedy_verify` for a point-mass proposal: what ``__call__``
        returns on one-hot targets, from the argmax alone. None (call ``__call__``) when the proposal
        has draft probabilities, or when a subclass overrides ``__call__``."""
        if draft_probs_BKV is not None:
            return None
        return super().verify_greedy(target_logits_BKV, draft_tokens_BK, draft_probs_BKV)
