"""Verification rules: how the loop decides which draft tokens to keep.

Legend: B batch, K draft length (γ), V vocabulary.

The default rule, ``exact``, is :func:`specdec.verify.rejection_sample` (Leviathan et al. 2023,
arXiv 2211.17192, Algorithm 1): the output follows the target's distribution exactly. Other rules
trade that guarantee for speed (``lenient``, :mod:`specdec.verify_lossy`). A rule is looked up by
name in :data:`VERIFY_RULES` (third-party rules register there or through the
``specdec.verify_rules`` entry-point group) and passed to the loop as
``specdec.generate(..., verify=NAME, verify_options={...})`` or ``specdec generate --verify NAME``.

A rule verifies chains (``__call__``, the signature of ``rejection_sample``); a rule that can also
verify token trees implements :class:`TreeVerifyRule` (``verify_tree``). The loop hands every
proposal to its rule through :mod:`specdec.blocks`, chain or tree alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from specdec.registry import Registry
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.tree import TreeProposal, TreeVerifyResult, tree_greedy_verify, tree_rejection_sample
from specdec.verify import VerifyResult, rejection_sample

__all__ = ["VerifyRule", "TreeVerifyRule", "ExactVerify", "VERIFY_RULES", "make_verify_rule"]


@runtime_checkable
class VerifyRule(Protocol):
    """Turns target and draft probabilities into committed tokens, like :func:`rejection_sample`.

    Same inputs and output as :func:`specdec.verify.rejection_sample`, plus the target's raw logits
    (``[B, K+1, V]``, before temperature / top-k / top-p) and the run's sampling parameters, for rules
    that look at the unprocessed distribution. ``lossless`` says whether the output distribution is
    exactly the target's (tree proposals are verified only by lossless rules).
    """

    lossless: bool

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
    ) -> VerifyResult: ...


@runtime_checkable
class TreeVerifyRule(VerifyRule, Protocol):
    """A rule that also verifies a token tree (lossless rules only: the tree's extra candidates
    are exact only under recursive rejection sampling, :mod:`specdec.tree`)."""

    def verify_tree(
        self,
        target_logits_BNV: torch.Tensor,
        proposal: TreeProposal,
        *,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> TreeVerifyResult:
        """The committed path of a tree whose node i's target logits are ``target_logits_BNV[:, i]``."""
        ...


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

    def verify_tree(
        self,
        target_logits_BNV: torch.Tensor,
        proposal: TreeProposal,
        *,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> TreeVerifyResult:
        """Greedy: the longest path of argmax matches (host walk); else recursive rejection sampling."""
        if sampling.greedy:
            argmax_BN = target_logits_BNV.argmax(dim=-1).cpu()
            return tree_greedy_verify(argmax_BN, proposal.tree, proposal.tokens_BN.cpu())
        target_probs_BNV = logits_to_probs(
            target_logits_BNV, sampling.temperature, sampling.top_k, sampling.top_p
        )
        return tree_rejection_sample(
            target_probs_BNV,
            proposal.tree,
            proposal.tokens_BN,
            proposal.draft_probs_BNV,
            replacement=proposal.replacement,
            generator=generator,
            validate=False,
        )

    def __repr__(self) -> str:
        return "ExactVerify()"


VERIFY_RULES = Registry(
    "verification rule",
    "specdec.verify_rules",
    builtins={
        "exact": "specdec.verify_rules:ExactVerify",
        "lenient": "specdec.verify_lossy:LenientVerify",
    },
)
"""Name -> factory ``(**options) -> VerifyRule``."""


def make_verify_rule(verify: str | VerifyRule, options: Mapping[str, Any] | None = None) -> VerifyRule:
    """A rule from a registered name (built with ``options``) or a rule object (then no options)."""
    if isinstance(verify, str):
        return VERIFY_RULES.get(verify)(**dict(options or {}))
    if options:
        raise ValueError("verify_options only apply when verify is given by name")
    if not isinstance(verify, VerifyRule):
        raise ValueError(
            f"verify must be a rule name ({', '.join(VERIFY_RULES.names())}) or a VerifyRule "
            f"(a callable with a `lossless` attribute), got {type(verify).__name__}"
        )
    return verify
