"""Token trees: the shape of a tree of draft tokens, its tree attention, and a drafter's tree proposal.

Legend: B batch, N tree nodes (node 0 is the root: the last committed token).

SpecInfer (Miao et al. 2024, arXiv 2305.09781) verifies a whole tree of draft tokens in one target
call: each node attends to the committed prefix and its own ancestors (:meth:`TokenTree.ancestor_mask`)
at rope position ``start + depth``; :mod:`specdec.verify.tree` then verifies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import torch

__all__ = ["TokenTree", "TreeProposal", "PRESET_TREES"]


@dataclass(frozen=True)
class TokenTree:
    """A rooted tree of draft positions in topological order.

    ``parents[i]`` is node i's parent (``parents[0] == -1``; ``parents[i] < i``). A node's children
    are its candidates in drawing order (``children[i]``, sorted by node index). Build one with
    :meth:`from_paths` (Medusa/EAGLE-style rank paths), :meth:`chain` or :meth:`from_branching`.
    """

    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        p = self.parents
        if not p or p[0] != -1:
            raise ValueError(f"parents must start with -1 (the root), got {list(p[:3])}")
        for i, q in enumerate(p[1:], start=1):
            if not 0 <= q < i:
                raise ValueError(f"parents[{i}] = {q}: every node's parent must be an earlier node")

    # --- constructors -------------------------------------------------------------------------
    @classmethod
    def chain(cls, k: int) -> TokenTree:
        """A chain of ``k`` draft tokens (the chain drafter's shape)."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        return cls(tuple(range(-1, k)))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> TokenTree:
        """From rank paths: ``(0, 1)`` is the 2nd candidate of the root's 1st candidate.

        Every prefix of a path must be a path too, and a node's candidate ranks must be 0..k−1.
        Nodes are ordered by depth, then lexicographically (so siblings come in rank order).
        """
        norm = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        if any(len(p) == 0 or min(p) < 0 for p in norm):
            raise ValueError("paths must be non-empty sequences of ranks >= 0")
        index = {(): 0}
        parents = [-1]
        for p in norm:
            if p[:-1] not in index:
                raise ValueError(f"path {list(p)} has no parent path {list(p[:-1])}")
            if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in index:
                raise ValueError(f"path {list(p)}: rank {p[-1]} needs rank {p[-1] - 1} beside it")
            index[p] = len(parents)
            parents.append(index[p[:-1]])
        return cls(tuple(parents))

    @classmethod
    def from_branching(cls, branching: Sequence[int]) -> TokenTree:
        """A tree whose best (rank-0) path has ``branching[d]`` candidates at depth d, and whose other
        candidates are leaves: e.g. ``[4, 2, 2, 1]`` (EAGLE-like "expand the top path")."""
        paths, best = [], ()
        for k in branching:
            if k < 1:
                raise ValueError(f"branching entries must be >= 1, got {list(branching)}")
            paths += [best + (r,) for r in range(k)]
            best = best + (0,)
        return cls.from_paths(paths)

    # --- derived ---------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @cached_property
    def depth(self) -> tuple[int, ...]:
        d = [0] * self.num_nodes
        for i in range(1, self.num_nodes):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i in range(1, self.num_nodes):
            kids[self.parents[i]].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def main_path(self) -> tuple[int, ...]:
        """Nodes of the first-candidate path below the root (a valid chain proposal)."""
        path, node = [], 0
        while self.children[node]:
            node = self.children[node][0]
            path.append(node)
        return tuple(path)

    @cached_property
    def _children_table(self) -> torch.Tensor:
        width = max(1, max(len(k) for k in self.children))
        table = torch.full((self.num_nodes, width), -1, dtype=torch.long)
        for i, kids in enumerate(self.children):
            if kids:
                table[i, : len(kids)] = torch.tensor(kids, dtype=torch.long)
        return table

    def children_table(self, device: Any = None) -> torch.Tensor:
        """``[N, C]`` long: node i's children in candidate order, −1 padded."""
        return self._children_table.to(device)

    @cached_property
    def _ancestor_mask(self) -> torch.Tensor:
        n = self.num_nodes
        m = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                m[i, j] = True
                j = self.parents[j]
        return m

    def truncate(self, max_depth: int, max_nodes: int | None = None) -> TokenTree:
        """The nodes of depth ≤ ``max_depth``, then the first ``max_nodes`` of them (a prefix of a
        topological order is still a tree, and siblings keep their first ranks)."""
        return _truncate(self, max_depth, self.num_nodes if max_nodes is None else max(1, max_nodes))

    def ancestor_mask(self, device: Any = None) -> torch.Tensor:
        """``[N, N]`` bool: node i may attend node j iff j is i or an ancestor of i."""
        return self._ancestor_mask.to(device)

    def depth_tensor(self, device: Any = None) -> torch.Tensor:
        return torch.tensor(self.depth, dtype=torch.long, device=device)

    def nodes_at_depth(self, d: int) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_nodes) if self.depth[i] == d)


@lru_cache(maxsize=256)
def _truncate(tree: TokenTree, max_depth: int, max_nodes: int) -> TokenTree:
    keep = [i for i in range(tree.num_nodes) if tree.depth[i] <= max_depth][:max_nodes]
    if len(keep) == tree.num_nodes:
        return tree
    index = {old: new for new, old in enumerate(keep)}
    return TokenTree(tuple(-1 if i == 0 else index[tree.parents[i]] for i in keep))


PRESET_TREES: dict[str, list[tuple[int, ...]]] = {
    # 11 draft nodes, depth 6: a block of 12 tokens, which costs the target about as much as 8 on
    # a CPU (the packed matmul reads the weights once for up to 12 rows). Wide near the root.
    "small": [
        (0,),
        (1,),
        (2,),
        (0, 0),
        (0, 1),
        (1, 0),
        (0, 0, 0),
        (0, 0, 1),
        (0, 0, 0, 0),
        (0, 0, 0, 0, 0),
        (0, 0, 0, 0, 0, 0),
    ],
    # 16 draft nodes, depth 7.
    "medium": [
        (0,),
        (1,),
        (2,),
        (0, 0),
        (0, 1),
        (1, 0),
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (0, 0, 0, 0, 0),
        (0, 0, 0, 0, 1),
        (0, 0, 0, 0, 0, 0),
        (0, 0, 0, 0, 0, 1),
        (0, 0, 0, 0, 0, 0, 0),
    ],
}
"""Named tree shapes as rank paths (see :meth:`TokenTree.from_paths`)."""


@dataclass
class TreeProposal:
    """A drafter's tree for every row (same shape, per-row tokens).

    ``tokens_BN``: node tokens (node 0 is the root: the last committed token, filled by the
    verifier). ``draft_probs_BNV``: per node, the full-vocabulary distribution its children were
    drawn from (float32, processed by ``logits_to_probs``), or None for deterministic candidates.
    ``replacement``: children drawn i.i.d. (True) or without replacement (False).
    """

    tree: TokenTree
    tokens_BN: torch.Tensor
    draft_probs_BNV: torch.Tensor | None = None
    replacement: bool = False
