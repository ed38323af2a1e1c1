"""EAGLE tree drafting: several candidates per position, verified in one target call.

Legend: B batch, N tree nodes (node 0 = root), P expanded nodes at one depth, D hidden size,
V target vocabulary, K main-path length.

The draft head (:mod:`specdec.drafters.eagle.model`) expands a fixed-shape token tree depth by depth
(EAGLE, arXiv 2401.15077, §4.2): at each depth, every node that has children scores its draft
distribution from its predicted feature, picks its children, and all new nodes that have children
of their own run through the head in one call with *tree attention* in the head's cache (a node
sees the committed prefix and its ancestors). The target then verifies the whole tree in one call
(SpecInfer, arXiv 2305.09781; ``specdec.verify.tree``).

How children are picked:

- greedy (temperature 0): the head's top-k tokens (distinct), verified by longest argmax match;
- sampling: k tokens drawn *without replacement* from the draft distribution (Gumbel-top-k), which
  the verifier undoes with the without-replacement recursive residual (arXiv 2402.14160), so the
  output is exactly the target's distribution.

The tree's shape never depends on the drawn tokens (a requirement of exact verification); it is
cut to depth ≤ γ (so γ-choosing policies still work) and to the cache room left. The exception is
greedy decoding of one row, where any tree is exact: there the default is EAGLE-2's dynamic tree
(Li et al. 2024, arXiv 2406.16858), which keeps the nodes with the highest cumulative draft
probability.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specdec.drafters.confidence import check_min_prob
from specdec.drafters.eagle.chain import DEFAULT_MAX_QUEUED, EagleDrafter
from specdec.drafters.eagle.packed import PackedEagleHead
from specdec.protocols import DecodeState, Proposal, TreeTarget
from specdec.sampling import sampling_probs
from specdec.verify.token_tree import PRESET_TREES, TokenTree, TreeProposal

__all__ = ["EagleTreeDrafter", "resolve_tree"]


def resolve_tree(tree: str | TokenTree | Sequence[Sequence[int]]) -> TokenTree:
    """A preset name (see ``specdec.verify.token_tree.PRESET_TREES``), a :class:`TokenTree` or rank paths."""
    if isinstance(tree, TokenTree):
        return tree
    if isinstance(tree, str):
        if tree not in PRESET_TREES:
            raise ValueError(f"unknown tree preset {tree!r}; known: {', '.join(PRESET_TREES)}")
        return TokenTree.from_paths(PRESET_TREES[tree])
    return TokenTree.from_paths(tree)


class EagleTreeDrafter(EagleDrafter):
    """EAGLE with tree drafts (registered as ``eagle-tree``).

    Args:
        target: a :class:`~specdec.protocols.TreeTarget` that is also a
            :class:`~specdec.protocols.FeatureTarget` (the native Llama target).
        tree: ``"dynamic"`` (default: EAGLE-2's dynamic tree for greedy single-row runs, the static
            ``"small"`` preset otherwise), a preset name (``specdec.verify.token_tree.PRESET_TREES``), a
            :class:`specdec.verify.token_tree.TokenTree` or rank paths.
        tree_nodes, tree_width: the dynamic tree's draft nodes (at most) and its beam width per depth.
        tree_min_prob: the dynamic tree keeps only nodes whose cumulative draft probability (the
            head's estimate that the target accepts the node) is at least this, and stops expanding
            once no frontier node reaches it: a node costs verify time whether accepted or not, so
            unlikely ones are dropped (0 keeps ``tree_nodes`` nodes, as EAGLE-2 does).
        weights, draft_vocab_size, dtype, linear_backend, weight_dtype, head, max_queued: as for
            :class:`specdec.drafters.eagle.EagleDrafter` (the catch-up is lazy here too).
    """

    def __init__(
        self,
        target: Any,
        *,
        tree: str | TokenTree | Sequence[Sequence[int]] = "dynamic",
        tree_nodes: int = 11,
        tree_width: int = 4,
        tree_min_prob: float = 0.0,
        weights: str | Path | None = None,
        draft_vocab_size: int | None = None,
        dtype: torch.dtype = torch.float32,
        linear_backend: str = "auto",
        weight_dtype: torch.dtype | str | None = None,
        head: PackedEagleHead | str | Path | None = None,
        max_queued: int = DEFAULT_MAX_QUEUED,
    ) -> None:
        if not isinstance(target, TreeTarget):
            raise ValueError(
                f"eagle-tree needs a target with tree attention and copy_slots (the native Llama target, "
                f"backend 'llama'); got {type(target).__name__}. Use the chain drafter 'eagle' instead."
            )
        super().__init__(
            target,
            weights=weights,
            draft_vocab_size=draft_vocab_size,
            dtype=dtype,
            linear_backend=linear_backend,
            weight_dtype=weight_dtype,
            head=head,
            max_queued=max_queued,
        )
        self.dynamic = tree == "dynamic"
        self.tree = resolve_tree("small" if self.dynamic else tree)
        if tree_nodes < 1 or tree_width < 1:
            raise ValueError(f"tree_nodes and tree_width must be >= 1, got {tree_nodes}, {tree_width}")
        self.tree_nodes, self.tree_width = tree_nodes, tree_width
        self.tree_min_prob = check_min_prob(tree_min_prob, "tree_min_prob")

    @torch.inference_mode()
    def propose(self, state: DecodeState, gamma: int, generator: torch.Generator | None = None) -> Proposal:
        """Draft a tree (depth ≤ ``gamma``); the proposal's chain is its first-candidate path."""
        self._check_propose(gamma)
        room = int(state.tokens_BL.shape[1] - (state.lengths_B.max() - 1))
        tree = self.tree.truncate(gamma, room) if gamma > 0 else None
        if tree is None or tree.num_nodes == 1:  # a plain step: the committed tokens stay queued
            return Proposal(torch.zeros(state.batch_size, 0, dtype=torch.long, device=self.head.device), None)
        feat_BD = self.catch_up(state)
        B, D = feat_BD.shape
        device = feat_BD.device
        last_B = state.last_tokens_B().to(device)  # the root's token: each node's x_t is its parent's
        if self.dynamic and B == 1 and state.sampling.greedy:
            return self._propose_dynamic(
                feat_BD, min(gamma, room - 1), min(self.tree_nodes, room - 1), int(last_B[0])
            )
        N, head, sampling = tree.num_nodes, self.head, state.sampling
        feat_BND = feat_BD.new_zeros(B, N, D)
        feat_BND[:, 0] = feat_BD
        tokens_BN = torch.zeros(B, N, dtype=torch.long, device=device)
        tokens_BN[:, 0] = last_B
        draft_probs_BNV = None if sampling.greedy else torch.zeros(B, N, self.vocab_size, device=device)
        base_B = self.cache_len_B  # node i (≥ 1) sits at head-cache slot base + i − 1
        ancestors_NN = tree.ancestor_mask(device)
        for d in range(tree.max_depth):
            parents = [m for m in tree.nodes_at_depth(d) if tree.children[m]]
            logits_BPN = self.logits(feat_BND[:, parents], d + 1)
            for j, m in enumerate(parents):
                kids = list(tree.children[m])
                tokens_BN[:, kids] = self._pick(
                    logits_BPN[:, j], len(kids), draft_probs_BNV, m, sampling, generator
                )
            expand = [c for c in tree.nodes_at_depth(d + 1) if tree.children[c]]
            if not expand:
                continue
            idx_P = torch.tensor(expand, device=device)
            parent_P = torch.tensor([tree.parents[c] for c in expand], device=device)
            slots_BP = base_B.unsqueeze(1) + idx_P - 1
            positions_BP = base_B.unsqueeze(1) + d  # = base − 1 + depth(c), depth(c) = d + 1
            L = int(slots_BP.max()) + 1
            node_BL = torch.arange(L, device=device) - base_B.unsqueeze(1) + 1  # slot → node index
            in_tree_BL = (node_BL >= 1) & (node_BL < N)
            visible_BPL = (node_BL < 1).unsqueeze(1) | (
                in_tree_BL.unsqueeze(1) & ancestors_NN[idx_P][:, node_BL.clamp(0, N - 1)].transpose(0, 1)
            )
            out_BPD = self.cache.step(
                head,
                feat_BND[:, parent_P],
                tokens_BN[:, idx_P],
                slots_BP,
                positions_BP,
                visible_BPL,
                tokens_BN[:, parent_P],
            )
            feat_BND[:, idx_P] = out_BPD
        main = list(tree.main_path)
        main_parents = [tree.parents[c] for c in main]
        probs_BKV = None if draft_probs_BNV is None else draft_probs_BNV[:, main_parents]
        return Proposal(
            tokens_BN[:, main],
            probs_BKV,
            tree=TreeProposal(tree, tokens_BN, draft_probs_BNV, replacement=False),
        )

    def _pick(self, logits_BN, k, draft_probs_BNV, node, sampling, generator) -> torch.Tensor:
        """``k`` children of ``node``: top-k when greedy, else Gumbel-top-k (without replacement)."""
        vocab = self.head.draft_vocab_N
        if sampling.greedy:
            return vocab[logits_BN.topk(k, dim=-1).indices]
        probs_BN = sampling_probs(logits_BN, sampling)
        draft_probs_BNV[:, node].index_copy_(-1, vocab, probs_BN)
        u = torch.rand(probs_BN.shape, generator=generator, device=probs_BN.device).clamp_(1e-20, 1 - 1e-7)
        keys = probs_BN.log() - (-u.log()).log()  # log q + Gumbel(0, 1); −inf where q = 0
        return vocab[keys.topk(k, dim=-1).indices]

    def _propose_dynamic(
        self, feat_BD: torch.Tensor, depth: int, num_nodes: int, last_token: int
    ) -> Proposal:
        """EAGLE-2 dynamic tree (Li et al. 2024, arXiv 2406.16858), greedy and one row: expand the
        ``tree_width`` best nodes per depth by cumulative draft log-probability, then keep the
        ``tree_nodes`` best nodes overall, none below ``tree_min_prob``. (Greedy verification is
        exact for any tree; with sampling the shape must not depend on the drawn tokens, so sampling
        uses the static tree.)"""
        head, device, W = self.head, feat_BD.device, self.tree_width
        min_logp = math.log(self.tree_min_prob) if self.tree_min_prob > 0 else -math.inf
        base = int(self.cache_len_B[0])  # expanded node e sits at head-cache slot base + e
        parent, token, score, node_depth = [-1], [last_token], [0.0], [0]  # the root: the last token
        slot_of: dict[int, int] = {}  # node → head-cache slot (expanded nodes only)
        feats = {0: feat_BD[0]}
        frontier = [0]
        for d in range(depth):
            logp_PN = torch.log_softmax(self.logits(torch.stack([feats[n] for n in frontier]), d + 1), dim=-1)
            top = logp_PN.topk(W, dim=-1)
            new = []
            for i, n in enumerate(frontier):
                for lp, idx in zip(top.values[i].tolist(), top.indices[i].tolist(), strict=True):
                    parent.append(n)
                    token.append(int(head.draft_vocab_N[idx]))
                    score.append(score[n] + lp)
                    node_depth.append(d + 1)
                    new.append(len(parent) - 1)
            if d + 1 == depth:
                break
            frontier = [c for c in sorted(new, key=lambda c: -score[c])[:W] if score[c] >= min_logp]
            if not frontier:
                break  # no child of these can reach tree_min_prob
            # Features of the new frontier: one head call with tree attention in the head's cache.
            for c in frontier:
                slot_of[c] = base + len(slot_of)
            L = base + len(slot_of)
            visible_PL = torch.zeros(len(frontier), L, dtype=torch.bool, device=device)
            visible_PL[:, :base] = True
            for i, c in enumerate(frontier):
                a = c
                while a > 0:
                    visible_PL[i, slot_of[a]] = True
                    a = parent[a]
            slots = torch.tensor([[slot_of[c] for c in frontier]], device=device)
            positions = torch.full_like(slots, base + d)  # = base − 1 + depth, depth = d + 1
            out = self.cache.step(
                head,
                torch.stack([feats[parent[c]] for c in frontier]).unsqueeze(0),
                torch.tensor([[token[c] for c in frontier]], device=device),
                slots,
                positions,
                visible_PL.unsqueeze(0),
                torch.tensor([[token[parent[c]] for c in frontier]], device=device),
            )
            for i, c in enumerate(frontier):
                feats[c] = out[0, i]
        # The best nodes overall; a child never scores above its parent, so (−score, depth) order
        # keeps every chosen node's parent chosen before it.
        ranked = sorted(range(1, len(parent)), key=lambda c: (-score[c], node_depth[c]))[:num_nodes]
        chosen = [c for c in ranked if score[c] >= min_logp] or ranked[:1]
        chosen.sort(key=lambda c: (node_depth[c], -score[c]))
        index = {0: 0, **{c: i + 1 for i, c in enumerate(chosen)}}
        tree = TokenTree((-1, *(index[parent[c]] for c in chosen)))
        tokens_1N = torch.tensor([[token[c] for c in (0, *chosen)]], device=device)
        main = list(tree.main_path)  # children are in score order: the first is the best
        return Proposal(tokens_1N[:, main], None, tree=TreeProposal(tree, tokens_1N, None))
