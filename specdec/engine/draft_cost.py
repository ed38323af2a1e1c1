"""What a step's drafting costs, by drafting rows and depth, learned from the engine's own steps.

Legend: G rows drafting in a step (depth > 0), K the step's deepest draft.

One slot drafter (``eagle``, ``ngram-eagle``, ``default``) drafts all G rows with one head forward per
draft position, so a step costs about ``catch(G) + position(G) · K``: ``position(G)`` grows far less than
G-fold (the head's weights stream once per position), and ``catch(G)`` is the one catch-up forward over
the rows' committed tokens. Drafters with an instance per request cost G times one row; the same
two tables learn that too. Both tables are exponential averages per G, learned on the engine's own
drafting steps (``position``: the step's draft seconds without catch-up, over K; ``catch``: the
catch-up of a step that follows a drafting step, one step's committed tokens; a measurement counts
as at most twice the estimate), and read by linear
interpolation in G. Past the largest G seen, a table scales linearly from it (no batching gain
assumed); below the smallest, it is flat. For a slot drafter the engine measures the tables once when
it starts (:func:`measure_draft_cost`, on the rows' grid of the verify cost), so the first steps under
load know what batched drafting costs before any row has drafted there.

:class:`DraftCost` only chooses depths (:mod:`specdec.engine.depth`); what tokens come out never
depends on it.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

_log = logging.getLogger(__name__)

__all__ = ["DraftCost", "PerTokenDraftCost", "measure_draft_cost"]

_KEEP = 0.8  # weight of the old estimate in each exponential average


class DraftCost:
    """Seconds of drafting per step: ``step_seconds(depths)`` for the depths of a step's rows."""

    def __init__(self) -> None:
        self.position: dict[int, float] = {}  # G -> seconds per draft position
        self.catch: dict[int, float] = {}  # G -> seconds of catch-up per drafting step

    @staticmethod
    def _fold(table: dict[int, float], G: int, seconds: float) -> None:
        """Fold one measurement into ``table[G]``, taken as at most twice the estimate: a shared machine
        only adds time, and one slow step (a cold start, a burst of load) must not stop drafting at
        G for good (a row that does not draft teaches nothing)."""
        old = table.get(G)
        table[G] = seconds if old is None else _KEEP * old + (1 - _KEEP) * min(seconds, 2 * old)

    def make_monotone(self) -> None:
        """Cap each G's costs by those of larger G (fewer rows never cost more: what says otherwise is
        noise), as the verify cost grid does."""
        for table in (self.position, self.catch):
            cap = float("inf")
            for G in sorted(table, reverse=True):
                cap = table[G] = min(table[G], cap)

    def learn(self, rows: int, depth: int, seconds: float) -> None:
        """A step drafting ``rows`` rows, the deepest ``depth``, spent ``seconds`` (catch-up apart)."""
        if rows > 0 and depth > 0 and seconds >= 0:
            self._fold(self.position, rows, seconds / depth)

    def learn_catch_up(self, rows: int, seconds: float) -> None:
        """A drafting step of ``rows`` rows caught up one step's committed tokens in ``seconds``."""
        if rows > 0 and seconds >= 0:
            self._fold(self.catch, rows, seconds)

    @staticmethod
    def _at(table: dict[int, float], G: int) -> float:
        if not table or G <= 0:
            return 0.0
        sizes = sorted(table)
        if G <= sizes[0]:
            return table[sizes[0]]
        if G >= sizes[-1]:
            return table[sizes[-1]] * G / sizes[-1]
        j = bisect.bisect_left(sizes, G)
        lo, hi = sizes[j - 1], sizes[j]
        w = (G - lo) / (hi - lo)
        return table[lo] * (1 - w) + table[hi] * w

    def step_seconds(self, depths: Sequence[int]) -> float:
        """Drafting seconds of a step whose rows draft ``depths`` (0: the row does not draft)."""
        G = sum(1 for k in depths if k > 0)
        if G == 0:
            return 0.0
        return self._at(self.catch, G) + self._at(self.position, G) * max(depths)

    @property
    def known(self) -> bool:
        """Whether any drafting step has been measured."""
        return bool(self.position)


class PerTokenDraftCost(DraftCost):
    """A fixed cost per drafted token and row (``t_draft`` seconds; ``overhead`` seconds per drafting
    row): what a policy given a float ``t_draft`` charges, every row drafting on its own."""

    def __init__(self, t_draft: float, overhead: float = 0.0) -> None:
        super().__init__()
        self.t_draft, self.overhead = float(t_draft), float(overhead)

    def step_seconds(self, depths: Sequence[int]) -> float:
        return sum(self.t_draft * k + self.overhead for k in depths if k > 0)


@torch.inference_mode()
def measure_draft_cost(
    target: Any,
    drafter: Any,
    *,
    rows: Sequence[int],
    depth: int = 3,
    context: int = 64,
    repeats: int = 3,
) -> DraftCost:
    """Time a :class:`~specdec.protocols.SlotDrafter` drafting ``depth`` tokens for G rows at once, for
    each G in ``rows``, on the target's empty cache (rows 0..G-1 prefilled with ``context`` random
    tokens, then rolled back) and the drafter's first G slots (added, then dropped), greedy rows: the
    fastest of ``repeats`` calls after a first one that catches up the prompts. ``position[G]`` is the call's
    seconds over its longest chain; ``catch[G]`` starts at one position's cost (a step's catch-up is one
    head forward over the rows' committed tokens) until the engine learns it. A drafter whose repeated
    call raises (a drafter written for one request may need an ``observe`` between two calls) is not
    timed: an empty cost, learned from the engine's drafting steps."""
    from specdec.engine.cost_model import device_synchronizer
    from specdec.engine.units import row_output
    from specdec.protocols import DecodeState, DraftCall
    from specdec.sampling import SamplingParams

    sync = device_synchronizer(getattr(target, "device", None))

    cost = DraftCost()
    greedy = SamplingParams(temperature=0.0)
    G_max = max(rows)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, int(target.vocab_size), (G_max, context + 1), generator=gen)
    at = torch.arange(G_max)
    out = target.forward(prompt[:, :context], torch.zeros(G_max, dtype=torch.long), rows_B=at)
    try:
        for G in sorted(set(rows)):
            added: list[int] = []
            try:
                for s in range(G):
                    drafter.add(s, prompt[s, :context].tolist(), row_output(out, s))
                    added.append(s)
                tokens = torch.zeros(G, context + depth + 8, dtype=torch.long)
                tokens[:, : context + 1] = prompt[:G]
                P = torch.full((G,), context, dtype=torch.long)
                state = DecodeState(tokens, P, P + 1, torch.zeros(G, dtype=torch.bool), greedy)
                call = DraftCall(list(range(G)), [depth] * G, state, [greedy] * G)
                drafter.propose(call)  # the prompts' catch-up
                best, longest = float("inf"), 0
                for _ in range(repeats):  # the same call again: no observe between them
                    sync()
                    t0 = time.perf_counter()
                    proposal = drafter.propose(call)
                    sync()
                    best = min(best, time.perf_counter() - t0)
                    longest = max(longest, max(proposal.counts_B))
            except Exception as err:  # noqa: BLE001 - a drafter that needs an observe between calls
                _log.debug("draft cost not measured (learned from the engine's steps): %r", err)
                return DraftCost()
            finally:
                for s in added:
                    drafter.drop(s)
            # a confidence stop may end every chain of random text at once: the call then scored one
            # position (a lower bound until the engine learns the cost of drafting there)
            cost.learn(G, max(longest, 1), best)
            cost.learn_catch_up(G, best / max(longest, 1))
    finally:
        target.rollback(torch.zeros(G_max, dtype=torch.long), rows_B=at)
    cost.make_monotone()
    return cost
