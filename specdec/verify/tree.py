"""Verification of token trees (:mod:`specdec.verify.token_tree`): exact multi-candidate rejection sampling.

Legend: B batch, N tree nodes (node 0 is the root: the last committed token), V vocabulary,
D hidden size, A accepted path length + 1.

SpecInfer (Miao et al. 2024, arXiv 2305.09781) verifies a whole tree of draft tokens in one target
call: each node attends to the committed prefix and its own ancestors (``TokenTree.ancestor_mask``)
at rope position ``start + depth``. Then, from the root, **multi-candidate recursive rejection
sampling** picks at most one child per node, so the committed tokens follow the target's
distribution exactly:

At a node with target distribution ``target_probs`` and children c_1..c_k (in the order they were
drawn from the draft distribution ``draft_probs``), for i = 1..k:

- **accept** c_i with probability min(1, target_probs_i(c_i) / draft_probs_i(c_i)) and descend;
- on rejection: ``target_probs_{i+1} = norm(max(target_probs_i − draft_probs_i, 0))``.

If every child is rejected, the **recovered** token is drawn from the last residual; at a leaf
(all accepted along the path) the **bonus** token is drawn from the target at that leaf.

How the candidates were drawn decides ``draft_probs_i``:

- ``replacement=True`` (SpecInfer, i.i.d. children): ``draft_probs_i = draft_probs`` for every i;
- ``replacement=False`` (children drawn *without* replacement, e.g. Gumbel-top-k; the recursive
  rejection sampling of Jeon et al. 2024, "Recursive Speculative Decoding", arXiv 2402.14160):
  ``draft_probs_{i+1} = norm(draft_probs_i with c_i removed)``. Proof sketch: by induction from
  the last candidate, the output given "reached candidate i" is distributed as
  ``target_probs_i``, because ``target_probs_{i+1}`` does not depend on c_i (only on earlier
  candidates) and min(q, p) + max(p − q, 0) = p;
- ``draft_probs=None``: deterministic candidates (e.g. greedy top-k): point masses, so c_i is
  accepted with probability ``target_probs_i(c_i)`` and the residual is the target without c_i.

Greedy (temperature 0) is the same rule with one-hot targets: it takes the longest path whose
tokens equal the target's argmax (:func:`tree_greedy_verify` is the fast path).

The tree's shape must be fixed before its tokens are drawn (it may differ between steps, never
depend on the drawn tokens of the node being verified): otherwise "c_i ~ draft_probs_i" is false.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from specdec.host_sync import avoids_host
from specdec.verify.noise import PositionNoise, sample_keyed, sample_with_keys
from specdec.verify.token_tree import TokenTree

__all__ = [
    "TreeVerifyResult",
    "tree_walk_fixed",
    "check_tree_inputs",
    "tree_rejection_sample",
    "tree_greedy_verify",
    "tree_greedy_walk",
]


class TreeVerifyResult(NamedTuple):
    """``tokens [B, A]``: the accepted path's tokens, then one recovered or bonus token, then −1.
    ``num_accepted [B]``; ``path_nodes [B, A]``: the tree node of each accepted token (−1 after)."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    path_nodes: torch.Tensor


def _normalise_rows(x_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows divided by their sums, and which rows had positive mass (others are returned as is)."""
    s_B1 = x_BV.sum(dim=-1, keepdim=True)
    ok_B1 = s_B1 > 0
    return torch.where(ok_B1, x_BV / torch.where(ok_B1, s_B1, torch.ones_like(s_B1)), x_BV), ok_B1.squeeze(-1)


def check_tree_inputs(
    target_BNV: torch.Tensor,
    tree: TokenTree,
    tokens_BN: torch.Tensor,
    draft_probs_BNV: torch.Tensor | None = None,
    *,
    probabilities: bool = True,
) -> None:
    """``ValueError`` unless ``target_BNV`` is ``[B, N, V]`` for the tree's N nodes, ``tokens_BN``
    ``[B, N]`` in ``[0, V)`` (node 0 aside) and ``draft_probs_BNV`` None or ``[B, N, V]``; with
    ``probabilities`` (not logits), also unless both are non-negative and free of NaN."""
    N = tree.num_nodes
    if (
        target_BNV.ndim != 3
        or target_BNV.shape[1] != N
        or tuple(tokens_BN.shape) != tuple(target_BNV.shape[:2])
    ):
        raise ValueError(
            f"tree has {N} nodes: the target tensor must be [B, {N}, V] and tokens_BN [B, {N}], got "
            f"{tuple(target_BNV.shape)}, {tuple(tokens_BN.shape)}"
        )
    if draft_probs_BNV is not None and draft_probs_BNV.shape != target_BNV.shape:
        raise ValueError(
            f"draft_probs_BNV must be [B, N, V]={tuple(target_BNV.shape)}, got {tuple(draft_probs_BNV.shape)}"
        )
    V = target_BNV.shape[-1]
    if tokens_BN[:, 1:].numel() and (int(tokens_BN[:, 1:].min()) < 0 or int(tokens_BN[:, 1:].max()) >= V):
        raise ValueError(f"tokens_BN must lie in [0, V={V})")
    for name, probs in (("target_probs_BNV", target_BNV), ("draft_probs_BNV", draft_probs_BNV)):
        if probabilities and probs is not None and (torch.isnan(probs).any() or (probs < 0).any()):
            raise ValueError(f"{name} must be non-negative and free of NaN")


_KEYS_PER_ROOT = 1 << 16
"""Keys of the ``"tree"`` stream per root position: a tree has fewer nodes."""


def tree_rejection_sample(
    target_probs_BNV: torch.Tensor,
    tree: TokenTree,
    tokens_BN: torch.Tensor,
    draft_probs_BNV: torch.Tensor | None = None,
    *,
    replacement: bool = False,
    noise: PositionNoise | None = None,
    positions_BN: torch.Tensor | None = None,
    draft_scale: float = 1.0,
    validate: bool = True,
) -> TreeVerifyResult:
    """Multi-candidate recursive rejection sampling down a token tree (see the module docstring).

    Args:
        target_probs_BNV: the target's processed distribution *after* each node (``[B, N, V]``).
        tree: the shape; node i's token is ``tokens_BN[:, i]`` (node 0's is ignored).
        draft_probs_BNV: per node, the distribution its children were drawn from, or None
            (deterministic candidates).
        replacement: children drawn i.i.d. (SpecInfer) or without replacement (RSD).
        noise, positions_BN: the rows' keyed randomness (:mod:`specdec.verify.noise`): node i of row b
            decides sequence position ``positions_BN[b, i]``. Node i's acceptance uniform is
            keyed by the root's position and i (stream ``"tree"``; each step's root position is new),
            the recovered or bonus token by the position it fills (stream ``"residual"``), so a row's
            tokens depend on its own seed only.
        draft_scale: the acceptance hook l: the draft measure is scaled by l, so that c_i is accepted
            with probability min(1, r(c_i) / (l · draft_i(c_i))) and a rejection leaves
            norm(max(r − l · draft_i, 0)); 1 is exact (``lenient``: :mod:`specdec.verify.lenient`).

    Rows advance in lock step, one tree depth at a time, trying their current node's candidates in
    order. On an accelerator (:func:`specdec.host_sync.avoids_host`) the walk has a
    fixed shape: no early exit once every row has stopped, and the recovered or bonus token drawn
    for every row at every depth and kept where a row stops (the same tokens: a row's keyed draw
    reads only its own weights and key), so it never reads the host.

    Implements SpecInfer (arXiv 2305.09781) multi-step speculative sampling; the
    without-replacement residual follows Recursive Speculative Decoding (arXiv 2402.14160).
    """
    B, N, V = target_probs_BNV.shape
    device = target_probs_BNV.device
    if validate:
        check_tree_inputs(target_probs_BNV, tree, tokens_BN, draft_probs_BNV)
    work = torch.float64 if target_probs_BNV.dtype == torch.float64 else torch.float32
    tokens_BN = tokens_BN.to(device=device, dtype=torch.long)
    kids_NC = tree.children_table(device)  # [N, max children], −1 padded
    rows_B = torch.arange(B, device=device)
    A = tree.max_depth + 1
    out_tokens = torch.full((B, A), -1, dtype=torch.long, device=device)
    out_nodes = torch.full((B, A), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(B, dtype=torch.long, device=device)
    # One uniform per node (each node is a candidate of exactly one parent), drawn up front.
    if noise is None or not isinstance(positions_BN, torch.Tensor) or tuple(positions_BN.shape) != (B, N):
        raise ValueError(f"tree rejection sampling needs noise= and positions_BN= of shape [{B}, {N}]")
    positions_BN = positions_BN.to(device=device, dtype=torch.long)
    keys_BN = positions_BN[:, :1] * _KEYS_PER_ROOT + torch.arange(N, device=device)
    u_BN = noise.uniform_BK(keys_BN, "tree", dtype=work, validate=validate)
    node_B = torch.zeros(B, dtype=torch.long, device=device)
    live_B = torch.ones(B, dtype=torch.bool, device=device)
    fixed = avoids_host(target_probs_BNV)  # no host read (docstring)
    for depth in range(A):
        target_BV = target_probs_BNV[rows_B, node_B].to(work)
        draft_BV = None if draft_probs_BNV is None else draft_probs_BNV[rows_B, node_B].to(work)
        chosen_B = torch.full((B,), -1, dtype=torch.long, device=device)
        for i in range(kids_NC.shape[1]):
            c_B = kids_NC[node_B, i]
            trying_B = live_B & (c_B >= 0) & (chosen_B < 0)
            if not fixed and not bool(trying_B.any()):
                break
            c_B = c_B.clamp(min=0)
            x_B1 = tokens_BN[rows_B, c_B].unsqueeze(1)
            p_x_B = target_BV.gather(1, x_B1).squeeze(1)
            q_x_B = torch.ones_like(p_x_B) if draft_BV is None else draft_BV.gather(1, x_B1).squeeze(1)
            # u < p/(l·q)  <=>  u·l·q < p: accepted with probability min(1, p/(l·q)); q(x) = 0 is rejected.
            accept_B = trying_B & (q_x_B > 0) & (u_BN[rows_B, c_B] * (draft_scale * q_x_B) < p_x_B)
            chosen_B = torch.where(accept_B, c_B, chosen_B)
            reject_B1 = (trying_B & ~accept_B).unsqueeze(1)
            if draft_BV is None:  # point mass: a rejected x had p(x) < l, so the residual is p without x
                residual_BV = target_BV.scatter(1, x_B1, 0.0)
            else:
                residual_BV = (target_BV - draft_scale * draft_BV).clamp_(min=0.0)
            residual_BV, ok_B = _normalise_rows(residual_BV)
            # Zero residual mass needs target ≤ draft everywhere (target == draft, accepted surely):
            # only rounding gets there; such rows keep their current target.
            target_BV = torch.where(reject_B1 & ok_B.unsqueeze(1), residual_BV, target_BV)
            if draft_BV is not None and not replacement:
                # Without replacement the next candidate comes from the draft without x; an
                # exhausted draft (more candidates than its support) proposes nothing more.
                removed_BV, _ = _normalise_rows(draft_BV.scatter(1, x_B1, 0.0))
                draft_BV = torch.where(reject_B1, removed_BV, draft_BV)
        finish_B = live_B & (chosen_B < 0)
        if fixed:
            keys_B = noise.keys(positions_BN[rows_B, node_B], "residual", validate=False)
            final_B = sample_with_keys(target_BV.float(), keys_B)
            out_tokens[:, depth] = torch.where(finish_B, final_B, out_tokens[:, depth])
            num_accepted = torch.where(finish_B, depth, num_accepted)
        elif bool(finish_B.any()):
            # Recovered token (all candidates rejected) or bonus token (a leaf).
            at_B = finish_B.nonzero().flatten()
            final_B = sample_keyed(
                target_BV[finish_B].float(),
                noise.select(at_B),
                positions_BN[at_B, node_B[at_B]],
                stream="residual",
            )
            out_tokens[finish_B, depth] = final_B
            num_accepted[finish_B] = depth
        go_B = live_B & (chosen_B >= 0)
        out_tokens[:, depth] = torch.where(
            go_B, tokens_BN[rows_B, chosen_B.clamp(min=0)], out_tokens[:, depth]
        )
        out_nodes[:, depth] = torch.where(go_B, chosen_B, out_nodes[:, depth])
        node_B = torch.where(go_B, chosen_B, node_B)
        live_B = go_B
        if not fixed and not bool(live_B.any()):
            break
    return TreeVerifyResult(out_tokens, num_accepted, out_nodes)


def tree_greedy_verify(
    target_argmax_BN: torch.Tensor, tree: TokenTree, tokens_BN: torch.Tensor
) -> TreeVerifyResult:
    """Greedy verification: follow children equal to the target's argmax; the longest matching
    path, then the argmax after it (the bonus/recovered token).

    A walk on the host (the reference); on an accelerator (:func:`specdec.host_sync.avoids_host`)
    the same walk in fixed-shape tensor ops there (:func:`tree_greedy_walk`), without a host read."""
    if avoids_host(target_argmax_BN):
        return tree_greedy_walk(target_argmax_BN, tree, tokens_BN)
    target_argmax_BN, tokens_BN = target_argmax_BN.cpu(), tokens_BN.cpu()
    B, N = target_argmax_BN.shape
    A = tree.max_depth + 1
    out_tokens = torch.full((B, A), -1, dtype=torch.long)
    out_nodes = torch.full((B, A), -1, dtype=torch.long)
    num_accepted = torch.zeros(B, dtype=torch.long)
    argmax, tokens = target_argmax_BN.tolist(), tokens_BN.tolist()
    for b in range(B):
        node, depth = 0, 0
        while True:
            want = argmax[b][node]
            nxt = next((c for c in tree.children[node] if tokens[b][c] == want), None)
            out_tokens[b, depth] = want
            if nxt is None:
                num_accepted[b] = depth
                break
            out_nodes[b, depth] = nxt
            node, depth = nxt, depth + 1
    return TreeVerifyResult(out_tokens, num_accepted, out_nodes)


def tree_walk_fixed(
    choose: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    tree: TokenTree,
    tokens_BN: torch.Tensor,
    B: int,
    device: torch.device,
) -> TreeVerifyResult:
    """A tree walk in tensor ops on ``device``: every row one depth at a time for the tree's whole
    depth (a row that has stopped stays put and its choices are dropped), so there is no host read.
    ``choose(rows_B, node_B)`` gives each row's token at its node (the target's argmax, or a keyed
    draw); the first child in candidate order holding it is followed, as in the host walks."""
    A = tree.max_depth + 1
    tokens_BN = tokens_BN.to(device=device, dtype=torch.long)
    kids_NC = tree.children_table(device)
    rows_B = torch.arange(B, device=device)
    out_tokens = torch.full((B, A), -1, dtype=torch.long, device=device)
    out_nodes = torch.full((B, A), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(B, dtype=torch.long, device=device)
    node_B = torch.zeros(B, dtype=torch.long, device=device)
    live_B = torch.ones(B, dtype=torch.bool, device=device)
    for depth in range(A):
        want_B = choose(rows_B, node_B)
        out_tokens[:, depth] = torch.where(live_B, want_B, out_tokens[:, depth])
        kids_BC = kids_NC[node_B]
        match_BC = (kids_BC >= 0) & (tokens_BN.gather(1, kids_BC.clamp(min=0)) == want_B[:, None])
        go_B = live_B & match_BC.any(dim=1)
        num_accepted = torch.where(live_B & ~go_B, depth, num_accepted)
        next_B = kids_BC.gather(1, match_BC.long().argmax(dim=1, keepdim=True)).squeeze(1)
        out_nodes[:, depth] = torch.where(go_B, next_B, out_nodes[:, depth])
        node_B = torch.where(go_B, next_B, node_B)
        live_B = go_B
    return TreeVerifyResult(out_tokens, num_accepted, out_nodes)


def tree_greedy_walk(
    target_argmax_BN: torch.Tensor, tree: TokenTree, tokens_BN: torch.Tensor
) -> TreeVerifyResult:
    """:func:`tree_greedy_verify`'s walk on the argmax's device (:func:`tree_walk_fixed`): no host read."""
    return tree_walk_fixed(
        lambda rows_B, node_B: target_argmax_BN[rows_B, node_B],
        tree,
        tokens_BN,
        target_argmax_BN.shape[0],
        target_argmax_BN.device,
    )
