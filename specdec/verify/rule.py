"""The built-in rules' base class: the :class:`~specdec.verify.contract.VerifyRule` contract's
plumbing (input checks, greedy shortcut, tree dispatch, randomness arguments) written once.

Legend: B batch, K draft length (γ), N tree nodes, V vocabulary.

A new rule is one file: a subclass that sets ``name`` (and ``lossless`` / ``drafter_invariant``
where they differ from True / False), either sets ``draft_scale`` or writes :meth:`Rule.chain` and
:meth:`Rule.tree`, and is listed in :data:`specdec.verify.registry.VERIFY_RULES`
(docs/randomness.md shows one).
"""

from __future__ import annotations

from typing import Any

import torch

from specdec.host_sync import avoids_host
from specdec.sampling import SamplingParams, sampling_probs
from specdec.verify.chain import greedy_verify, rejection_sample
from specdec.verify.contract import VerifyResult, need_noise, validate_keyed_inputs, validate_verify_inputs
from specdec.verify.noise import PositionNoise
from specdec.verify.token_tree import TreeProposal
from specdec.verify.tree import TreeVerifyResult, tree_greedy_verify, tree_rejection_sample

__all__ = ["Rule"]


class Rule:
    """The built-in rules' base: the contract's plumbing written once, the rule's decisions as hooks.

    ``__call__`` (chains) checks the inputs, answers greedy calls without randomness with the
    rule's greedy shortcut :meth:`greedy`, and hands the probabilities and the randomness to
    :meth:`chain`. :meth:`verify_tree` (trees) runs :meth:`tree_greedy` in greedy runs, else
    :meth:`tree` on the processed probabilities. By default :meth:`chain` and :meth:`tree` are the
    shared walks (:func:`~specdec.verify.chain.rejection_sample`,
    :func:`~specdec.verify.tree.tree_rejection_sample`) with the acceptance hook ``draft_scale``, and
    the greedy shortcuts are argmax matching; a rule with its own acceptance overrides them.
    """

    name = "rule"
    lossless = True
    drafter_invariant = False
    draft_scale = 1.0
    """The acceptance hook of the shared walks: the draft measure's scale (1 is exact)."""

    def __init__(self, **options: Any) -> None:
        if options:
            raise ValueError(f"verification rule {self.name!r} takes no options, got {sorted(options)}")

    def __call__(
        self,
        target_probs_BKV: torch.Tensor,
        draft_tokens_BK: torch.Tensor,
        draft_probs_BKV: torch.Tensor | None,
        *,
        target_logits_BKV: torch.Tensor,
        sampling: SamplingParams,
        noise: PositionNoise | None = None,
        positions_BK: torch.Tensor | None = None,
        validate: bool = True,
    ) -> VerifyResult:
        if validate:
            validate_verify_inputs(target_probs_BKV, draft_tokens_BK, draft_probs_BKV)
        if sampling.greedy and noise is None and positions_BK is None:
            return self.greedy(target_logits_BKV, draft_tokens_BK)
        need_noise(self.name, noise, positions_BK)
        if validate:
            validate_keyed_inputs(noise, positions_BK, target_probs_BKV)  # type: ignore[arg-type]
        return self.chain(
            target_probs_BKV, draft_tokens_BK, draft_probs_BKV, noise=noise, positions_BK=positions_BK
        )

    def chain(
        self,
        target_probs_BKV: torch.Tensor,
        draft_tokens_BK: torch.Tensor,
        draft_probs_BKV: torch.Tensor | None,
        **randomness: Any,
    ) -> VerifyResult:
        """The chain policy on checked inputs (``randomness``: ``noise``, ``positions_BK``): the shared
        rejection-sampling walk with this rule's ``draft_scale``."""
        return rejection_sample(
            target_probs_BKV,
            draft_tokens_BK,
            draft_probs_BKV,
            draft_scale=self.draft_scale,
            validate=False,
            **randomness,
        )

    def greedy(self, target_logits_BKV: torch.Tensor, draft_tokens_BK: torch.Tensor) -> VerifyResult:
        """The greedy shortcut (one-hot targets, no randomness): argmax matching."""
        return greedy_verify(target_logits_BKV, draft_tokens_BK)

    def verify_greedy(
        self,
        target_logits_BKV: torch.Tensor,
        draft_tokens_BK: torch.Tensor,
        draft_probs_BKV: torch.Tensor | None,
    ) -> VerifyResult | None:
        """:meth:`greedy`, or None when a subclass overrides ``__call__`` (its own rule then runs)."""
        if type(self).__call__ is not Rule.__call__:
            return None
        return self.greedy(target_logits_BKV, draft_tokens_BK)

    def verify_tree(
        self,
        target_logits_BNV: torch.Tensor,
        proposal: TreeProposal,
        *,
        sampling: SamplingParams,
        noise: PositionNoise | None = None,
        positions_BK: torch.Tensor | None = None,
    ) -> TreeVerifyResult:
        """Greedy: :meth:`tree_greedy`; else :meth:`tree` on the processed probabilities. Inputs are
        checked on the host only (on an accelerator the engine's checks cover them)."""
        if sampling.greedy:
            return self.tree_greedy(target_logits_BNV, proposal)
        need_noise(self.name, noise, positions_BK)
        validate = not avoids_host(target_logits_BNV)
        target_probs_BNV = sampling_probs(target_logits_BNV, sampling, validate=validate)
        return self.tree(
            target_probs_BNV, proposal, noise=noise, positions_BN=positions_BK, validate=validate
        )

    def tree(self, target_probs_BNV: torch.Tensor, proposal: TreeProposal, **kwargs: Any) -> TreeVerifyResult:
        """The tree policy on processed probabilities (``kwargs``: noise, positions_BN, validate): the
        shared multi-candidate walk with this rule's ``draft_scale``."""
        return tree_rejection_sample(
            target_probs_BNV,
            proposal.tree,
            proposal.tokens_BN,
            proposal.draft_probs_BNV,
            replacement=proposal.replacement,
            draft_scale=self.draft_scale,
            **kwargs,
        )

    def tree_greedy(self, target_logits_BNV: torch.Tensor, proposal: TreeProposal) -> TreeVerifyResult:
        """The greedy tree policy: the longest path of argmax matches (:func:`tree_greedy_verify`)."""
        return tree_greedy_verify(target_logits_BNV.argmax(dim=-1), proposal.tree, proposal.tokens_BN)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
