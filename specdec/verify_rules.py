"""Verification rules: how the loop decides which draft tokens to keep.

Legend: B batch, K draft length (γ), V vocabulary.

The default rule, ``exact``, is :func:`specdec.verify.rejection_sample` (Leviathan et al. 2023,
arXiv 2211.17192, Algorithm 1): the output follows the target's distribution exactly. Other rules
trade that guarantee for speed (``lenient``, :mod:`specdec.verify_lossy`). A rule is looked up by
name in :data:`VERIFY_RULES` (third-party rules register there or through the
``specdec.verify_rules`` entry-point group) and passed to the loop as
``specdec.generate(..., verify=NAME, verify_options={...})`` or ``specdec generate --verify NAME``.

A rule owns every decision about its proposals; the loop (through :mod:`specdec.blocks`) only calls it:

- chains: :func:`verify_chain` calls the rule's ``__call__`` (the signature of ``rejection_sample``)
  with the processed target probabilities; in a greedy run it first asks the rule for a fast path
  (:class:`GreedyVerifyRule`, ``verify_greedy``: the rule's result from the raw logits, or None to
  be called with probabilities). ``exact`` answers with :func:`specdec.verify.greedy_verify` (no
  ``[B, K+1, V]`` one-hots, no random draws); a subclass that overrides ``__call__`` gets None, so
  its own rule runs in greedy runs too.
- trees: :func:`verify_tree` calls the rule's ``verify_tree`` (:class:`TreeVerifyRule`), its tree
  policy, lossless or not; a rule without one is refused with a ``ValueError`` naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from specdec.registry import Registry
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.tree import TreeProposal, TreeVerifyResult, tree_greedy_verify, tree_rejection_sample
from specdec.verify import VerifyResult, greedy_verify, rejection_sample

__all__ = [
    "VerifyRule",
    "GreedyVerifyRule",
    "TreeVerifyRule",
    "ExactVerify",
    "VERIFY_RULES",
    "make_verify_rule",
    "verify_chain",
    "verify_tree",
]


@runtime_checkable
class VerifyRule(Protocol):
    """Turns target and draft probabilities into committed tokens, like :func:`rejection_sample`.

    Same inputs and output as :func:`specdec.verify.rejection_sample`, plus the target's raw logits
    (``[B, K+1, V]``, before temperature / top-k / top-p) and the run's sampling parameters, for rules
    that look at the unprocessed distribution. ``lossless`` says whether the output distribution is
    exactly the target's. Greedy runs call ``__call__`` too, with one-hot target probabilities,
    unless the rule offers a fast path (:class:`GreedyVerifyRule`).
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
class GreedyVerifyRule(VerifyRule, Protocol):
    """A rule with a fast path for greedy runs (temperature 0), called before any probabilities exist."""

    def verify_greedy(
        self,
        target_logits_BKV: torch.Tensor,
        draft_tokens_BK: torch.Tensor,
        draft_probs_BKV: torch.Tensor | None,
    ) -> VerifyResult | None:
        """The rule's greedy result from the raw target logits ``[B, K+1, V]``, or None: then the rule
        is called (``__call__``) with the one-hot target probabilities instead."""
        ...


@runtime_checkable
class TreeVerifyRule(VerifyRule, Protocol):
    """A rule that also verifies a token tree: ``verify_tree`` is its tree policy. Exact rules use
    multi-candidate recursive rejection sampling (:mod:`specdec.tree`); a lossy rule defines and
    documents its own (``lenient``: :func:`specdec.verify_lossy.lenient_tree_sample`)."""

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


def verify_chain(
    rule: VerifyRule,
    target_logits_BKV: torch.Tensor,
    draft_tokens_BK: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None,
    *,
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
    validate: bool = True,
    **rule_kwargs: Any,
) -> VerifyResult:
    """Verify a chain proposal with ``rule``: in a greedy run its ``verify_greedy`` if it has one and
    it answers, else ``rule(target_probs_BKV, ...)`` on the logits processed by ``sampling``.

    ``target_logits_BKV`` ``[B, K+1, V]``: the target's raw logits at the root and each draft.
    ``rule_kwargs`` (e.g. a keyed rule's ``noise=``) go to the rule's ``__call__`` only.
    """
    if sampling.greedy:
        fast = getattr(rule, "verify_greedy", None)
        result = fast(target_logits_BKV, draft_tokens_BK, draft_probs_BKV) if callable(fast) else None
        if result is not None:
            return result
    target_probs_BKV = logits_to_probs(
        target_logits_BKV, sampling.temperature, sampling.top_k, sampling.top_p, validate=validate
    )
    return rule(
        target_probs_BKV,
        draft_tokens_BK,
        draft_probs_BKV,
        target_logits_BKV=target_logits_BKV,
        sampling=sampling,
        generator=generator,
        validate=validate,
        **rule_kwargs,
    )


def verify_tree(
    rule: VerifyRule,
    target_logits_BNV: torch.Tensor,
    proposal: TreeProposal,
    *,
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
    **rule_kwargs: Any,
) -> TreeVerifyResult:
    """Verify a token tree with ``rule``'s tree policy (``verify_tree``, given ``rule_kwargs`` too);
    ``ValueError`` naming the rule when it has none."""
    if not isinstance(rule, TreeVerifyRule):
        raise ValueError(
            f"the drafter proposed a token tree, but the verification rule {rule!r} has no tree policy "
            "(no verify_tree method); use a chain drafter, or a rule that verifies trees (exact, lenient)"
        )
    return rule.verify_tree(
        target_logits_BNV, proposal, sampling=sampling, generator=generator, **rule_kwargs
    )


VERIFY_RULES.register("gumbel", "specdec.verify_gumbel:GumbelVerify")  # drafter-invariant (arXiv 2408.07978)
