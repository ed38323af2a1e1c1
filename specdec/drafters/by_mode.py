"""A drafter that picks, per generation, the drafter measured fastest for that kind of run.

Registered as ``ngram-eagle-auto`` (and what ``default`` builds for a target with a shipped head):
greedy single-row runs on a target with tree attention get ``ngram-eagle-tree`` (prompt lookup, else
an EAGLE-2 dynamic tree), everything else ``ngram-eagle`` (prompt lookup, else the head's chain).
Side by side on this project's 2-core CPU (``specdec bench``, held-out HumanEval + MT-Bench, γ = 6)
the tree ran faster greedy in every run with the shipped head, and the chain faster at T = 0.7 in
two runs of three (docs/eagle.md). The dynamic tree is a greedy, single-row construction anyway:
sampled runs would get the static tree, the one slower at T = 0.7 in those runs, and batched runs
with a tree were not measured.

Both drafters are built up front (each loads the head: ~11 MB). The choice happens in ``begin`` and
holds for the whole generation; verification is exact either way, so the output distribution never
depends on it.
"""

from __future__ import annotations

from typing import Any

import torch

from specdec.protocols import DecodeState, Proposal, TargetOutput

__all__ = ["ModeDrafter", "ngram_eagle_auto"]


class ModeDrafter:
    """``tree`` for greedy single-row runs, else ``chain`` (always ``chain`` when ``tree`` is None,
    e.g. for a target that cannot verify trees).

    ``last_mode`` is the mode of the current (or last) generation: ``"tree"`` or ``"chain"``.
    """

    def __init__(self, chain: Any, tree: Any = None) -> None:
        self.drafters = {"chain": chain, "tree": tree}
        self.last_mode: str | None = None

    def mode(self, state: DecodeState) -> str:
        """``"tree"`` for a greedy single-row run when there is a tree drafter, else ``"chain"``."""
        tree_run = state.sampling.greedy and state.batch_size == 1
        return "tree" if tree_run and self.drafters["tree"] is not None else "chain"

    @property
    def active(self) -> Any:
        if self.last_mode is None:
            raise ValueError("propose() or observe() called before begin()")
        return self.drafters[self.last_mode]

    def begin(self, state: DecodeState, target_out: TargetOutput) -> None:
        self.last_mode = self.mode(state)
        self.active.begin(state, target_out)

    def propose(self, state: DecodeState, gamma: int, generator: torch.Generator | None = None) -> Proposal:
        return self.active.propose(state, gamma, generator)

    def observe(self, state: DecodeState, num_accepted_B: torch.Tensor, target_out: TargetOutput) -> None:
        self.active.observe(state, num_accepted_B, target_out)


def ngram_eagle_auto(
    target: Any,
    *,
    min_prob: float | None = None,
    tree_min_prob: float | None = None,
    tree: Any = None,
    tree_nodes: int | None = None,
    tree_width: int | None = None,
    **shared: Any,
) -> ModeDrafter:
    """``ngram-eagle-tree`` for greedy single-row runs, ``ngram-eagle`` otherwise (always, on a
    target without tree attention).

    ``min_prob`` goes to the chain, ``tree_min_prob`` / ``tree`` / ``tree_nodes`` / ``tree_width``
    to the tree (None: that drafter's default); ``shared`` (``weights``, ``draft_vocab_size``,
    ``min_ngram``, ...) to both. Both are built now, so bad options fail here."""
    from specdec.drafters.fallback import ngram_eagle, ngram_eagle_tree
    from specdec.tree import supports_tree

    chain_opts = {"min_prob": min_prob}
    tree_opts = {
        "tree_min_prob": tree_min_prob,
        "tree": tree,
        "tree_nodes": tree_nodes,
        "tree_width": tree_width,
    }
    chain = ngram_eagle(target, **{k: v for k, v in chain_opts.items() if v is not None}, **shared)
    if not supports_tree(target):
        return ModeDrafter(chain)
    return ModeDrafter(
        chain, ngram_eagle_tree(target, **{k: v for k, v in tree_opts.items() if v is not None}, **shared)
    )
