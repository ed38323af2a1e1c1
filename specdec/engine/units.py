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
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.protocols import DecodeState, TargetOutput
from specdec.verify.blocks import ChainBlock, TreeBlock

__all__ = [
    "Unit",
    "group_state",
    "join_outputs",
    "row_output",
    "slice_output",
]


@dataclass
class Unit:
    """G rows and their block. ``faults``: the device-side value checks of its proposals (0-dim
    bools, read with the step's committed tokens), and ``rechecks`` the full checks that raise their
    message where one is set (:mod:`specdec.engine.transfer`)."""

    rows: list[Any]
    block: ChainBlock | TreeBlock
    faults: list[torch.Tensor] = field(default_factory=list)
    rechecks: list[Callable[[], None]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.rows)


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
