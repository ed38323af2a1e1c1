"""Verification rules by name, and how the engine calls them.

Legend: B batch, K draft length (γ), N tree nodes, V vocabulary.

The default rule, ``exact`` (:mod:`specdec.verify.exact`), is rejection sampling (Leviathan et al.
2023, arXiv 2211.17192, Algorithm 1): the output follows the target's distribution exactly.
``gumbel`` (:mod:`specdec.verify.gumbel`) is exact and drafter-invariant; ``lenient``
(:mod:`specdec.verify.lenient`) trades exactness for speed. A rule is looked up by name in
:data:`VERIFY_RULES` (third-party rules register there or through the ``specdec.verify_rules``
entry-point group) and passed to the engine as ``specdec.generate(..., verify=NAME,
verify_options={...})`` or ``specdec generate --verify NAME``.

A rule owns every decision about its proposals; the engine (through :mod:`specdec.verify.blocks`)
only calls it, with the rows' keyed ``noise`` and ``positions_BK``:

- chains: :func:`verify_chain` calls the rule's ``__call__`` with the processed target
  probabilities; in a greedy run it first asks the rule for a fast path
  (:class:`~specdec.verify.contract.GreedyVerifyRule`, ``verify_greedy``: the rule's result from the
  raw logits, or None to be called with probabilities). ``exact`` answers with
  :func:`specdec.verify.greedy_verify` (no ``[B, K+1, V]`` one-hots, no random draws); a subclass
  that overrides ``__call__`` gets None, so its own rule runs in greedy runs too.
- trees: :func:`verify_tree` calls the rule's ``verify_tree``
  (:class:`~specdec.verify.contract.TreeVerifyRule`), its tree policy, lossless or not; a rule
  without one is refused with a ``ValueError`` naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from specdec.registry import Registry
from specdec.sampling import SamplingParams, sampling_probs
from specdec.verify.contract import TreeVerifyRule, VerifyResult, VerifyRule
from specdec.verify.token_tree import TreeProposal
from specdec.verify.tree import TreeVerifyResult

__all__ = ["VERIFY_RULES", "make_verify_rule", "verify_chain", "verify_tree"]


VERIFY_RULES = Registry(
    "verification rule",
    "specdec.verify_rules",
    builtins={
        "exact": "specdec.verify.exact:ExactVerify",
        "lenient": "specdec.verify.lenient:LenientVerify",
        "gumbel": "specdec.verify.gumbel:GumbelVerify",  # drafter-invariant (arXiv 2408.07978)
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
    validate: bool = True,
    **rule_kwargs: Any,
) -> VerifyResult:
    """Verify a chain proposal with ``rule``: in a greedy run its ``verify_greedy`` if it has one and
    it answers, else ``rule(target_probs_BKV, ...)`` on the logits processed by ``sampling``.

    ``target_logits_BKV`` ``[B, K+1, V]``: the target's raw logits at the root and each draft.
    ``rule_kwargs`` (the rows' ``noise=`` and ``positions_BK=``) go to the rule's ``__call__`` only.
    """
    if sampling.greedy:
        fast = getattr(rule, "verify_greedy", None)
        result = fast(target_logits_BKV, draft_tokens_BK, draft_probs_BKV) if callable(fast) else None
        if result is not None:
            return result
    target_probs_BKV = sampling_probs(target_logits_BKV, sampling, validate=validate)
    return rule(
        target_probs_BKV,
        draft_tokens_BK,
        draft_probs_BKV,
        target_logits_BKV=target_logits_BKV,
        sampling=sampling,
        validate=validate,
        **rule_kwargs,
    )


def verify_tree(
    rule: VerifyRule,
    target_logits_BNV: torch.Tensor,
    proposal: TreeProposal,
    *,
    sampling: SamplingParams,
    **rule_kwargs: Any,
) -> TreeVerifyResult:
    """Verify a token tree with ``rule``'s tree policy (``verify_tree``, given ``rule_kwargs`` too);
    ``ValueError`` naming the rule when it has none."""
    if not isinstance(rule, TreeVerifyRule):
        raise ValueError(
            f"the drafter proposed a token tree, but the verification rule {rule!r} has no tree policy "
            "(no verify_tree method); use a chain drafter, or a rule that verifies trees (exact, lenient)"
        )
    return rule.verify_tree(target_logits_BNV, proposal, sampling=sampling, **rule_kwargs)
