"""EAGLE tree drafting: several candidates per position, verified in one target call.

Legend: B batch, N tree nodes (node 0 = root), P expanded nodes at one depth, D hidden size,
V target vocabulary, K main-path length.

:class:`EagleTrees` drafts one engine row's tree on that row's slot of the
:class:`~specdec.drafters.eagle.EagleDrafter`'s head cache (the tree's nodes land past the row's
length: slots never visible to its later steps). The draft head (:mod:`specdec.drafters.eagle.model`)
expands a fixed-shape token tree depth by depth
(EAGLE, arXiv 2401.15077, §4.2): at each depth, every node that has children scores its draft
distribution from its predicted feature, picks its children, and all new nodes that have children
of their own run through the head in one call with *tree attention* in the head's cache (a node
sees the committed prefix and its ancestors). The target then verifies the whole tree in one call
(SpecInfer, arXiv 2305.09781; ``specdec.verify.tree``).

How children are picked:

- greedy (temperature 0): the head's top-k tokens (distinct), verified by longest argmax match;
- sampling: k tokens drawn *without replacement* from the draft distribution (Gumbel-top-k, the
  Gumbel noise keyed by the row's seed, the tree's first draft position and the node: stream
  ``"draft_tree"``, :data:`KEYS_PER_TREE` keys per position), which the verifier undoes with the
  without-replacement recursive residual (arXiv 2402.14160), so the output is exactly the target's
  distribution.

The tree's shape never depends on the drawn tokens (a requirement of exact verification); it is
cut to depth ≤ γ (so γ-choosing policies still work) and to the cache room left. The exception is
greedy decoding of one row, where any tree is exact: there the default is EAGLE-2's dynamic tree
(Li et al. 2024, arXiv 2406.16858), which keeps the nodes with the highest cumulative draft
probability.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdec.drafters.confidence import check_min_prob
from specdec.protocols import DecodeState, Proposal
from specdec.sampling import SamplingParams, sampling_probs
from specdec.verify.noise import PositionNoise
from specdec.verify.token_tree import PRESET_TREES, TokenTree, TreeProposal

if TYPE_CHECKING:
    from specdec.drafters.eagle.drafter import EagleDrafter

__all__ = ["EagleTrees", "KEYS_PER_TREE", "resolve_tree"]

KEYS_PER_TREE = 1 << 12
"""Keys of the ``"draft_tree"`` stream per tree (its first draft position): one per node, so a static
tree has fewer nodes."""


def resolve_tree(tree: str | TokenTree | Sequence[Sequence[int]]) -> TokenTree:
    """A preset name (see ``specdec.verify.token_tree.PRESET_TREES``), a :class:`TokenTree` or rank paths."""
    if isinstance(tree, TokenTree):
        return tree
    if isinstance(tree, str):
        if tree not in PRESET_TREES:
            raise ValueError(f"unknown tree preset {tree!r}; known: {', '.join(PRESET_TREES)}")
        return TokenTree.from_paths(PRESET_TREES[tree])
    return TokenTree.from_paths(tree)


class EagleTrees:
    """How the EAGLE drafter drafts a row's token tree (see the module doc).

    Args:
        tree: ``"dynamic"`` (default: EAGLE-2's dynamic tree for greedy rows, the static ``"small"``
            preset for sampled ones), a preset name (``specdec.verify.token_tree.PRESET_TREES``), a
            :class:`specdec.verify.token_tree.TokenTree` or rank paths.
        tree_nodes, tree_width: the dynamic tree's draft nodes (at most) and its beam width per depth.
        tree_min_prob: the dynamic tree keeps only nodes whose cumulative draft probability (the
            head's estimate that the target accepts the node) is at least this, and stops expanding
            once no frontier node reaches it: a node costs verify time whether accepted or not, so
            unlikely ones are dropped (0 keeps ``tree_nodes`` nodes, as EAGLE-2 does).
    """

    def __init__(
        self,
        tree: str | TokenTree | Sequence[Sequence[int]] = "dynamic",
        tree_nodes: int = 11,
        tree_width: int = 4,
        tree_min_prob: float = 0.0,
    ) -> None:
        self.dynamic = tree == "dynamic"
        self.tree = resolve_tree("small" if self.dynamic else tree)
        for name, value in (("tree_nodes", tree_nodes), ("tree_width", tree_width)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.tree_nodes, self.tree_width = tree_nodes, tree_width
        self.tree_min_prob = check_min_prob(tree_min_prob, "tree_min_prob")

    @torch.inference_mode()
    def draft(
        self,
        eagle: EagleDrafter,
        slot: int,
        depth: int,
        state: DecodeState,
        params: SamplingParams,
        noise: PositionNoise | None,
    ) -> Proposal:
        """Row ``slot``'s tree of depth ≤ ``depth`` (after its catch-up: ``eagle.catch_up``), as a
        one-row :class:`Proposal` whose chain is the tree's first-candidate path; an empty chain where
        no tree fits. ``state``: the row alone; ``noise``: its seed (sampled rows)."""
        device = eagle.head.device
        room = int(state.tokens_BL.shape[1] - (state.lengths_B.max() - 1))
        tree = self.tree.truncate(depth, room) if depth > 0 else None
        if tree is not None and tree.num_nodes > KEYS_PER_TREE:
            raise ValueError(f"tree: at most {KEYS_PER_TREE} nodes, got {tree.num_nodes}")
        if tree is None or tree.num_nodes == 1:
            return Proposal(torch.zeros(1, 0, dtype=torch.long, device=device), None)
        base = eagle.cache_len[slot]  # node i (≥ 1) sits at head-cache slot base + i − 1
        eagle.cache.ensure(base + depth * self.tree_width + max(self.tree_nodes, tree.num_nodes) + 2)
        cache = eagle.cache.row(slot)  # the slot's row of the shared cache, written in place
        feat_1D = eagle.next_feat_SD[slot : slot + 1]
        last = int(state.last_tokens_B()[0])  # the root's token: each node's x_t is its parent's
        if self.dynamic and params.greedy:
            return self._dynamic(
                eagle, cache, base, feat_1D, min(depth, room - 1), min(self.tree_nodes, room - 1), last
            )
        if not params.greedy and noise is None:
            raise ValueError("noise: a sampled row's tree needs its PositionNoise")
        position = int(state.lengths_B[0] - state.prompt_lengths_B[0])  # output position of depth 1
        return self._static(eagle, cache, base, tree, feat_1D, last, params, noise, position)

    def _static(self, eagle, cache, base, tree, feat_1D, last, params, noise, position) -> Proposal:
        """A fixed-shape tree (its shape never depends on the drawn tokens)."""
        device, head = feat_1D.device, eagle.head
        N, D = tree.num_nodes, feat_1D.shape[1]
        feat_1ND = feat_1D.new_zeros(1, N, D)
        feat_1ND[:, 0] = feat_1D
        tokens_1N = torch.zeros(1, N, dtype=torch.long, device=device)
        tokens_1N[:, 0] = last
        draft_probs_1NV = None if params.greedy else torch.zeros(1, N, eagle.vocab_size, device=device)
        ancestors_NN = tree.ancestor_mask(device)
        for d in range(tree.max_depth):
            parents = [m for m in tree.nodes_at_depth(d) if tree.children[m]]
            logits_PN = eagle.logits(feat_1ND[0, parents], d + 1)
            for j, m in enumerate(parents):
                kids = list(tree.children[m])
                tokens_1N[0, kids] = self._pick(
                    eagle,
                    logits_PN[j],
                    len(kids),
                    draft_probs_1NV,
                    m,
                    params,
                    noise,
                    position * KEYS_PER_TREE + m,
                )
            expand = [c for c in tree.nodes_at_depth(d + 1) if tree.children[c]]
            if not expand:
                continue
            idx_P = torch.tensor(expand, device=device)
            parent_P = torch.tensor([tree.parents[c] for c in expand], device=device)
            slots_1P = base + idx_P.unsqueeze(0) - 1
            positions_1P = torch.full_like(slots_1P, base + d)  # = base − 1 + depth(c), depth(c) = d + 1
            L = int(slots_1P.max()) + 1
            node_L = torch.arange(L, device=device) - base + 1  # slot → node index
            in_tree_L = (node_L >= 1) & (node_L < N)
            visible_PL = (node_L < 1).unsqueeze(0) | (
                in_tree_L.unsqueeze(0) & ancestors_NN[idx_P][:, node_L.clamp(0, N - 1)]
            )
            feat_1ND[:, idx_P] = cache.step(
                head,
                feat_1ND[:, parent_P],
                tokens_1N[:, idx_P],
                slots_1P,
                positions_1P,
                visible_PL.unsqueeze(0),
                tokens_1N[:, parent_P],
            )
        main = list(tree.main_path)
        main_parents = [tree.parents[c] for c in main]
        probs_1KV = None if draft_probs_1NV is None else draft_probs_1NV[:, main_parents]
        return Proposal(
            tokens_1N[:, main],
            probs_1KV,
            tree=TreeProposal(tree, tokens_1N, draft_probs_1NV, replacement=False),
        )

    def _pick(self, eagle, logits_N, k, draft_probs_1NV, node, params, noise, key) -> torch.Tensor:
        """``k`` children of ``node``: top-k when greedy, else Gumbel-top-k (without replacement), the
        Gumbel noise keyed by the row's seed and ``key`` (the tree's first draft position and the node)."""
        vocab = eagle.head.draft_vocab_N
        if params.greedy:
            return vocab[logits_N.topk(k).indices]
        probs_N = sampling_probs(logits_N[None], params)[0]
        draft_probs_1NV[0, node].index_copy_(-1, vocab, probs_N)
        gumbel_N = noise.gumbel_BKV(torch.tensor([key]), probs_N.shape[0], "draft_tree")[0]
        keys = probs_N.log() + gumbel_N.to(probs_N.device)  # log q + Gumbel(0, 1); −inf where q = 0
        return vocab[keys.topk(k).indices]

    def _dynamic(
        self, eagle, cache, base: int, feat_1D: torch.Tensor, depth: int, num_nodes: int, last_token: int
    ) -> Proposal:
        """EAGLE-2 dynamic tree (Li et al. 2024, arXiv 2406.16858), greedy: expand the ``tree_width``
        best nodes per depth by cumulative draft log-probability, then keep the ``tree_nodes`` best
        nodes overall, none below ``tree_min_prob``. (Greedy verification is exact for any tree; with
        sampling the shape must not depend on the drawn tokens, so sampled rows use the static tree.)"""
        head, device, W = eagle.head, feat_1D.device, self.tree_width
        min_logp = math.log(self.tree_min_prob) if self.tree_min_prob > 0 else -math.inf
        parent, token, score, node_depth = [-1], [last_token], [0.0], [0]  # the root: the last token
        slot_of: dict[int, int] = {}  # node → head-cache slot (expanded nodes only)
        feats = {0: feat_1D[0]}
        frontier = [0]
        for d in range(depth):
            logp_PN = torch.log_softmax(
                eagle.logits(torch.stack([feats[n] for n in frontier]), d + 1), dim=-1
            )
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
            out = cache.step(
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
