"""Verify units: the engine's rows grouped so that one call serves many rows.

Legend: G rows of a unit, K draft depth, T = K + 1 block length, V vocabulary, L cache slots per row.

A step of the engine may hold thousands of rows (``specdec.generate`` runs every prompt of a call as
one request). Per-row Python (one propose, one rule call, one rollback per row) would then dominate,
so rows travel in **units**: a unit is G rows and one block of G rows (a chain ``[G, K]`` or a token
tree shared by the G rows), drafted by one call and verified by one rule call, its cache rows rolled
back by one call. Rows are grouped only where that cannot change what any row emits:

- a **cohort** of a batched drafter (``batched_rows = True``: one instance serves any set of rows at
  once, keeps no per-row state, and draws its randomness from the keyed ``noise`` it is given,
  :mod:`specdec.verify.noise`, stream ``"draft"``): the rows that share a depth and sampling settings are
  drafted by one ``propose`` over a G-row :class:`~specdec.protocols.DecodeState`;
- rows drafted one by one (a drafter instance per request) whose chains share depth, sampling
  settings and the kind of proposal (probabilities or a point mass) are **merged** into one unit
  for verification (:func:`merge_chains`).

A row's verification reads only its own logits, drafts and keyed noise (its seed and sequence
positions), so grouping never changes a row's tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.protocols import DecodeState, TargetOutput
from specdec.verify.blocks import ChainBlock, TreeBlock

__all__ = [
    "Unit",
    "group_state",
    "merge_chains",
    "row_output",
    "select_rows",
    "slice_output",
]


@dataclass
class Unit:
    """G rows and their block. ``drafter``: the cohort's shared instance (batched drafters), or None
    when every row has its own (``request.drafter``). ``faults``: the device-side value checks of
    its proposals (0-dim bools, read with the step's committed tokens), and ``rechecks`` the full
    checks that raise their message where one is set (:mod:`specdec.engine.transfer`)."""

    rows: list[Any]
    block: ChainBlock | TreeBlock
    drafter: Any = None
    faults: list[torch.Tensor] = field(default_factory=list)
    rechecks: list[Callable[[], None]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.rows)


def group_state(rows: list[Any], sampling: Any, tokens_SL: torch.Tensor) -> DecodeState:
    """The G rows' states as one ``DecodeState``: their rows of the engine's token table ``tokens_SL``
    (a copy: drafters read it)."""
    return DecodeState(
        tokens_BL=tokens_SL[[r.slot for r in rows]],
        prompt_lengths_B=torch.tensor([len(r.prompt_ids) for r in rows], dtype=torch.long),
        lengths_B=torch.tensor([r.length for r in rows], dtype=torch.long),
        finished_B=torch.zeros(len(rows), dtype=torch.bool),
        sampling=sampling,
    )


def merge_chains(units: list[Unit]) -> list[Unit]:
    """One-row chain units of per-request drafters with the same depth, sampling settings and kind of
    proposal, merged into one unit each (drafts and probabilities concatenated); others unchanged."""
    merged: dict[tuple, list[Unit]] = {}
    rest: list[Unit] = []
    for u in units:
        b = u.block
        if u.drafter is None and isinstance(b, ChainBlock):
            key = (b.num_drafted, u.rows[0].params.sampling, b.draft_probs_BKV is None)
            merged.setdefault(key, []).append(u)
        else:
            rest.append(u)
    out = []
    for group in merged.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        blocks = [u.block for u in group]
        device = blocks[0].draft_tokens_BK.device  # a drafter on the device gives device tensors
        tokens = torch.cat([b.draft_tokens_BK.to(device) for b in blocks])
        probs = None
        if blocks[0].draft_probs_BKV is not None:
            probs = torch.cat([b.draft_probs_BKV.to(device) for b in blocks])  # type: ignore[union-attr]
        unit = Unit([r for u in group for r in u.rows], ChainBlock(tokens, probs))
        for u in group:
            unit.faults += u.faults
            unit.rechecks += u.rechecks
        out.append(unit)
    return out + rest


def slice_output(out: TargetOutput, r0: int, r1: int, T: int | None = None) -> TargetOutput:
    """Rows ``r0:r1`` of a forward's output, their first T positions (all of them: None)."""
    aux = None if not out.aux_hidden_BTD else {k: h[r0:r1, :T] for k, h in out.aux_hidden_BTD.items()}
    hidden = None if out.hidden_BTD is None else out.hidden_BTD[r0:r1, :T]
    return TargetOutput(logits_BTV=out.logits_BTV[r0:r1, :T], hidden_BTD=hidden, aux_hidden_BTD=aux)


def select_rows(out: TargetOutput, rows: list[int]) -> TargetOutput:
    """Rows ``rows`` of a forward's output (any subset, in that order; every row: the output itself)."""
    if len(rows) == out.logits_BTV.shape[0] and rows == list(range(len(rows))):
        return out
    index = torch.tensor(rows)
    aux = None if not out.aux_hidden_BTD else {k: h[index] for k, h in out.aux_hidden_BTD.items()}
    hidden = None if out.hidden_BTD is None else out.hidden_BTD[index]
    return TargetOutput(logits_BTV=out.logits_BTV[index], hidden_BTD=hidden, aux_hidden_BTD=aux)


def row_output(out: TargetOutput, i: int, T: int | None = None) -> TargetOutput:
    """Row i of an output, its first T positions (all of them: None)."""
    return slice_output(out, i, i + 1, T)
