"""A lossy verification rule: lenient speculative sampling (Leviathan et al. 2023, Appendix A.5).

Legend: B batch, K draft length (γ), V vocabulary.

With lenience l ∈ (0, 1], the draft probability is multiplied by l before it is compared with the
target's (arXiv 2211.17192, §A.5). At each draft position, in order:

- **accepted token**: draft token x is kept with probability min(1, target(x) / (l · draft(x)))
  (a point-mass proposal has draft(x) = 1);
- **recovered token**: at the first rejection, a token is drawn from
  norm(max(target − l · draft, 0)) (the target itself if that has no mass);
- **bonus token**: after K acceptances, a token is drawn from the target at position K+1.

l = 1 is exact speculative sampling (:func:`specdec.verify.rejection_sample`, which this rule then
calls). For l < 1 the output is no longer the target's distribution, with the guarantee the paper
states: no token is emitted with probability above target(x) / l, so rare tokens stay rare. The
acceptance probability per token becomes Σ_x min(target(x) / l, draft(x)).

**Greedy** (temperature 0): the processed target is one-hot, so the rule above changes nothing.
As in §A.5, lenience then applies *before* standardisation, to the raw target distribution
p = softmax(logits): draft x is accepted when p(x) ≥ l · max p (the paper's text prints the
inequality reversed; accepting only tokens at least l times as likely as the argmax is its
intent, and l = 1 gives plain argmax matching). Recovered and bonus tokens are the target's argmax.

**Token trees** (the rule's tree policy, ``LenientVerify.verify_tree``; lossy for l < 1, exact for
l = 1, where it is :func:`specdec.verify.tree.tree_rejection_sample` /
:func:`~specdec.verify.tree.tree_greedy_verify`).
Legend there: N tree nodes (node 0 the root), A accepted path length + 1.

- sampling (:func:`lenient_tree_sample`): SpecInfer's multi-candidate recursive rejection sampling
  (:mod:`specdec.verify.tree`) with the draft measure scaled by l, so that a chain tree is the rule above. At
  a node, with residual r (first the target) and children c_1..c_k tried in drawing order, c_i is
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

import torch

from specdec.sampling import SamplingParams, logits_to_probs, sample_from_probs
from specdec.verify.chain import rejection_sample
from specdec.verify.contract import VerifyResult, validate_verify_inputs
from specdec.verify.tree import (
    TokenTree,
    TreeProposal,
    TreeVerifyResult,
    _normalise_rows,
    tree_greedy_verify,
    tree_rejection_sample,
)

__all__ = ["LenientVerify", "lenient_sample", "lenient_tree_sample", "lenient_tree_greedy"]


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
    generator: torch.Generator | None = None,
    validate: bool = True,
) -> VerifyResult:
    """Lenient verification of K draft tokens per row (see the module doc); same I/O as ``rejection_sample``.

    ``greedy=True`` uses the temperature-0 rule on ``target_logits_BKV`` (required then).
    Leviathan et al. 2023 (arXiv 2211.17192), Appendix A.5.
    """
    _check_lenience(lenience)
    if lenience == 1.0:
        return rejection_sample(
            target_probs_BKV, draft_tokens_BK, draft_probs_BKV, generator=generator, validate=validate
        )
    if validate:
        validate_verify_inputs(target_probs_BKV, draft_tokens_BK, draft_probs_BKV)
        if greedy and (target_logits_BKV is None or target_logits_BKV.shape != target_probs_BKV.shape):
            raise ValueError(
                "greedy lenient verification needs target_logits_BKV of the same shape as target_probs_BKV "
                f"{tuple(target_probs_BKV.shape)}, got "
                f"{None if target_logits_BKV is None else tuple(target_logits_BKV.shape)}"
            )
    B, K1, V = target_probs_BKV.shape
    K = K1 - 1
    device = target_probs_BKV.device
    work_dtype = torch.float64 if target_probs_BKV.dtype == torch.float64 else torch.float32
    target_probs_BKV = target_probs_BKV.to(work_dtype)
    draft_tokens_BK = draft_tokens_BK.long()
    rows_B = torch.arange(B, device=device)

    # --- accept / reject each draft token -------------------------------------------------------
    if greedy:
        raw_BKV = torch.softmax(target_logits_BKV[:, :K].to(work_dtype), dim=-1)
        raw_at_draft_BK = raw_BKV.gather(-1, draft_tokens_BK.unsqueeze(-1)).squeeze(-1)
        accepted_BK = raw_at_draft_BK >= lenience * raw_BKV.amax(dim=-1)
    else:
        target_at_draft_BK = target_probs_BKV[:, :K].gather(-1, draft_tokens_BK.unsqueeze(-1)).squeeze(-1)
        if draft_probs_BKV is None:
            draft_at_draft_BK = torch.ones_like(target_at_draft_BK)
        else:
            draft_probs_BKV = draft_probs_BKV.to(work_dtype)
            draft_at_draft_BK = draft_probs_BKV.gather(-1, draft_tokens_BK.unsqueeze(-1)).squeeze(-1)
        u_BK = torch.rand((B, K), generator=generator, device=device, dtype=work_dtype)
        # u < target / (l·draft)  <=>  u·l·draft < target; draft == 0 is rejected.
        accepted_BK = (u_BK * lenience * draft_at_draft_BK < target_at_draft_BK) & (draft_at_draft_BK > 0)
    num_accepted_B = accepted_BK.long().cumprod(dim=-1).sum(dim=-1)

    # --- one recovered (first rejection) or bonus (all accepted) token per row ----------------------
    stop_B = num_accepted_B
    target_at_stop_BV = target_probs_BKV[rows_B, stop_B]
    rejected_B = stop_B < K
    if greedy or K == 0 or not bool(rejected_B.any()):
        # Greedy: the recovered token is the target's argmax too (its one-hot minus l·draft, normalised).
        stop_dist_BV = target_at_stop_BV
    else:
        stop_clamped_B = stop_B.clamp(max=K - 1)
        if draft_probs_BKV is None:
            draft_at_stop_BV = torch.zeros_like(target_at_stop_BV)
            draft_at_stop_BV[rows_B, draft_tokens_BK[rows_B, stop_clamped_B]] = 1.0
        else:
            draft_at_stop_BV = draft_probs_BKV[rows_B, stop_clamped_B]
        residual_BV = (target_at_stop_BV - lenience * draft_at_stop_BV).clamp_(min=0.0)
        empty_B = residual_BV.sum(dim=-1) <= 0
        residual_BV = torch.where(empty_B.unsqueeze(-1), target_at_stop_BV, residual_BV)
        stop_dist_BV = torch.where(rejected_B.unsqueeze(-1), residual_BV, target_at_stop_BV)
    stop_token_B = sample_from_probs(stop_dist_BV, generator)

    # --- assemble [accepted..., recovered/bonus, -1...] ---------------------------------------------
    tokens_BK1 = torch.full((B, K + 1), -1, dtype=torch.long, device=device)
    if K > 0:
        keep_BK = torch.arange(K, device=device).unsqueeze(0) < num_accepted_B.unsqueeze(1)
        tokens_BK1[:, :K] = torch.where(keep_BK, draft_tokens_BK, tokens_BK1[:, :K])
    tokens_BK1[rows_B, stop_B] = stop_token_B
    return VerifyResult(tokens_BK1, num_accepted_B)


class LenientVerify:
    """The ``lenient`` verification rule (a :class:`specdec.verify.registry.TreeVerifyRule`): chains
    and token trees (see the module doc for both policies).

    Option: ``lenience`` l ∈ (0, 1] (default 0.5); l = 1 is exact. Lossy for l < 1.
    """

    def __init__(self, *, lenience: float = 0.5) -> None:
        _check_lenience(lenience)
        self.lenience = float(lenience)
        self.lossless = self.lenience == 1.0

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
        return lenient_sample(
            target_probs_BKV,
            draft_tokens_BK,
            draft_probs_BKV,
            lenience=self.lenience,
            target_logits_BKV=target_logits_BKV,
            greedy=sampling.greedy,
            generator=generator,
            validate=validate,
        )

    def __repr__(self) -> str:
        return f"LenientVerify(lenience={self.lenience:g})"

    def verify_tree(
        self,
        target_logits_BNV: torch.Tensor,
        proposal: TreeProposal,
        *,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> TreeVerifyResult:
        """The lenient tree policy (module doc): lossy for l < 1, the exact rule's for l = 1."""
        if sampling.greedy:
            return lenient_tree_greedy(
                target_logits_BNV, proposal.tree, proposal.tokens_BN, lenience=self.lenience
            )
        target_probs_BNV = logits_to_probs(
            target_logits_BNV, sampling.temperature, sampling.top_k, sampling.top_p
        )
        return lenient_tree_sample(
            target_probs_BNV,
            proposal.tree,
            proposal.tokens_BN,
            proposal.draft_probs_BNV,
            lenience=self.lenience,
            replacement=proposal.replacement,
            generator=generator,
            validate=False,  # the loop checked the proposal (specdec.checks) and the logits
        )


# --- token trees ----------------------------------------------------------------------------------


def _check_tree_inputs(
    target_BNV: torch.Tensor, tree: TokenTree, tokens_BN: torch.Tensor, draft_probs_BNV: torch.Tensor | None
) -> None:
    if (
        target_BNV.ndim != 3
        or target_BNV.shape[1] != tree.num_nodes
        or tokens_BN.shape != target_BNV.shape[:2]
    ):
        raise ValueError(
            f"tree has {tree.num_nodes} nodes: the target tensor must be [B, {tree.num_nodes}, V] and "
            f"tokens_BN [B, {tree.num_nodes}], got {tuple(target_BNV.shape)}, {tuple(tokens_BN.shape)}"
        )
    if draft_probs_BNV is not None and draft_probs_BNV.shape != target_BNV.shape:
        raise ValueError(
            f"draft_probs_BNV must be [B, N, V]={tuple(target_BNV.shape)}, got {tuple(draft_probs_BNV.shape)}"
        )
    V = target_BNV.shape[-1]
    if tokens_BN[:, 1:].numel() and (tokens_BN[:, 1:].min() < 0 or tokens_BN[:, 1:].max() >= V):
        raise ValueError(f"tokens_BN must lie in [0, V={V})")


def lenient_tree_sample(
    target_probs_BNV: torch.Tensor,
    tree: TokenTree,
    tokens_BN: torch.Tensor,
    draft_probs_BNV: torch.Tensor | None = None,
    *,
    lenience: float,
    replacement: bool = False,
    generator: torch.Generator | None = None,
    validate: bool = True,
) -> TreeVerifyResult:
    """Lenient multi-candidate recursive rejection sampling down a token tree (module doc, "Token
    trees"); same inputs and output as :func:`specdec.verify.tree.tree_rejection_sample`, which l = 1 calls.

    Lossy for l < 1: per node, no token is emitted with probability above target(x) / l.
    Leviathan et al. 2023 (arXiv 2211.17192), Appendix A.5, applied to SpecInfer's (arXiv
    2305.09781) multi-candidate rule.
    """
    _check_lenience(lenience)
    if lenience == 1.0:
        return tree_rejection_sample(
            target_probs_BNV,
            tree,
            tokens_BN,
            draft_probs_BNV,
            replacement=replacement,
            generator=generator,
            validate=validate,
        )
    if validate:
        _check_tree_inputs(target_probs_BNV, tree, tokens_BN, draft_probs_BNV)
        for name, probs in (("target_probs_BNV", target_probs_BNV), ("draft_probs_BNV", draft_probs_BNV)):
            if probs is not None and (torch.isnan(probs).any() or (probs < 0).any()):
                raise ValueError(f"{name} must be non-negative and free of NaN")
    return _lenient_tree_walk(
        target_probs_BNV,
        tree,
        tokens_BN,
        draft_probs_BNV,
        lenience=float(lenience),
        replacement=replacement,
        generator=generator,
    )


def _lenient_tree_walk(
    target_probs_BNV: torch.Tensor,
    tree: TokenTree,
    tokens_BN: torch.Tensor,
    draft_probs_BNV: torch.Tensor | None,
    *,
    lenience: float,
    replacement: bool,
    generator: torch.Generator | None,
) -> TreeVerifyResult:
    """The walk of :func:`specdec.verify.tree.tree_rejection_sample` (same random draws, in the same order)
    with the draft measure scaled by ``lenience``; at l = 1 it returns the same tokens."""
    B, N, _ = target_probs_BNV.shape
    device = target_probs_BNV.device
    work = torch.float64 if target_probs_BNV.dtype == torch.float64 else torch.float32
    tokens_BN = tokens_BN.to(device=device, dtype=torch.long)
    kids_NC = tree.children_table(device)  # [N, max children], −1 padded
    rows_B = torch.arange(B, device=device)
    A = tree.max_depth + 1
    out_tokens = torch.full((B, A), -1, dtype=torch.long, device=device)
    out_nodes = torch.full((B, A), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(B, dtype=torch.long, device=device)
    u_BN = torch.rand((B, N), generator=generator, device=device, dtype=work)  # one per candidate node
    node_B = torch.zeros(B, dtype=torch.long, device=device)
    live_B = torch.ones(B, dtype=torch.bool, device=device)
    for depth in range(A):
        residual_BV = target_probs_BNV[rows_B, node_B].to(work)
        draft_BV = None if draft_probs_BNV is None else draft_probs_BNV[rows_B, node_B].to(work)
        chosen_B = torch.full((B,), -1, dtype=torch.long, device=device)
        for i in range(kids_NC.shape[1]):
            c_B = kids_NC[node_B, i]
            trying_B = live_B & (c_B >= 0) & (chosen_B < 0)
            if not bool(trying_B.any()):
                break
            c_B = c_B.clamp(min=0)
            x_B1 = tokens_BN[rows_B, c_B].unsqueeze(1)
            r_x_B = residual_BV.gather(1, x_B1).squeeze(1)
            q_x_B = torch.ones_like(r_x_B) if draft_BV is None else draft_BV.gather(1, x_B1).squeeze(1)
            # u < r / (l·q)  <=>  u·(l·q) < r: accepted with probability min(1, r / (l·q)); q = 0 rejected.
            accept_B = trying_B & (q_x_B > 0) & (u_BN[rows_B, c_B] * (lenience * q_x_B) < r_x_B)
            chosen_B = torch.where(accept_B, c_B, chosen_B)
            reject_B1 = (trying_B & ~accept_B).unsqueeze(1)
            if draft_BV is None:
                # Point mass: a rejected x had r(x) < l, so max(r − l·δ_x, 0) is r without x.
                next_BV = residual_BV.scatter(1, x_B1, 0.0)
            else:
                next_BV = (residual_BV - lenience * draft_BV).clamp_(min=0.0)
            next_BV, ok_B = _normalise_rows(next_BV)
            residual_BV = torch.where(reject_B1 & ok_B.unsqueeze(1), next_BV, residual_BV)
            if draft_BV is not None and not replacement:
                removed_BV, _ = _normalise_rows(draft_BV.scatter(1, x_B1, 0.0))
                draft_BV = torch.where(reject_B1, removed_BV, draft_BV)
        finish_B = live_B & (chosen_B < 0)
        if bool(finish_B.any()):
            # Recovered token (all candidates rejected) or bonus token (a leaf).
            out_tokens[finish_B, depth] = sample_from_probs(residual_BV[finish_B].float(), generator)
            num_accepted[finish_B] = depth
        go_B = live_B & (chosen_B >= 0)
        out_tokens[go_B, depth] = tokens_BN[rows_B, chosen_B.clamp(min=0)][go_B]
        out_nodes[go_B, depth] = chosen_B[go_B]
        node_B = torch.where(go_B, chosen_B, node_B)
        live_B = go_B
        if not bool(live_B.any()):
            break
    return TreeVerifyResult(out_tokens, num_accepted, out_nodes)


def lenient_tree_greedy(
    target_logits_BNV: torch.Tensor, tree: TokenTree, tokens_BN: torch.Tensor, *, lenience: float
) -> TreeVerifyResult:
    """Greedy lenient verification of a token tree (module doc, "Token trees"): at each node the
    child most likely under the raw softmax of the target's logits, if its probability is at least
    l times the largest; then the argmax. l = 1 calls :func:`specdec.verify.tree.tree_greedy_verify`."""
    _check_lenience(lenience)
    _check_tree_inputs(target_logits_BNV, tree, tokens_BN, None)
    argmax_BN = target_logits_BNV.argmax(dim=-1).cpu()
    if lenience == 1.0:
        return tree_greedy_verify(argmax_BN, tree, tokens_BN.cpu())
    B, N, _ = target_logits_BNV.shape
    work = torch.float64 if target_logits_BNV.dtype == torch.float64 else torch.float32
    raw_BNV = torch.softmax(target_logits_BNV.to(work), dim=-1)
    device = raw_BNV.device
    parents_N1 = torch.tensor(tree.parents[1:], dtype=torch.long, device=device)
    rows_B1 = torch.arange(B, device=device).unsqueeze(1)
    # For every non-root node: its token's probability under its parent, and whether it passes.
    p_BN1 = raw_BNV[rows_B1, parents_N1.unsqueeze(0), tokens_BN[:, 1:].to(device=device, dtype=torch.long)]
    ok_BN1 = p_BN1 >= lenience * raw_BNV.amax(dim=-1)[:, parents_N1]
    p, ok, argmax = p_BN1.tolist(), ok_BN1.tolist(), argmax_BN.tolist()
    tokens = tokens_BN.tolist()
    A = tree.max_depth + 1
    out_tokens = torch.full((B, A), -1, dtype=torch.long)
    out_nodes = torch.full((B, A), -1, dtype=torch.long)
    num_accepted = torch.zeros(B, dtype=torch.long)
    for b in range(B):
        node, depth = 0, 0
        while True:
            passing = [c for c in tree.children[node] if ok[b][c - 1]]
            if not passing:
                out_tokens[b, depth] = argmax[b][node]
                num_accepted[b] = depth
                break
            nxt = max(passing, key=lambda c: p[b][c - 1])  # max keeps the first of equal ones
            out_tokens[b, depth] = tokens[b][nxt]
            out_nodes[b, depth] = nxt
            node, depth = nxt, depth + 1
    return TreeVerifyResult(out_tokens, num_accepted, out_nodes)
