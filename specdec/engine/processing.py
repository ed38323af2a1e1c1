"""A verify unit's logits processed for its rows (:mod:`specdec.logits`): each row's processors at
every block position, with the draft path that leads there.

Legend: G rows of a unit, T block positions (a chain's root and drafts; a tree's nodes), V vocabulary.

A chain position t follows the drafts ``d_1 .. d_t``; a tree node follows the drafts on its path from
the root. Rows without processors keep their logits as they are (a unit where no row has any is
returned untouched: no cost when nothing is set).
"""

from __future__ import annotations

import torch

from specdec.engine.units import Unit
from specdec.verify.blocks import ChainBlock

__all__ = ["block_paths", "processed_logits"]


def block_paths(unit: Unit, i: int) -> list[list[int]]:
    """Row ``i``'s draft path to every position of its unit's block."""
    block = unit.block
    if isinstance(block, ChainBlock):
        drafts = block.draft_tokens_BK[i].tolist()
        return [drafts[:t] for t in range(len(drafts) + 1)]
    tokens = block.proposal.tokens_BN[i].tolist()
    parents = block.proposal.tree.parents
    paths: list[list[int]] = [[]]
    for node in range(1, len(parents)):
        paths.append(paths[parents[node]] + [tokens[node]])
    return paths


def processed_logits(unit: Unit, logits_GTV: torch.Tensor) -> torch.Tensor:
    """``logits_GTV`` with every row's processors applied (float32 where any row has them)."""
    rows = unit.rows
    if all(r.processors is None for r in rows):
        return logits_GTV
    out = logits_GTV.float() if logits_GTV.dtype != torch.float32 else logits_GTV.clone()
    for i, r in enumerate(rows):
        if r.processors is not None:
            r.processors.process(out[i], block_paths(unit, i), inplace=True)
    return out
