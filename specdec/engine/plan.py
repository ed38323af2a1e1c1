"""The plan of one engine step (the scheduler's output, the runner's input) and its report back.

Legend: K a row's draft depth, n tokens a row computes in the step.

A plan says per request what the step computes: ``num_tokens`` of its tokens not yet in the
target's cache (a prompt's next chunks, or the last committed token of a decoding request) and
``depth``, the drafts to propose after them. Wherever a row's computed tokens reach its last one, the
logits there go through the verification rule with that row's drafts (none for a prompt's end: its
first token is a verify at depth 0). The report says what the scheduler learns from the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.engine.request import Request

__all__ = ["RowPlan", "StepPlan", "StepReport"]


@dataclass(frozen=True)
class RowPlan:
    """One request in a step: ``num_tokens`` tokens to compute and ``depth`` drafts after them;
    ``forced``: the tokens its grammar forces after its committed output, as the scheduler found them
    (:func:`specdec.engine.grammar_drafts.free_drafts`; empty without a grammar)."""

    request: Request
    num_tokens: int
    depth: int = 0
    forced: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepPlan:
    """Every request a step computes. ``decode``: requests whose prompt is in the cache (one token
    to compute, their depths); ``prefill``: requests computing prompt tokens (their chunks run at
    fixed boundaries of the engine's ``prefill_chunk``); ``tree_ok``: a drafter may draft a token tree
    (one decoding row, where a tree-sized block costs little more than a token)."""

    decode: tuple[RowPlan, ...] = ()
    prefill: tuple[RowPlan, ...] = ()
    tree_ok: bool = False


@dataclass
class StepReport:
    """What a step did, for the scheduler: ``new_tokens`` per request id (the requests that changed);
    ``draft_rows`` rows that drafted, ``draft_depth`` the deepest, ``draft_s`` the drafter's seconds
    for it apart from ``catch_up_s``, the catch-up of committed tokens within it; ``steady``: that
    catch-up was one step's tokens (not a prompt's, not idle steps'), a cost of drafting on;
    ``verify_forwards``: (rows, tokens per row, seconds) of each chain verify forward."""

    new_tokens: dict[str, list[int]] = field(default_factory=dict)
    draft_rows: int = 0
    draft_depth: int = 0
    draft_s: float = 0.0
    catch_up_s: float = 0.0
    steady: bool = True
    verify_forwards: list[tuple[int, int, float]] = field(default_factory=list)
