"""Verify units: the engine's rows grouped so that one call serves many rows.

Legend: G rows of a unit, K draft depth, T = K + 1 block length, V vocabulary, L cache slots per row.

A step of the engine may hold thousands of rows (``specdec.generate`` runs every prompt of a call as
one request). Per-row Python (one rule call, one rollback per row) would then dominate, so rows
travel in **units**: a unit is G rows and one block of G rows (a chain ``[G, K]`` or a token tree of
one row), verified by one rule call, its cache rows rolled back by one call. The slot drafter's
ragged chains are split into units of rows that share a draft count and sampling settings; rows at
depth 0 form units by sampling settings. A row's verification reads only its own logits, drafts
and keyed noise (its seed and sequence positions), so grouping never changes a row's tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from specdec.checks import check_proposal, proposal_faults
from specdec.host_sync import avoids_host
from specdec.protocols import DecodeState, Proposal, TargetOutput, TreeTarget
from specdec.verify.blocks import ChainBlock, TreeBlock, make_block

__all__ = [
    "Unit",
    "checked_unit",
    "group_state",
    "join_outputs",
    "row_output",
    "slice_output",
]


@dataclass
class Unit:
    """G rows and their block. ``fault``: the device-side value check of its proposal (a 0-dim bool,
    read with the step's committed tokens; None: checked on the host already), and ``recheck(i)``
    the full check of row i's proposal, which raises its message (:mod:`specdec.engine.transfer`)."""

    rows: list[Any]
    block: ChainBlock | TreeBlock
    fault: torch.Tensor | None = None
    recheck: Callable[[int], None] | None = None

    @property
    def size(self) -> int:
        return len(self.rows)

    def select(self, index: list[int]) -> Unit:
        """Rows ``index`` of the unit (in that order) with their rows of the block."""
        block = self.block
        if isinstance(block, ChainBlock):
            probs = block.draft_probs_BKV
            block = ChainBlock(block.draft_tokens_BK[index], None if probs is None else probs[index])
        else:
            block = TreeBlock(_tree_rows(block.proposal, index))
        recheck = self.recheck
        row_recheck = None if recheck is None else (lambda i: recheck(index[i]))
        return Unit([self.rows[i] for i in index], block, self.fault, row_recheck)


def _tree_rows(tree: Any, index: list[int]) -> Any:
    probs = tree.draft_probs_BNV
    return replace(
        tree, tokens_BN=tree.tokens_BN[index], draft_probs_BNV=None if probs is None else probs[index]
    )


def _proposal_row(proposal: Proposal, i: int) -> Proposal:
    """Row i of a proposal, as a proposal of one row."""
    probs = proposal.probs_BKV
    tree = None if proposal.tree is None else _tree_rows(proposal.tree, [i])
    return Proposal(proposal.tokens_BK[i : i + 1], None if probs is None else probs[i : i + 1], tree)


def _proposal_tensors(proposal: Proposal) -> list[Any]:
    tree = proposal.tree
    parts = [proposal.tokens_BK, proposal.probs_BKV]
    if tree is not None:
        parts += [getattr(tree, "tokens_BN", None), getattr(tree, "draft_probs_BNV", None)]
    return [t for t in parts if isinstance(t, torch.Tensor)]


def _clamped(proposal: Proposal, vocab_size: int) -> Proposal:
    """The proposal with its ids clamped into ``[0, V)``: a proposal checked on the device is used
    before its check is read, and an id outside the vocabulary would stop the device (its check
    then raises, after the step's one read)."""
    clamp = lambda t: t.clamp(0, vocab_size - 1)  # noqa: E731
    tree = proposal.tree
    if tree is not None:
        tree = replace(tree, tokens_BN=clamp(tree.tokens_BN))
    return Proposal(clamp(proposal.tokens_BK), proposal.probs_BKV, tree)


def _fit_tree(proposal: Proposal, rows: list[Any], target: Any, max_model_len: int) -> Proposal:
    """A token tree the target cannot take (no tree attention, no room): its first-candidate chain."""
    if proposal.tree is not None:
        nodes = proposal.tree.tree.num_nodes
        last = max(r.length for r in rows)
        if not isinstance(target, TreeTarget) or last - 1 + nodes > max_model_len:
            return Proposal(proposal.tokens_BK, proposal.probs_BKV)
    return proposal


def checked_unit(
    proposal: Any, rows: list[Any], K: int, *, target: Any, max_model_len: int, source: str
) -> Unit:
    """The unit of a drafter's proposal for ``rows`` (at most K deep), checked: on the host now
    (``ValueError`` naming the step, the drafter and the row), or, for a proposal on the device, its
    shapes now and its values with the step's read (``Unit.fault``, ``Unit.recheck``)."""
    step = max(r.metrics.num_steps for r in rows) + 1  # the rows' decode step
    vocab_size = int(target.vocab_size)
    check = dict(gamma=K, vocab_size=vocab_size, step=step, source=source)
    if not isinstance(proposal, Proposal) or not any(avoids_host(t) for t in _proposal_tensors(proposal)):
        check_proposal(proposal, batch_size=len(rows), **check)
        return Unit(rows, make_block(_fit_tree(proposal, rows, target, max_model_len), target))
    check_proposal(proposal, batch_size=len(rows), values=False, **check)
    fault = proposal_faults(proposal, vocab_size=vocab_size)
    block = make_block(_fit_tree(_clamped(proposal, vocab_size), rows, target, max_model_len), target)
    return Unit(
        rows, block, fault, lambda i: check_proposal(_proposal_row(proposal, i), batch_size=1, **check)
    )


def group_state(rows: list[Any], sampling: Any, tokens_SL: torch.Tensor) -> DecodeState:
    """The G rows' states as one ``DecodeState``: their rows of the engine's token table ``tokens_SL`` (on
    the host; a copy: drafters read it)."""
    return DecodeState(
        tokens_BL=torch.from_numpy(tokens_SL.numpy()[[r.slot for r in rows]]),  # numpy: the cheaper gather
        prompt_lengths_B=torch.tensor([len(r.prompt_ids) for r in rows], dtype=torch.long),
        lengths_B=torch.tensor([r.length for r in rows], dtype=torch.long),
        finished_B=torch.zeros(len(rows), dtype=torch.bool),
        sampling=sampling,
    )


def slice_output(out: TargetOutput, r0: int, r1: int, T: int | None = None) -> TargetOutput:
    """Rows ``r0:r1`` of a forward's output, their first T positions (all of them: None)."""
    aux = None if not out.aux_hidden_BTD else {k: h[r0:r1, :T] for k, h in out.aux_hidden_BTD.items()}
    hidden = None if out.hidden_BTD is None else out.hidden_BTD[r0:r1, :T]
    return TargetOutput(logits_BTV=out.logits_BTV[r0:r1, :T], hidden_BTD=hidden, aux_hidden_BTD=aux)


def row_output(out: TargetOutput, i: int, T: int | None = None) -> TargetOutput:
    """Row i of an output, its first T positions (all of them: None)."""
    return slice_output(out, i, i + 1, T)


def join_outputs(parts: list[TargetOutput]) -> TargetOutput:
    """A prompt's prefill chunks' outputs as one (features concatenated along T; the last chunk's
    logits): what the drafter adds a slot with."""
    last = parts[-1]
    hidden = None
    if all(p.hidden_BTD is not None for p in parts):
        hidden = torch.cat([p.hidden_BTD for p in parts], dim=1)
    aux = None
    if last.aux_hidden_BTD:
        aux = {i: torch.cat([p.aux_hidden_BTD[i] for p in parts], dim=1) for i in last.aux_hidden_BTD}
    return TargetOutput(logits_BTV=last.logits_BTV, hidden_BTD=hidden, aux_hidden_BTD=aux)
