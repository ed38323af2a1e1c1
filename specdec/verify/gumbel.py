"""Drafter-invariant verification: the ``gumbel`` rule.

Legend: B batch, K draft length (γ), N tree nodes, V vocabulary.

**gumbel** (Daliri, Musco and Suresh 2024, "Coupling without Communication and Drafter-Invariant
Speculative Decoding", arXiv 2408.07978). At each position p the target's token is its keyed
Gumbel-max sample ``y_p = argmax_v log target_probs_p(v) + G(seed, p, "sample")``
(:func:`specdec.verify.noise.sample_keyed`). A draft token is accepted iff it equals ``y_p``; the first
mismatch commits ``y_p`` (the recovered token), and after K matches the bonus ``y_{K+1}``. Every
committed token is therefore the token plain keyed decoding would have produced at that position,
given the same prefix: the output is **the same as decoding without a drafter**, for any drafter and
any draft depth, and so follows the target's distribution exactly. The price is acceptance: a draft
drawn independently of the target is accepted with probability Σ_v draft(v)·target(v) (below exact
rejection sampling's Σ_v min(draft, target)); a drafter that draws with the same public noise
(:func:`specdec.verify.noise.draft_keyed`) is accepted with probability ≥ (1 − TV) / (1 + TV).

For trees: at each node the target's sample ``y`` at that node's position (its depth) is computed,
and the walk descends into the child whose token equals it; the committed path is the longest root
path whose node tokens equal y at each depth, then y after it. Again the output is plain keyed
decoding's.

The rule takes the public randomness as keyword arguments: ``noise=`` (a
:class:`specdec.verify.noise.PositionNoise`, one seed per row) and ``positions_BK=`` (``[B, K+1]`` for
chains, ``[B, N]`` for trees: the sequence position of the token each target row decides; a tree
node at depth d decides position ``start + d``).
"""

from __future__ import annotations

from typing import Any

import torch

from specdec.host_sync import avoids_host
from specdec.verify.contract import VerifyResult, validate_keyed_inputs, validate_verify_inputs
from specdec.verify.noise import PositionNoise, sample_keyed, sample_with_keys
from specdec.verify.rule import Rule
from specdec.verify.token_tree import TokenTree, TreeProposal
from specdec.verify.tree import TreeVerifyResult, check_tree_inputs, tree_walk_fixed

__all__ = ["gumbel_verify", "gumbel_verify_tree", "GumbelVerify"]


def gumbel_verify(
    target_probs_BKV: torch.Tensor,
    draft_tokens_BK: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None = None,
    *,
    noise: PositionNoise,
    positions_BK: torch.Tensor,
    validate: bool = True,
) -> VerifyResult:
    """Drafter-invariant verification of K draft tokens per row (arXiv 2408.07978; module doc).

    Same inputs and output as :func:`specdec.verify.chain.rejection_sample`; ``draft_probs_BKV``
    is not used (only whether a draft equals the target's keyed sample matters). The target's sample
    is computed only at positions a row reaches: up to its first mismatch; on an accelerator
    (:func:`specdec.host_sync.avoids_host`) at every position at once, in one race
    (:func:`_gumbel_all_positions`: the same tokens, no host read).
    """
    if validate:
        validate_verify_inputs(target_probs_BKV, draft_tokens_BK, draft_probs_BKV)
        validate_keyed_inputs(noise, positions_BK, target_probs_BKV)
    B, K1, _ = target_probs_BKV.shape
    K = K1 - 1
    device = target_probs_BKV.device
    draft_tokens_BK = draft_tokens_BK.to(device=device, dtype=torch.long)
    if avoids_host(target_probs_BKV):
        return _gumbel_all_positions(target_probs_BKV, draft_tokens_BK, noise, positions_BK)
    tokens_BK1 = torch.full((B, K1), -1, dtype=torch.long, device=device)
    num_accepted_B = torch.zeros(B, dtype=torch.long, device=device)
    live_R = torch.arange(B, device=device)
    for k in range(K1):
        y_R = sample_keyed(
            target_probs_BKV[live_R, k], noise.select(live_R), positions_BK[live_R, k], validate=False
        )
        tokens_BK1[live_R, k] = y_R
        if k == K:
            break
        match_R = draft_tokens_BK[live_R, k] == y_R
        live_R = live_R[match_R]
        num_accepted_B[live_R] += 1
        if live_R.numel() == 0:
            break
    return VerifyResult(tokens_BK1, num_accepted_B)


def _gumbel_all_positions(
    target_probs_BKV: torch.Tensor,
    draft_tokens_BK: torch.Tensor,
    noise: PositionNoise,
    positions_BK: torch.Tensor,
) -> VerifyResult:
    """:func:`gumbel_verify` with the target's keyed sample drawn at all K+1 positions of every row in
    one call, then the matches counted: the same tokens as the row-by-row loop (a position's sample
    reads only its weights and key), no host read, K+1 races per row instead of up to the first
    mismatch."""
    B, K1, V = target_probs_BKV.shape
    K = K1 - 1
    keys_N = noise.keys(positions_BK.to(torch.long), "sample", validate=False).reshape(-1)
    y_BK1 = sample_with_keys(target_probs_BKV.reshape(-1, V), keys_N).reshape(B, K1)
    num_accepted_B = (draft_tokens_BK == y_BK1[:, :K]).long().cumprod(dim=-1).sum(dim=-1)
    keep_BK1 = torch.arange(K1, device=y_BK1.device) <= num_accepted_B[:, None]
    return VerifyResult(torch.where(keep_BK1, y_BK1, -1), num_accepted_B)


def gumbel_verify_tree(
    target_probs_BNV: torch.Tensor,
    tree: TokenTree,
    tokens_BN: torch.Tensor,
    *,
    noise: PositionNoise,
    positions_BN: torch.Tensor,
    validate: bool = True,
) -> TreeVerifyResult:
    """Drafter-invariant verification of a token tree: the longest root path whose node tokens equal
    the target's keyed sample at each depth, then that sample after it (module doc).

    Args:
        target_probs_BNV: the target's processed distribution after each node, ``[B, N, V]``.
        tree: the shape; node i's token is ``tokens_BN[:, i]`` (node 0, the root, is ignored).
        noise: the rows' public randomness.
        positions_BN: ``[B, N]``: the sequence position of the token node i's target row decides
            (``start + depth(i)``).

    When two children of a node carry the same token, the first in drawing order is followed (their
    target rows see the same prefix).
    """
    B, N, V = target_probs_BNV.shape
    device = target_probs_BNV.device
    if validate:
        check_tree_inputs(target_probs_BNV, tree, tokens_BN)
        validate_keyed_inputs(noise, positions_BN, target_probs_BNV)
    tokens_BN = tokens_BN.to(device=device, dtype=torch.long)
    if avoids_host(target_probs_BNV):
        return _gumbel_tree_fixed(target_probs_BNV, tree, tokens_BN, noise, positions_BN)
    kids_NC = tree.children_table(device)  # [N, max children], −1 padded
    A = tree.max_depth + 1
    out_tokens = torch.full((B, A), -1, dtype=torch.long, device=device)
    out_nodes = torch.full((B, A), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(B, dtype=torch.long, device=device)
    live_R = torch.arange(B, device=device)
    node_R = torch.zeros(B, dtype=torch.long, device=device)
    for depth in range(A):
        y_R = sample_keyed(
            target_probs_BNV[live_R, node_R],
            noise.select(live_R),
            positions_BN[live_R, node_R],
            validate=False,
        )
        out_tokens[live_R, depth] = y_R
        kids_RC = kids_NC[node_R]
        match_RC = (kids_RC >= 0) & (tokens_BN[live_R.unsqueeze(1), kids_RC.clamp(min=0)] == y_R.unsqueeze(1))
        go_R = match_RC.any(dim=1)
        num_accepted[live_R[~go_R]] = depth
        chosen_R = kids_RC.gather(1, match_RC.long().argmax(dim=1, keepdim=True)).squeeze(1)
        live_R, node_R = live_R[go_R], chosen_R[go_R]
        out_nodes[live_R, depth] = node_R
        if live_R.numel() == 0:
            break
    return TreeVerifyResult(out_tokens, num_accepted, out_nodes)


def _gumbel_tree_fixed(
    target_probs_BNV: torch.Tensor,
    tree: TokenTree,
    tokens_BN: torch.Tensor,
    noise: PositionNoise,
    positions_BN: torch.Tensor,
) -> TreeVerifyResult:
    """:func:`gumbel_verify_tree`'s walk with every row at every depth (:func:`tree_walk_fixed`: a
    stopped row stays put and its draws are dropped): the same tokens, no host read (on an accelerator)."""
    device = target_probs_BNV.device
    positions_BN = positions_BN.to(device=device, dtype=torch.long)

    def draw(rows_B: torch.Tensor, node_B: torch.Tensor) -> torch.Tensor:
        keys_B = noise.keys(positions_BN[rows_B, node_B], "sample", validate=False)
        return sample_with_keys(target_probs_BNV[rows_B, node_B], keys_B)

    return tree_walk_fixed(draw, tree, tokens_BN, target_probs_BNV.shape[0], device)


class GumbelVerify(Rule):
    """The ``gumbel`` verification rule: drafter-invariant, lossless (:func:`gumbel_verify`,
    :func:`gumbel_verify_tree`). Greedy runs are argmax matching (the keyed sample of a one-hot row is
    its argmax). No options."""

    name = "gumbel"
    drafter_invariant = True

    def chain(
        self,
        target_probs_BKV: torch.Tensor,
        draft_tokens_BK: torch.Tensor,
        draft_probs_BKV: torch.Tensor | None,
        **randomness: Any,
    ) -> VerifyResult:
        return gumbel_verify(target_probs_BKV, draft_tokens_BK, draft_probs_BKV, validate=False, **randomness)

    def tree(self, target_probs_BNV: torch.Tensor, proposal: TreeProposal, **kwargs: Any) -> TreeVerifyResult:
        return gumbel_verify_tree(target_probs_BNV, proposal.tree, proposal.tokens_BN, **kwargs)
