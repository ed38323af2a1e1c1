"""A lossy verification rule: lenient speculative sampling (Leviathan et al. 2023, Appendix A.5).

Legend: B batch, K draft length (γ), V vocabulary.

With lenience l ∈ (0, 1], the draft probability is multiplied by l before it is compared with the
target's (arXiv 2211.17192, §A.5). At each draft position, in order:

- **accepted token**: draft token x is kept with probability min(1, target(x) / (l · draft(x)))
  (a point-mass proposal has draft(x) = 1);
- **recovered token**: at the first rejection, a token is drawn from
  norm(max(target − l · draft, 0)) (the target itself if that has no mass);
- **bonus token**: after K acceptances, a token is drawn from the target at position K+1.

The rule is an acceptance hook on the shared walks: the chain walk
(:func:`specdec.verify.chain.rejection_sample`) and the tree walk
(:func:`specdec.verify.tree.tree_rejection_sample`) with ``draft_scale=l``, and the same keyed
randomness as ``exact``, so l = 1 is exact speculative sampling token for token. For l < 1 the
output is no longer the target's distribution, with the guarantee the paper states: no token is
emitted with probability above target(x) / l, so rare tokens stay rare. The acceptance probability
per token becomes Σ_x min(target(x) / l, draft(x)).

**Greedy** (temperature 0): the processed target is one-hot, so the rule above changes nothing.
As in §A.5, lenience then applies *before* standardisation, to the raw target distribution
p = softmax(logits): draft x is accepted when p(x) ≥ l · max p (the paper's text prints the
inequality reversed; accepting only tokens at least l times as likely as the argmax is its
intent, and l = 1 gives plain argmax matching). Recovered and bonus tokens are the target's argmax.

**Token trees** (the rule's tree policy; lossy for l < 1, exact for l = 1).
Legend there: N tree nodes (node 0 the root), A accepted path length + 1.

- sampling (:func:`lenient_tree_sample`): SpecInfer's multi-candidate recursive rejection sampling
  (:mod:`specdec.verify.tree`) with the draft measure scaled by l, so that a chain tree is the rule
  above. At a node, with residual r (first the target) and children c_1..c_k tried in drawing order, c_i is
  accepted with probability min(1, r(c_i) / (l · draft_i(c_i))); on rejection
  r ← norm(max(r − l · draft_i, 0)) (point masses: r without c_i); all rejected: the recovered token
  is drawn from r; at a leaf the bonus token from the target. ``draft_i`` is the draft
  distribution, with earlier candidates removed when children were drawn without replacement.
  The paper's guarantee carries over per node: given the path so far, no token is emitted with
  probability above target(x) / l. By induction from the last candidate: if what follows a
  rejection emits x with probability at most r'(x) / l, the node emits x with probability at most
  min(draft(x), r(x)/l) + β · max(r(x) − l·draft(x), 0) / (l · Z) ≤ r(x) / l, since the rejection
  probability β = 1 − Σ min(draft, r/l) is at most the residual's mass Z = 1 − l + l·β.
- greedy (:func:`lenient_tree_greedy`): at each node the child the target's raw softmax p finds
  most likely (the first on ties) is accepted when p(child) ≥ l · max p; the recovered or bonus
  token is the argmax. A child holding the argmax always passes and is the one taken (up to exact
  ties in probability), so wherever exact greedy accepts a child this rule accepts the same one; on
  a chain tree this is the chain rule above.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from specdec.verify.chain import rejection_sample
from specdec.verify.contract import VerifyResult, validate_verify_inputs
from specdec.verify.noise import PositionNoise
from specdec.verify.rule import Rule
from specdec.verify.token_tree import TokenTree, TreeProposal
from specdec.verify.tree import (
    TreeVerifyResult,
    check_tree_inputs,
    tree_greedy_verify,
    tree_rejection_sample,
    tree_walk_fixed,
)

__all__ = ["LenientVerify", "lenient_sample", "lenient_greedy", "lenient_tree_sample", "lenient_tree_greedy"]


def _check_lenience(lenience: float) -> None:
    if (
        isinstance(lenience, bool)
        or not isinstance(lenience, (int, float))
        or math.isnan(lenience)
        or not 0.0 < lenience <= 1.0
    ):
        raise ValueError(f"lenience must be a number in (0, 1], got {lenience!r}")


def lenient_sample(
    target_probs_BKV: torch.Tensor,
    draft_tokens_BK: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None,
    *,
    lenience: float,
    target_logits_BKV: torch.Tensor | None = None,
    greedy: bool = False,
    noise: PositionNoise | None = None,
    positions_BK: torch.Tensor | None = None,
    validate: bool = True,
) -> VerifyResult:
    """Lenient verification of K draft tokens per row (module doc); same I/O as ``rejection_sample``.

    ``greedy=True`` uses the temperature-0 rule (:func:`lenient_greedy`) on ``target_logits_BKV``
    (required then, and no randomness); else ``noise`` and ``positions_BK`` are required.
    Leviathan et al. 2023 (arXiv 2211.17192), Appendix A.5.
    """
    _check_lenience(lenience)
    if greedy:
        if validate:
            validate_verify_inputs(target_probs_BKV, draft_tokens_BK, draft_probs_BKV)
            if target_logits_BKV is None or target_logits_BKV.shape != target_probs_BKV.shape:
                raise ValueError(
                    "greedy lenient verification needs target_logits_BKV of the same shape as "
                    f"target_probs_BKV {tuple(target_probs_BKV.shape)}, got "
                    f"{None if target_logits_BKV is None else tuple(target_logits_BKV.shape)}"
                )
        return lenient_greedy(target_logits_BKV, draft_tokens_BK, lenience=lenience)  # type: ignore[arg-type]
    return rejection_sample(
        target_probs_BKV,
        draft_tokens_BK,
        draft_probs_BKV,
        noise=noise,  # type: ignore[arg-type]
        positions_BK=positions_BK,  # type: ignore[arg-type]
        draft_scale=float(lenience),
        validate=validate,
    )


def lenient_greedy(
    target_logits_BKV: torch.Tensor, draft_tokens_BK: torch.Tensor, *, lenience: float
) -> VerifyResult:
    """Greedy lenient verification (module doc, "Greedy"): draft x accepted when the raw softmax
    p(x) ≥ l · max p, in order; then the argmax. l = 1 is argmax matching."""
    B, K1, _ = target_logits_BKV.shape
    K = K1 - 1
    work = torch.float64 if target_logits_BKV.dtype == torch.float64 else torch.float32
    draft_tokens_BK = draft_tokens_BK.to(device=target_logits_BKV.device, dtype=torch.long)
    raw_BKV = torch.softmax(target_logits_BKV[:, :K].to(work), dim=-1)
    raw_at_draft_BK = raw_BKV.gather(-1, draft_tokens_BK.unsqueeze(-1)).squeeze(-1)
    num_accepted_B = (raw_at_draft_BK >= lenience * raw_BKV.amax(dim=-1)).long().cumprod(dim=-1).sum(dim=-1)
    argmax_BK1 = target_logits_BKV.argmax(dim=-1)
    tokens_BK1 = torch.cat([draft_tokens_BK, argmax_BK1[:, K:]], dim=1)
    stop_B1 = num_accepted_B.unsqueeze(1)
    positions_K1 = torch.arange(K1, device=tokens_BK1.device)
    tokens_BK1 = torch.where(positions_K1 == stop_B1, argmax_BK1.gather(1, stop_B1), tokens_BK1)
    return VerifyResult(torch.where(positions_K1 <= stop_B1, tokens_BK1, -1), num_accepted_B)


class LenientVerify(Rule):
    """The ``lenient`` verification rule: chains and token trees (module doc for both policies).

    Option: ``lenience`` l ∈ (0, 1] (default 0.5); l = 1 is exact. Lossy for l < 1.
    """

    name = "lenient"

    def __init__(self, *, lenience: float = 0.5) -> None:
        _check_lenience(lenience)
        self.lenience = self.draft_scale = float(lenience)
        self.lossless = self.lenience == 1.0

    def greedy(self, target_logits_BKV: torch.Tensor, draft_tokens_BK: torch.Tensor) -> VerifyResult:
        return lenient_greedy(target_logits_BKV, draft_tokens_BK, lenience=self.lenience)

    def tree_greedy(self, target_logits_BNV: torch.Tensor, proposal: TreeProposal) -> TreeVerifyResult:
        return lenient_tree_greedy(
            target_logits_BNV, proposal.tree, proposal.tokens_BN, lenience=self.lenience
        )

    def __repr__(self) -> str:
        return f"LenientVerify(lenience={self.lenience:g})"


def lenient_tree_sample(
    target_probs_BNV: torch.Tensor,
    tree: TokenTree,
    tokens_BN: torch.Tensor,
    draft_probs_BNV: torch.Tensor | None = None,
    *,
    lenience: float,
    replacement: bool = False,
    **randomness: Any,
) -> TreeVerifyResult:
    """Lenient multi-candidate recursive rejection sampling down a token tree (module doc, "Token
    trees"): :func:`specdec.verify.tree.tree_rejection_sample` with the draft measure scaled by l
    (``randomness``: its ``noise``, ``positions_BN``, ``validate``).

    Lossy for l < 1: per node, no token is emitted with probability above target(x) / l.
    Leviathan et al. 2023 (arXiv 2211.17192), Appendix A.5, applied to SpecInfer's (arXiv
    2305.09781) multi-candidate rule.
    """
    _check_lenience(lenience)
    return tree_rejection_sample(
        target_probs_BNV,
        tree,
        tokens_BN,
        draft_probs_BNV,
        replacement=replacement,
        draft_scale=float(lenience),
        **randomness,
    )


def lenient_tree_greedy(
    target_logits_BNV: torch.Tensor, tree: TokenTree, tokens_BN: torch.Tensor, *, lenience: float
) -> TreeVerifyResult:
    """Greedy lenient verification of a token tree (module doc, "Token trees"): at each node the
    child most likely under the raw softmax of the target's logits, if its probability is at least
    l times the largest; then the argmax. l = 1 calls :func:`specdec.verify.tree.tree_greedy_verify`.

    The walk is :func:`specdec.verify.tree.tree_walk_fixed`, choosing at each node the best passing
    child's token (siblings with one token share its probability: the first is followed), or the
    argmax where no child passes (no child holds it then: the argmax always passes).
    """
    _check_lenience(lenience)
    check_tree_inputs(target_logits_BNV, tree, tokens_BN, probabilities=False)
    argmax_BN = target_logits_BNV.argmax(dim=-1)
    if lenience == 1.0:
        return tree_greedy_verify(argmax_BN, tree, tokens_BN)
    B, N, _ = target_logits_BNV.shape
    device = target_logits_BNV.device
    work = torch.float64 if target_logits_BNV.dtype == torch.float64 else torch.float32
    raw_BNV = torch.softmax(target_logits_BNV.to(work), dim=-1)
    tokens_BN = tokens_BN.to(device=device, dtype=torch.long)
    kids_BNC = tree.children_table(device).clamp(min=0).expand(B, -1, -1)  # padding -> the root, masked
    kid_tokens_BNC = tokens_BN.gather(1, kids_BNC.flatten(1)).view_as(kids_BNC)
    # Each child's token's probability under its node, and whether it passes.
    p_BNC = raw_BNV.gather(2, kid_tokens_BNC)
    passes_BNC = (tree.children_table(device) >= 0) & (p_BNC >= lenience * raw_BNV.amax(dim=-1, keepdim=True))
    best_BN1 = torch.where(passes_BNC, p_BNC, -1.0).argmax(dim=-1, keepdim=True)  # the first of equal ones
    want_BN = torch.where(passes_BNC.any(dim=-1), kid_tokens_BNC.gather(2, best_BN1).squeeze(-1), argmax_BN)
    return tree_walk_fixed(lambda rows_B, node_B: want_BN[rows_B, node_B], tree, tokens_BN, B, device)
