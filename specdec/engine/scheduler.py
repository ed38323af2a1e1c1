"""The engine's scheduler: admission, cache rows, the token budget and each row's draft depth.

Legend: B rows decoding in a step, K a row's draft depth, G rows that draft.

Each step the scheduler **admits** waiting requests into free cache rows (first come, first served;
the queue is unbounded: a full engine queues, it never drops a request), gives every decoding
request its **depth** from one controller (:mod:`specdec.engine.depth`: the measured verify cost of
the whole step, :mod:`specdec.engine.cost_model`, the drafting cost of the rows that draft,
:mod:`specdec.engine.draft_cost`, and that request's own acceptance), adds **probes** and the **tree**
choice, and spends what is left of the token budget (``max_num_batched_tokens``) on prompt chunks.
It emits a :class:`~specdec.engine.plan.StepPlan` and learns from the runner's
:class:`~specdec.engine.plan.StepReport` (drafting cost; rows freed by requests that finished).
"""

from __future__ import annotations

import heapq
from collections import deque

from specdec.engine.cost_model import OnlineVerifyCost
from specdec.engine.depth import DepthPolicy, RowView
from specdec.engine.draft_cost import DraftCost
from specdec.engine.faults import log
from specdec.engine.grammar_drafts import FORCED_ACCEPTANCE, free_drafts
from specdec.engine.plan import RowPlan, StepPlan, StepReport
from specdec.engine.request import Request, RequestStatus

__all__ = ["Scheduler", "PROBE_EVERY", "TREE_BLOCK", "TREE_COST_RATIO"]

_PRIOR, _PRIOR_WEIGHT = 0.6, 3.0  # the prior of the acceptance estimates a_k per request
TREE_BLOCK, TREE_COST_RATIO = 12, 1.6
"""A drafter that can draft a chain or a tree is told trees pay (``StepPlan.tree_ok``) where a
verify block of ``TREE_BLOCK`` tokens (a tree of 11 nodes and its root) costs at most
``TREE_COST_RATIO`` times one token, and the row is verified alone in its step."""
PROBE_EVERY = 16
"""A row free to follow timings that drafted nothing for this many steps drafts one token (a probe),
so its acceptance estimate follows the text even where the policy chose plain steps; the other free
rows idle for at least half as long probe in the same step (one padded forward for all of them),
and only where a 2-token block of the step's rows costs at most ``PROBE_COST_RATIO`` times one token
(on this CPU: one to two rows, not four or eight)."""
PROBE_COST_RATIO = 1.25
PROBE_ACCEPTANCE = 0.8
"""The acceptance at which a probe's draft must be able to pay (see ``Scheduler._probe_pays``)."""


class Scheduler:
    """Which requests a step computes, how many tokens each, and how deep each drafts.

    ``free``: whether a request's depth may follow load and timings without changing its output
    (greedy rows; every row under a drafter-invariant rule); the others draft by their own
    acceptance only (:func:`specdec.engine.depth.local_depth`).
    """

    def __init__(
        self,
        *,
        max_num_seqs: int,
        budget: int,
        prefill_chunk: int,
        policy: DepthPolicy,
        cost: OnlineVerifyCost | None,
        draft_cost: DraftCost,
        tree_target: bool,
        drafter_invariant: bool,
    ) -> None:
        self.max_num_seqs, self.budget, self.prefill_chunk = max_num_seqs, budget, prefill_chunk
        self.policy, self.gamma_max = policy, policy.gamma
        self.cost, self.draft_cost = cost, draft_cost
        self.drafter_invariant = drafter_invariant
        # Trees only where a tree-sized block costs little more than one token (without a cost
        # model, wherever the target takes trees).
        self.tree_pays = tree_target and (
            cost is None or cost.cost(1, TREE_BLOCK) <= TREE_COST_RATIO * cost.cost(1, 1)
        )
        self.free_heap = list(range(max_num_seqs))  # a heap: the lowest free row first
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # --- the step ---------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Admit, then plan the step: every decoding request's depth, then prompt chunks within the
        budget left (the decode rows' blocks padded to the deepest)."""
        self._admit()
        decoding = [r for r in self.running if r.status is RequestStatus.DECODE]
        forced = [self._forced(r) for r in decoding]
        depths = self._depths(decoding, forced) if decoding else []
        budget = self.budget - len(decoding) * (max(depths, default=-1) + 1)
        decode = tuple(RowPlan(r, 1, K, f) for r, K, f in zip(decoding, depths, forced, strict=True))
        return StepPlan(decode, self._prefill(budget), self.tree_pays and len(decoding) == 1)

    def update(self, report: StepReport) -> None:
        """Learn the verify and drafting costs of the step; finished requests leave and free their rows."""
        if self.cost is not None:
            for rows, tokens, seconds in report.verify_forwards:
                self.cost.observe(rows, tokens, seconds)
        if report.draft_rows:  # the drafting cost of G rows at this depth, apart from the catch-up owed
            self.draft_cost.learn(report.draft_rows, report.draft_depth, report.draft_s)
            if report.catch_up_s > 0 and report.steady:
                self.draft_cost.learn_catch_up(report.draft_rows, report.catch_up_s)
        finished = [r for r in self.running if r.status is RequestStatus.FINISHED]
        if finished:
            self.running = [r for r in self.running if r.status is not RequestStatus.FINISHED]
            for r in finished:
                self._free_row(r)

    def remove(self, request: Request) -> None:
        """Take a request out now (an abort): off the queue, or out of ``running`` and its row freed."""
        if request.slot is None:  # still queued
            self.waiting.remove(request)
            return
        self.running = [r for r in self.running if r is not request]
        self._free_row(request)

    # --- parts --------------------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and self.free_heap:
            request = self.waiting.popleft()
            request.slot = heapq.heappop(self.free_heap)  # the lowest free row
            request.status = RequestStatus.PREFILL
            self.running.append(request)

    def _free_row(self, request: Request) -> None:
        if request.slot is not None:
            heapq.heappush(self.free_heap, request.slot)
            request.slot = None

    def _prefill(self, budget: int) -> tuple[RowPlan, ...]:
        """Prompt tokens within ``budget``, in rounds: each round takes the next chunk of every
        prefilling request (first come first served) while the budget lasts."""
        planned: dict[int, int] = {}
        prefilling = [r for r in self.running if r.status is RequestStatus.PREFILL]
        while prefilling:
            more = []
            for r in prefilling:
                done = r.num_prefilled + planned.get(id(r), 0)
                n = min(self.prefill_chunk, len(r.prompt_ids) - done)
                if n > budget:
                    more = []
                    break
                budget -= n
                planned[id(r)] = planned.get(id(r), 0) + n
                if done + n < len(r.prompt_ids):
                    more.append(r)
            prefilling = more
        return tuple(RowPlan(r, planned[id(r)]) for r in self.running if id(r) in planned)

    def _free(self, request: Request) -> bool:
        """May this row's depth follow load and timings without changing its output?"""
        return request.params.sampling.greedy or self.drafter_invariant

    def _cap(self, r: Request) -> int:
        """The deepest ``r`` may draft now: γ, what it may still emit after the step's token, 0 where
        it does not speculate."""
        return max(0, min(self.gamma_max, r.room - 1)) if r.params.speculative else 0

    def _forced(self, r: Request) -> tuple[int, ...]:
        """The tokens ``r``'s grammar forces, up to its cap; none where finding them raises (the row's
        grammar mask then raises too, where the row fails alone)."""
        cap = self._cap(r)
        try:
            return tuple(free_drafts(r, cap)) if cap else ()
        except Exception:
            log.exception("request %s: the grammar's forced tokens", r.request_id)
            return ()

    def _depths(self, rows: list[Request], forced: list[tuple[int, ...]] | None = None) -> list[int]:
        """Every row's depth (``forced``: each row's forced tokens, found here where not given)."""
        views = []
        for i, r in enumerate(rows):
            cap = self._cap(r)
            acc = [r.acceptance(k, _PRIOR, _PRIOR_WEIGHT) for k in range(1, cap + 1)]
            n = len(forced[i] if forced is not None else self._forced(r))  # a grammar's forced tokens
            acc = [max(a, FORCED_ACCEPTANCE) if k < n else a for k, a in enumerate(acc)]
            views.append(RowView(acc, cap, self._free(r)))
        depths = self.policy.depths(views, self.cost, self.draft_cost)
        # Probes share a step: a probe pads every row of the forward to 2 tokens, so once one row is
        # due, the rows at least half-way there probe with it (their counters then run in step).
        idle = [
            r.idle_steps if d == 0 and v.free and v.cap >= 1 else -1
            for r, v, d in zip(rows, views, depths, strict=True)
        ]
        if max(idle, default=-1) >= PROBE_EVERY and self._probe_pays(len(rows)):
            depths = [1 if n >= PROBE_EVERY // 2 else d for n, d in zip(idle, depths, strict=True)]
        return depths

    def _probe_pays(self, B: int) -> bool:
        """A probe step of ``B`` rows costs at most ``PROBE_COST_RATIO`` times a plain one and a drafted
        token could pay at acceptance ``PROBE_ACCEPTANCE`` with the measured draft costs (no cost
        model: always); else drafting cannot pay at this load, and a probe would only cost."""
        if self.cost is None:
            return True
        one, two = self.cost.cost(B, 1), self.cost.cost(B, 2)
        drafting = two + self.draft_cost.step_seconds([1] * B)
        return two <= PROBE_COST_RATIO * one and (1 + PROBE_ACCEPTANCE) / drafting > 1 / one
