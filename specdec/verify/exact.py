"""The ``exact`` verification rule: speculative sampling that keeps the target's distribution exactly.

Legend: B batch, K draft length (γ), N tree nodes, V vocabulary.

Chains: rejection sampling (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1;
:mod:`specdec.verify.chain`); trees: SpecInfer's multi-candidate recursive rejection sampling
(arXiv 2305.09781; :mod:`specdec.verify.tree`); greedy runs: argmax matching.
"""

from __future__ import annotations

from typing import Any

import torch

from specdec.host_sync import avoids_host
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.verify.chain import greedy_verify, rejection_sample, rejection_sample_keyed
from specdec.verify.contract import VerifyResult, need_noise
from specdec.verify.noise import PositionNoise
from specdec.verify.tree import TreeProposal, TreeVerifyResult, tree_greedy_verify, tree_rejection_sample

__all__ = ["ExactVerify", "KeyedExactVerify"]


class ExactVerify:
    """Exact speculative sampling: :func:`specdec.verify.rejection_sample` for chains (the
    default), SpecInfer's multi-candidate rejection sampling for trees (:mod:`specdec.tree`)."""

    lossless = True

    def __init__(self, **options: Any) -> None:
        if options:
            raise ValueError(f"verification rule 'exact' takes no options, got {sorted(options)}")

    def __call__(
        self,
        target_probs_BKV: torch.Tensor,
        draft_tokens_BK: torch.Tensor,
        draft_probs_BKV: torch.Tensor | None,
        *,
        target_logits_BKV: torch.Tensor,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
        validate: bool = True,
    ) -> VerifyResult:
        return rejection_sample(
            target_probs_BKV, draft_tokens_BK, draft_probs_BKV, generator=generator, validate=validate
        )

    def verify_greedy(
        self,
        target_logits_BKV: torch.Tensor,
        draft_tokens_BK: torch.Tensor,
        draft_probs_BKV: torch.Tensor | None,
    ) -> VerifyResult | None:
        """:func:`specdec.verify.greedy_verify` for a point-mass proposal: what ``__call__`` returns
        on one-hot targets, from the argmax alone. None (call ``__call__``) when the proposal has
        draft probabilities, or when a subclass overrides ``__call__``: its rule is then not this
        one, and this shortcut would skip it."""
        if draft_probs_BKV is not None or type(self).__call__ is not ExactVerify.__call__:
            return None
        return greedy_verify(target_logits_BKV, draft_tokens_BK)

    def verify_tree(
        self,
        target_logits_BNV: torch.Tensor,
        proposal: TreeProposal,
        *,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> TreeVerifyResult:
        """Greedy: the longest path of argmax matches (:func:`tree_greedy_verify`: a host walk, on an
        accelerator a fixed-shape walk there); else recursive rejection sampling."""
        if sampling.greedy:
            return tree_greedy_verify(target_logits_BNV.argmax(dim=-1), proposal.tree, proposal.tokens_BN)
        return self._sample_tree(target_logits_BNV, proposal, sampling, generator=generator, validate=False)

    @staticmethod
    def _sample_tree(
        target_logits_BNV: torch.Tensor, proposal: TreeProposal, sampling: SamplingParams, **randomness: Any
    ) -> TreeVerifyResult:
        """Recursive rejection sampling of a tree under the sampling settings; ``randomness``: the
        ``generator`` or the keyed ``noise`` and ``positions_BN`` (and ``validate``) of
        :func:`specdec.tree.tree_rejection_sample`."""
        target_probs_BNV = logits_to_probs(
            target_logits_BNV,
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
            validate=randomness.get("validate", True),
        )
        return tree_rejection_sample(
            target_probs_BNV,
            proposal.tree,
            proposal.tokens_BN,
            proposal.draft_probs_BNV,
            replacement=proposal.replacement,
            **randomness,
        )

    def __repr__(self) -> str:
        return "ExactVerify()"


class KeyedExactVerify(ExactVerify):
    """``exact`` with keyed randomness: :func:`specdec.verify_keyed.rejection_sample_keyed` when called
    with ``noise=`` and ``positions_BK=``, else :class:`specdec.verify_rules.ExactVerify` unchanged (a
    generator consumed in call order), so it can stand in for ``exact`` in today's loop.

    Trees: greedy and generator runs as ``exact``; with ``noise=`` and ``positions_BK=`` (``[B, N]``,
    per node) SpecInfer's tree rejection sampling with keyed randomness
    (:func:`specdec.tree.tree_rejection_sample`).
    """

    def __call__(
        self,
        target_probs_BKV: torch.Tensor,
        draft_tokens_BK: torch.Tensor,
        draft_probs_BKV: torch.Tensor | None,
        *,
        target_logits_BKV: torch.Tensor,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
        validate: bool = True,
        noise: PositionNoise | None = None,
        positions_BK: torch.Tensor | None = None,
    ) -> VerifyResult:
        if noise is None and positions_BK is None:
            return super().__call__(
                target_probs_BKV,
                draft_tokens_BK,
                draft_probs_BKV,
                target_logits_BKV=target_logits_BKV,
                sampling=sampling,
                generator=generator,
                validate=validate,
            )
        need_noise("exact", noise, positions_BK)
        return rejection_sample_keyed(
            target_probs_BKV,
            draft_tokens_BK,
            draft_probs_BKV,
            noise=noise,  # type: ignore[arg-type]
            positions_BK=positions_BK,  # type: ignore[arg-type]
            validate=validate,
        )

    def verify_greedy(
        self,
        target_logits_BKV: torch.Tensor,
        draft_tokens_BK: torch.Tensor,
        draft_probs_BKV: torch.Tensor | None,
    ) -> VerifyResult | None:
        """As ``exact``: argmax matching for point-mass proposals (no random draw is made)."""
        if draft_probs_BKV is not None:
            return None
        return greedy_verify(target_logits_BKV, draft_tokens_BK)

    def verify_tree(
        self,
        target_logits_BNV: torch.Tensor,
        proposal: TreeProposal,
        *,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
        noise: PositionNoise | None = None,
        positions_BK: torch.Tensor | None = None,
    ) -> TreeVerifyResult:
        if noise is None or sampling.greedy:
            return super().verify_tree(target_logits_BNV, proposal, sampling=sampling, generator=generator)
        need_noise("exact", noise, positions_BK)
        return self._sample_tree(
            target_logits_BNV,
            proposal,
            sampling,
            noise=noise,
            positions_BN=positions_BK,
            validate=not avoids_host(target_logits_BNV),  # on an accelerator the engine's checks
        )

    def __repr__(self) -> str:
        return "KeyedExactVerify()"
