"""The engine's runner: carries out a step's plan and reports what it did.

Legend: B rows decoding in a step, G rows of a unit, K a row's draft depth, T = K + 1 its verify
block, T_max the step's longest block, V vocabulary, n tokens of a prompt chunk.

For a :class:`~specdec.engine.plan.StepPlan` the runner

1. **drafts**: the engine's one slot drafter proposes for every decoding row that drafts, in one call
   (:class:`~specdec.protocols.SlotDrafter`); rows at depth 0 are not asked;
2. **verifies**: the chains go through **one** target forward, each row at its own cache row and
   position, padded to T_max (the padding lands past the row's length and is never attended); a
   token tree goes through a forward of its own (its mask is per tree); each unit of rows
   (:mod:`specdec.engine.units`) is verified by the rule with its own sampling settings and public
   randomness keyed by its seed and sequence positions (:mod:`specdec.verify.noise`);
3. **commits** each row's tokens, cuts them at its stops, rolls its cache row back to what it
   committed, and the drafter **observes** the rows that go on;
4. **prefills** the planned prompt tokens in chunks of ``prefill_chunk`` at fixed boundaries (a chunk
   is the same forward whatever else runs in the step; the chunks of one length run as one forward,
   each row at its own cache row). A prompt's last position goes through the same rule at depth 0
   (its first token), and the drafter adds the request's slot.

The host: logits, proposals, keyed noise, probabilities and the rule's arithmetic stay on the
target's device; a verify forward's rows come to the host once, as one copy of their committed
tokens, accepted counts (a tree's path) and the faults of the step's checks
(:class:`~specdec.engine.transfer.HostTransfer`). On the CPU the same code runs, with the host's
fast paths (numpy argmax and checks, early exits) where :func:`specdec.host_sync.avoids_host` is
False.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from specdec.checks import check_logits, logits_faults
from specdec.engine.drafting import Drafting
from specdec.engine.faults import each_alone, error_message, log
from specdec.engine.judge import Fail, Judge, Part, rows_alone
from specdec.engine.logprobs import last_logits_only, prefill_logits_index
from specdec.engine.plan import RowPlan, StepPlan, StepReport
from specdec.engine.request import Request, RequestStatus
from specdec.engine.units import Unit, group_state, join_outputs, row_output, slice_output
from specdec.host_sync import avoids_host
from specdec.metrics import MetricsRecorder, StepStats
from specdec.protocols import SlotDrafter, TargetOutput
from specdec.verify.blocks import ChainBlock, TreeBlock, Verdict
from specdec.verify.contract import VerifyRule

__all__ = ["Runner"]

_DECAY = 0.97  # forgetting of the acceptance estimates a_k per request


def _drafts(block: Any) -> torch.Tensor:
    return block.draft_tokens_BK if isinstance(block, ChainBlock) else block.proposal.tokens_BN


def _decided_by(logits_BTV: torch.Tensor, verdict: Verdict, i: int) -> torch.Tensor:
    """Row i's logits in the order of its committed tokens: block position j for a chain, the path's
    j-th node for a tree (each committed token was decided at its input's position)."""
    if verdict.path_BA is None:
        return logits_BTV[i]
    return logits_BTV[i, verdict.path_BA[i].to(logits_BTV.device)]


class Runner:
    """Runs a step's plan over the target, the rule and the engine's slot drafter.

    ``tokens_SL``: every request's tokens (prompt, then committed), one row per cache row (slots past
    a row's length are undefined); ``stats``: the engine's time counters (:class:`specdec.Engine`).
    """

    def __init__(
        self,
        *,
        target: Any,
        rule: VerifyRule,
        drafter: SlotDrafter,
        drafter_name: str,
        tokens_SL: torch.Tensor,
        max_model_len: int,
        prefill_chunk: int,
        gamma_max: int,
        stats: dict[str, float],
        now: Callable[[], float],
    ) -> None:
        self.target, self.rule, self.drafter, self.drafter_name = target, rule, drafter, drafter_name
        self.vocab_size = int(target.vocab_size)
        self.tokens_SL, self._tokens_np = tokens_SL, tokens_SL.numpy()
        self.max_model_len, self.prefill_chunk, self.gamma_max = max_model_len, prefill_chunk, gamma_max
        self.stats, self.now = stats, now
        self.judge = Judge(rule, stats, now)
        self.drafting = Drafting(
            target=target,
            drafter=drafter,
            drafter_name=drafter_name,
            tokens_SL=tokens_SL,
            max_model_len=max_model_len,
            gamma_max=gamma_max,
            stats=stats,
        )
        self.recorder: MetricsRecorder | None = None

    def run(self, plan: StepPlan) -> StepReport:
        """Decode the plan's decoding rows, then prefill its prompt tokens."""
        report = StepReport()
        if plan.decode:
            self._decode(plan.decode, plan.tree_ok, report)
        if plan.prefill:
            self._prefill(plan.prefill, report)
        return report

    def finish(self, request: Request) -> None:
        """A request leaves (finished, aborted or failed): the drafter drops its slot; the scheduler
        frees its row at the step's end (:meth:`specdec.engine.scheduler.Scheduler.update`)."""
        decoding = request.status is RequestStatus.DECODE and request.slot is not None
        request.status = RequestStatus.FINISHED
        request.prefill_parts = []
        request.metrics.finished_s = self.now()
        if decoding:
            try:
                self.drafter.drop(request.slot)
            except Exception:  # the slot is added afresh for its next request
                log.exception("the drafter's drop(%s) failed", request.slot)

    def fail(self, request: Request, where: str, err: Exception, report: StepReport) -> None:
        """One request fails alone (:mod:`specdec.engine.faults`): it finishes with ``finish_reason``
        ``"error"`` and its message; the step's other rows go on."""
        if request.status is RequestStatus.FINISHED:
            return
        request.error = error_message(where, err)
        request.finish_reason = "error"
        log.warning("request %s failed alone: %s", request.request_id, request.error, exc_info=err)
        self.finish(request)
        report.new_tokens.setdefault(request.request_id, [])

    def _failer(self, report: StepReport) -> Fail:
        """:meth:`fail` for this step's report, as the judge's and ``rows_alone``'s ``fail``."""
        return lambda request, where, err: self.fail(request, where, err, report)

    # --- decode -----------------------------------------------------------------------------------
    def _decode(self, plan: tuple[RowPlan, ...], tree_ok: bool, report: StepReport) -> None:
        t0 = self.now()
        units = self.drafting.units(plan, tree_ok, report, self._failer(report))
        t1 = self.now()
        self.stats["draft_s"] += t1 - t0
        if report.draft_rows:
            report.draft_s = max(0.0, t1 - t0 - report.catch_up_s)
        chains = [u for u in units if isinstance(u.block, ChainBlock)]
        groups = [chains] if chains else []
        groups += [[u] for u in units if isinstance(u.block, TreeBlock)]
        for g, group in enumerate(groups):
            self._verify(group, report, draft_s=(t1 - t0) if g == 0 else 0.0)

    def _verify(self, units: list[Unit], report: StepReport, *, draft_s: float) -> None:
        """One target forward over these units' blocks (chains padded to the longest), every unit's
        verdict, one read, then per unit: commit, settle, observe. A forward that raises is made
        again for each row alone; a row whose own forward raises fails."""
        rows = [r for u in units for r in u.rows]
        # the block is built where the drafts are (host drafts stay on the host, for the target's checks)
        where = next((d.device for u in units for d in [_drafts(u.block)] if d.device.type != "cpu"), "cpu")
        roots_B = torch.tensor([r.generated[-1] for r in rows], dtype=torch.long)
        if where != "cpu":
            roots_B = roots_B.to(where)
        start_B = torch.tensor([r.length - 1 for r in rows], dtype=torch.long)
        rows_B = torch.tensor([r.slot for r in rows], dtype=torch.long)
        T_max = max(u.block.num_drafted for u in units) + 1
        if len(units) == 1:
            tokens_BT = units[0].block.tokens_BT(roots_B)
        else:
            tokens_BT = torch.zeros((len(rows), T_max), dtype=torch.long, device=where)
            r0 = 0
            for u in units:
                seq = u.block.tokens_BT(roots_B[r0 : r0 + u.size])
                tokens_BT[r0 : r0 + u.size, : seq.shape[1]] = seq
                r0 += u.size
        t0 = self.now()
        try:
            out = self.target.forward(
                tokens_BT, start_B, rows_B=rows_B, **units[0].block.forward_kwargs("cpu")
            )
        except Exception as err:
            self.stats["forward_s"] += self.now() - t0
            if len(rows) == 1:
                self.fail(rows[0], "the target's verify forward", err, report)
                return
            for u in units:  # each row alone writes the same cache entries (batch invariance)
                for i in range(u.size):
                    self._verify([u.select([i])], report, draft_s=0.0)
            return
        t1 = self.now()
        self.stats["forward_s"] += t1 - t0
        if isinstance(units[0].block, ChainBlock):
            report.verify_forwards.append((len(rows), T_max, t1 - t0))
        parts, r0 = [], 0
        for u in units:
            parts.append(
                Part(
                    u, slice_output(out, r0, r0 + u.size, u.block.num_drafted + 1), start_B[r0 : r0 + u.size]
                )
            )
            r0 += u.size
        parts = self.judge(parts, int(self.stats["steps"]) + 1, self._failer(report))
        accepted: list[int] = []
        observe_s = 0.0
        for part in parts:
            a, dt = self._settle(part, report)
            accepted += a
            observe_s += dt
        t2 = self.now()
        self.stats["verify_s"] += t2 - t1
        if self.recorder is not None and parts:
            self.recorder.record_step(
                StepStats(
                    gamma=max(p.unit.block.depth for p in parts),
                    num_drafted=T_max - 1,
                    num_accepted=accepted,
                    draft_time_s=draft_s + observe_s,
                    target_time_s=t1 - t0,
                    verify_time_s=t2 - t0 - observe_s,
                    row_drafted=[p.unit.block.num_drafted for p in parts for _ in p.unit.rows],
                    row_depth=[p.unit.block.depth for p in parts for _ in p.unit.rows],
                )
            )

    def _settle(self, part: Part, report: StepReport) -> tuple[list[int], float]:
        """Commit, settle and observe one part from its verdict on the host; returns (accepted drafts
        per row, observe s). A rollback or an ``observe`` that raises is made again for each row
        alone; a row whose own call raises fails."""
        rows, block, verdict = part.unit.rows, part.unit.block, part.verdict
        accepted = verdict.num_accepted_B.tolist()
        tokens = verdict.tokens_BA.tolist()
        for i, request in enumerate(rows):
            a = accepted[i]
            request.metrics.num_steps += 1
            request.metrics.num_drafted += block.num_drafted
            request.idle_steps = 0 if block.num_drafted else request.idle_steps + 1
            request.learn(block.depth, a, _DECAY)
            logits_TV = None if request.logprobs is None else _decided_by(part.out.logits_BTV, verdict, i)
            self._commit(request, tokens[i][: a + 1], report, logits_TV)

        def settle(p: Part) -> TargetOutput:  # the cache reads like what each row committed (stops aside)
            lengths_G = p.start_G + 2 + p.verdict.num_accepted_B
            slots_G = torch.tensor([r.slot for r in p.unit.rows], dtype=torch.long)
            return p.unit.block.settle(self.target, p.out, p.verdict, p.start_G, lengths_G, rows_B=slots_G)

        settled = rows_alone(part, settle, "the cache rollback", self._failer(report))
        t0 = self.now()
        for p, observed in settled:
            live = [i for i, r in enumerate(p.unit.rows) if r.status is RequestStatus.DECODE]

            def observe(index: list[int], p: Part = p, observed: TargetOutput = observed) -> None:
                these = [p.unit.rows[i] for i in index]
                self.drafter.observe(
                    [r.slot for r in these],
                    p.verdict.num_accepted_B[index].tolist(),
                    observed.select(index),
                    state=group_state(these, rows[0].params.sampling, self.tokens_SL),
                )

            fail = lambda i, err, p=p: self.fail(p.unit.rows[i], "the drafter's observe", err, report)  # noqa: E731
            if live:
                each_alone(live, observe, fail)
        observe_s = self.now() - t0
        self.stats["draft_s"] += observe_s
        return accepted, observe_s

    # --- prefill ------------------------------------------------------------------------------------
    def _prefill(self, plan: tuple[RowPlan, ...], report: StepReport) -> None:
        """The planned prompt tokens in rounds of chunks: each round the next chunk of every row, the
        chunks of one length as one forward (each row at its own cache row and start)."""
        left = {p.request.request_id: p.num_tokens for p in plan}
        while any(left.values()):
            chunks: dict[int, list[Request]] = {}
            for p in plan:
                r = p.request
                n = min(self.prefill_chunk, left[r.request_id])
                if n > 0:
                    left[r.request_id] -= n
                    if r.status is not RequestStatus.FINISHED:  # not failed in an earlier chunk
                        chunks.setdefault(n, []).append(r)
            for n, rows in chunks.items():
                self._prefill_chunk(rows, n, report)

    def _prefill_chunk(self, rows: list[Request], n: int, report: StepReport) -> None:
        """The next ``n`` prompt tokens of every row in one forward (made again for each row alone
        where it raises); rows whose prompt is complete take their first token from the rule at
        depth 0, and the drafter adds their slots."""
        for r in rows:
            if r.num_prefilled == 0:
                self._tokens_np[r.slot, : len(r.prompt_ids)] = r.prompt_ids

        def forward(part: list[Request]) -> TargetOutput:
            return self.target.forward(
                torch.tensor(
                    [r.prompt_ids[r.num_prefilled : r.num_prefilled + n] for r in part], dtype=torch.long
                ),
                torch.tensor([r.num_prefilled for r in part]),
                rows_B=torch.tensor([r.slot for r in part]),
                logits_index_BN=prefill_logits_index(part, n),
            )

        t0 = self.now()
        done = each_alone(
            rows, forward, lambda r, err: self.fail(r, "the target's prefill forward", err, report)
        )
        self.stats["forward_s"] += self.now() - t0
        self.stats["prefill_s"] += self.now() - t0
        for part, out in done:
            self._prefilled(part, n, out, report)

    def _prefilled(self, rows: list[Request], n: int, out: TargetOutput, report: StepReport) -> None:
        """After a prefill forward over ``rows``: its logits checked (every position it returned:
        prompt log-probabilities read them all; on the host now, row by row where one is bad, on a
        device with the step's read of the rows that complete), prompt log-probabilities, the chunk's
        output kept for the drafter, and the first token of every row whose prompt is complete."""
        logits, G = out.logits_BTV, len(rows)
        row_logits = lambda i: logits if i is None else logits[i : i + 1]  # noqa: E731
        check = lambda i: check_logits(row_logits(i), step="prefill", source="the target")  # noqa: E731
        on_host = not avoids_host(logits)
        ok = list(range(G))
        if on_host:
            fail = lambda i, err: self.fail(rows[i], "the target's logits", err, report)  # noqa: E731
            whole = lambda index: check(None if len(index) == G else index[0])  # noqa: E731
            ok = [i for index, _ in each_alone(ok, whole, fail) for i in index]
        done: dict[Any, list[int]] = {}  # by sampling settings: the rows whose prompt is complete
        for i in ok:
            request = rows[i]
            try:
                request.record_prompt_logprobs(logits[i], request.num_prefilled)
            except Exception as err:
                self.fail(request, "the prompt's log-probabilities", err, report)
                continue
            # a copy of the last position: a view would keep the chunk's whole [G, n, V] logits alive
            request.prefill_parts.append(last_logits_only(row_output(out, i)))
            request.num_prefilled += n
            if request.num_prefilled == len(request.prompt_ids):
                done.setdefault(request.params.sampling, []).append(i)
        if not done:
            return

        def unit(index: list[int]) -> Unit:
            u = self.drafting.plain_unit([rows[i] for i in index])
            if not on_host:  # the rows' whole chunk logits, read with the step's committed tokens
                u.fault = logits_faults(logits[index])
                u.recheck = lambda j: check(index[j])
            return u

        parts = [
            Part(
                unit(index),
                TargetOutput(logits[index, -1:]),
                torch.tensor([rows[i].length - 1 for i in index]),
            )
            for index in done.values()
        ]
        parts = self.judge(parts, "prefill", self._failer(report))
        t_first = self.now()
        for part in parts:
            for j, request in enumerate(part.unit.rows):
                request.metrics.first_token_s = t_first
                self._commit(request, part.verdict.tokens_BA[j, :1].tolist(), report, part.out.logits_BTV[j])
            self._begin([r for r in part.unit.rows if r.status is not RequestStatus.FINISHED], report)

    def _begin(self, rows: list[Request], report: StepReport) -> None:
        """The drafter adds the slots of rows that begin decoding (their prompt's prefill output)."""
        t0 = self.now()
        for r in rows:
            r.status = RequestStatus.DECODE
            try:
                self.drafter.add(r.slot, r.prompt_ids, join_outputs(r.prefill_parts))
            except Exception as err:
                self.fail(r, "the drafter's add", err, report)
            r.prefill_parts = []
        self.stats["draft_s"] += self.now() - t0
        self.stats["begin_s"] += self.now() - t0

    # --- commit -------------------------------------------------------------------------------------
    def _commit(self, request: Request, tokens: list[int], report: StepReport, logits_NV: Any = None) -> None:
        """Append tokens to a request (cut at its stops) and to its row of ``tokens_SL``; a stop
        check or a log-probability that raises fails the request alone."""
        n0 = request.length
        try:
            kept = request.commit(tokens)
            request.record_logprobs(kept, logits_NV)
        except Exception as err:
            self.fail(request, "the commit (stop conditions, log-probabilities)", err, report)
            return
        if kept:
            self._tokens_np[request.slot, n0 : n0 + len(kept)] = kept
            request.metrics.token_times_s.extend([self.now()] * len(kept))
        report.new_tokens.setdefault(request.request_id, []).extend(kept)
        if request.finish_reason is not None:
            self.finish(request)
