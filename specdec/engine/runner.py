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
from dataclasses import replace
from typing import Any

import torch

from specdec.checks import check_logits, check_proposal, logits_faults, proposal_faults
from specdec.engine.logprobs import last_logits_only, prefill_logits_index
from specdec.engine.plan import RowPlan, StepPlan, StepReport
from specdec.engine.request import Request, RequestStatus
from specdec.engine.transfer import HostTransfer
from specdec.engine.units import Unit, group_state, join_outputs, row_output, slice_output
from specdec.host_sync import avoids_host
from specdec.metrics import MetricsRecorder, StepStats
from specdec.protocols import Proposal, SlotDrafter, TargetOutput, TreeTarget
from specdec.verify.blocks import ChainBlock, TreeBlock, Verdict, make_block
from specdec.verify.contract import VerifyRule
from specdec.verify.noise import PositionNoise

__all__ = ["Runner", "raise_faults"]

_DECAY = 0.97  # forgetting of the acceptance estimates a_k per request


def raise_faults(fetched: dict[str, Any], checks: list[Callable[[], None]]) -> None:
    """After a step's read: where a device-side check found a fault (``fetched["faults"]``), run the
    full checks (``checks``: callables that raise their message) and, if none raises, say so."""
    faults = fetched.get("faults")
    if faults is None or not faults.any():
        return
    for check in checks:
        check()
    raise ValueError("a device-side check of the target's logits or a proposal failed, the host's passed")


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
        self.tree_target = isinstance(target, TreeTarget)
        self.tokens_SL, self._tokens_np = tokens_SL, tokens_SL.numpy()
        self.max_model_len, self.prefill_chunk, self.gamma_max = max_model_len, prefill_chunk, gamma_max
        self.stats, self.now = stats, now
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
        """A request leaves (finished or aborted): the drafter drops its slot; the scheduler frees its
        row at the step's end (:meth:`specdec.engine.scheduler.Scheduler.update`)."""
        if request.status is RequestStatus.DECODE and request.slot is not None:
            self.drafter.drop(request.slot)
        request.status = RequestStatus.FINISHED
        request.prefill_parts = []
        request.metrics.finished_s = self.now()

    # --- decode -----------------------------------------------------------------------------------
    def _decode(self, plan: tuple[RowPlan, ...], tree_ok: bool, report: StepReport) -> None:
        t0 = self.now()
        units = self._propose(plan, tree_ok, report)
        t1 = self.now()
        self.stats["draft_s"] += t1 - t0
        if report.draft_rows:
            report.draft_s = max(0.0, t1 - t0 - report.catch_up_s)
        chains = [u for u in units if isinstance(u.block, ChainBlock)]
        groups = [chains] if chains else []
        groups += [[u] for u in units if isinstance(u.block, TreeBlock)]
        for g, group in enumerate(groups):
            self._verify(group, report, draft_s=(t1 - t0) if g == 0 else 0.0)

    def _plain_unit(self, rows: list[Request]) -> Unit:
        """Rows at depth 0: an empty chain, built without asking the drafter (it would propose
        nothing, and under load most rows sit at depth 0)."""
        return Unit(rows, make_block(Proposal(torch.zeros((len(rows), 0), dtype=torch.long)), self.target))

    def _propose(self, plan: tuple[RowPlan, ...], tree_ok: bool, report: StepReport) -> list[Unit]:
        """The slot drafter over every drafting row at once: one ``propose`` (its randomness keyed by
        each row's seed), its ragged chains split into units of rows sharing count and sampling."""
        plain: dict[Any, list[Request]] = {}
        for p in plan:
            if p.depth == 0:
                plain.setdefault(p.request.params.sampling, []).append(p.request)
        units = [self._plain_unit(group) for group in plain.values()]
        drafting = [p for p in plan if p.depth > 0]
        if not drafting:
            return units
        rows = [p.request for p in drafting]
        state = group_state(rows, rows[0].params.sampling, self.tokens_SL)
        state.tree_ok = tree_ok
        drafter = self.drafter
        caught_tokens, caught = drafter.catch_up_tokens, drafter.catch_up_s
        proposal = drafter.propose(
            [r.slot for r in rows],
            [p.depth for p in drafting],
            state=state,
            sampling=[r.params.sampling for r in rows],
            noise=PositionNoise([r.params.seed for r in rows]),
        )
        report.draft_rows, report.draft_depth = len(rows), max(p.depth for p in drafting)
        report.catch_up_s = drafter.catch_up_s - caught
        # More than one step's committed tokens caught up (a prompt, or tokens of idle or lookup
        # steps) is work owed once, not a cost of drafting on: not learned, counted in owed_s.
        if drafter.catch_up_tokens - caught_tokens > self.gamma_max + 1:
            report.steady = False
            self.stats["owed_s"] += report.catch_up_s
        if proposal.tree is not None:  # one row's token tree (a step of one row where trees pay)
            return units + [self._unit(proposal.tree, rows, drafting[0].depth)]
        in_trees = set()
        for index, tree in proposal.trees:  # trees of some rows, each verified by a forward of its own
            units.append(self._unit(tree, [rows[i] for i in index], max(drafting[i].depth for i in index)))
            in_trees.update(index)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(rows):
            if i not in in_trees:
                groups.setdefault((proposal.counts_B[i], r.params.sampling), []).append(i)
        for (count, sampling), index in groups.items():
            chains = proposal.chains(index, sampling.greedy)
            units.append(self._unit(chains, [rows[i] for i in index], count))
        return units

    def _fit_tree(self, proposal: Proposal, rows: list[Request]) -> Proposal:
        """A token tree the target cannot take (no tree attention, no room): its first-candidate chain."""
        if proposal.tree is not None:
            nodes = proposal.tree.tree.num_nodes
            last = max(r.length for r in rows)
            if not self.tree_target or last - 1 + nodes > self.max_model_len:
                return Proposal(proposal.tokens_BK, proposal.probs_BKV)
        return proposal

    def _unit(self, proposal: Any, rows: list[Request], K: int) -> Unit:
        """The unit of a proposal, checked: on the host now, or, for a proposal on the device, its
        shapes now and its values with the step's read (:func:`raise_faults`)."""
        step = max(r.metrics.num_steps for r in rows) + 1  # the rows' decode step
        check = dict(
            batch_size=len(rows), gamma=K, vocab_size=self.vocab_size, step=step, source=self.drafter_name
        )
        if not isinstance(proposal, Proposal) or not any(avoids_host(t) for t in _proposal_tensors(proposal)):
            check_proposal(proposal, **check)
            return Unit(rows, make_block(self._fit_tree(proposal, rows), self.target))
        check_proposal(proposal, values=False, **check)
        faults = proposal_faults(proposal, vocab_size=self.vocab_size)
        block = make_block(self._fit_tree(_clamped(proposal, self.vocab_size), rows), self.target)
        return Unit(rows, block, [faults], [lambda: check_proposal(proposal, **check)])

    def _verify(self, units: list[Unit], report: StepReport, *, draft_s: float) -> None:
        """One target forward over these units' blocks (chains padded to the longest), every unit's
        verdict, one read, then per unit: commit, settle, observe."""
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
        out = self.target.forward(tokens_BT, start_B, rows_B=rows_B, **units[0].block.forward_kwargs("cpu"))
        t1 = self.now()
        self.stats["forward_s"] += t1 - t0
        outs, r0 = [], 0
        for u in units:
            outs.append(slice_output(out, r0, r0 + u.size, u.block.num_drafted + 1))
            r0 += u.size
        verdicts = self._verdicts(units, outs, start_B, out.logits_BTV, int(self.stats["steps"]) + 1)
        accepted: list[int] = []
        observe_s, r0 = 0.0, 0
        for u, o, verdict in zip(units, outs, verdicts, strict=True):
            r1 = r0 + u.size
            a, dt = self._settle(u, o, verdict, start_B[r0:r1], rows_B[r0:r1], report)
            accepted += a
            observe_s += dt
            r0 = r1
        t2 = self.now()
        self.stats["verify_s"] += t2 - t1
        if self.recorder is not None:
            self.recorder.record_step(
                StepStats(
                    gamma=max(u.block.depth for u in units),
                    num_drafted=T_max - 1,
                    num_accepted=accepted,
                    draft_time_s=draft_s + observe_s,
                    target_time_s=t1 - t0,
                    verify_time_s=t2 - t0 - observe_s,
                    row_drafted=[u.block.num_drafted for u in units for _ in u.rows],
                    row_depth=[u.block.depth for u in units for _ in u.rows],
                )
            )

    def _verdicts(
        self,
        units: list[Unit],
        outs: list[TargetOutput],
        start_B: torch.Tensor,
        logits: torch.Tensor,
        step: int | str,
    ) -> list[Verdict]:
        """Every unit's verdict by the rule on the target's device, with the forward's logits checked
        (``logits``, of ``step``), read to the host in one copy with the checks' faults."""
        transfer = HostTransfer(logits.device)
        faults = [f for u in units for f in u.faults]
        if avoids_host(logits):
            faults.append(logits_faults(logits))
        else:
            check_logits(logits, step=step, source="the target")
        if faults:
            transfer.add("faults", torch.stack([f.to(transfer.device) for f in faults]))
        t_rule = self.now()
        r0 = 0
        for i, (u, o) in enumerate(zip(units, outs, strict=True)):
            verdict = self._verdict(u, o, start_B[r0 : r0 + u.size])
            for name, part in zip(("tokens", "accepted", "path"), verdict, strict=True):
                if part is not None:
                    transfer.add(f"{name}{i}", part)
            r0 += u.size
        fetched = transfer.fetch()  # the step's one read
        self.stats["rule_s"] += self.now() - t_rule
        recheck = lambda: check_logits(logits, step=step, source="the target")  # noqa: E731
        raise_faults(fetched, [recheck] + [c for u in units for c in u.rechecks])
        return [
            Verdict(
                torch.from_numpy(fetched[f"tokens{i}"]),
                torch.from_numpy(fetched[f"accepted{i}"]),
                None if fetched.get(f"path{i}") is None else torch.from_numpy(fetched[f"path{i}"]),
            )
            for i in range(len(units))
        ]

    def _verdict(self, unit: Unit, out: TargetOutput, start_G: torch.Tensor) -> Verdict:
        """One unit's verdict by the rule, where the logits are, with the rows' keyed noise and the
        output-stream index of the token each block position decides (docs/randomness.md)."""
        rows, block = unit.rows, unit.block
        sampling = rows[0].params.sampling
        logits_BTV = out.logits_BTV
        if sampling.greedy and isinstance(block, ChainBlock):
            fast = block.verify_greedy(self.rule, logits_BTV)
            if fast is not None:  # argmax matching: no noise
                return fast
        T = block.num_drafted + 1
        prompt_G = torch.tensor([len(r.prompt_ids) for r in rows], dtype=torch.long)
        offsets_T = block.forward_kwargs("cpu").get("depth_T", torch.arange(T))
        positions_GT = (start_G + 1 - prompt_G).unsqueeze(1) + offsets_T
        noise = PositionNoise([r.params.seed for r in rows], device=logits_BTV.device)
        return block.verify(
            self.rule, logits_BTV, sampling, noise=noise, positions_BK=positions_GT.to(logits_BTV.device)
        )

    def _settle(
        self,
        unit: Unit,
        out: TargetOutput,
        verdict: Verdict,
        start_G: torch.Tensor,
        rows_G: torch.Tensor,
        report: StepReport,
    ) -> tuple[list[int], float]:
        """Commit, settle and observe one unit from its verdict on the host; returns (accepted drafts
        per row, observe s)."""
        rows, block = unit.rows, unit.block
        accepted = verdict.num_accepted_B.tolist()
        tokens = verdict.tokens_BA.tolist()
        lengths = []
        for i, request in enumerate(rows):
            a = accepted[i]
            request.metrics.num_steps += 1
            request.metrics.num_drafted += block.num_drafted
            request.idle_steps = 0 if block.num_drafted else request.idle_steps + 1
            request.learn(block.depth, a, _DECAY)
            lengths.append(int(start_G[i]) + 2 + a)  # what the cache must read like (stops do not matter)
            logits_TV = None if request.logprobs is None else _decided_by(out.logits_BTV, verdict, i)
            self._commit(request, tokens[i][: a + 1], report, logits_TV)
        observed = block.settle(
            self.target, out, verdict, start_G, torch.tensor(lengths, dtype=torch.long), rows_B=rows_G
        )
        t0 = self.now()
        live = [i for i, r in enumerate(rows) if r.status is RequestStatus.DECODE]
        if live:
            self.drafter.observe(
                [rows[i].slot for i in live],
                [accepted[i] for i in live],
                observed.select(live),
                state=group_state([rows[i] for i in live], rows[0].params.sampling, self.tokens_SL),
            )
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
                    chunks.setdefault(n, []).append(r)
            for n, rows in chunks.items():
                self._prefill_chunk(rows, n, report)

    def _prefill_chunk(self, rows: list[Request], n: int, report: StepReport) -> None:
        """The next ``n`` prompt tokens of every row in one forward; rows whose prompt is complete
        take their first token from the rule at depth 0, and the drafter adds their slots."""
        for r in rows:
            if r.num_prefilled == 0:
                self._tokens_np[r.slot, : len(r.prompt_ids)] = r.prompt_ids
        tokens_GT = torch.tensor(
            [r.prompt_ids[r.num_prefilled : r.num_prefilled + n] for r in rows], dtype=torch.long
        )
        t0 = self.now()
        out = self.target.forward(
            tokens_GT,
            torch.tensor([r.num_prefilled for r in rows]),
            rows_B=torch.tensor([r.slot for r in rows]),
            logits_index_BN=prefill_logits_index(rows, n),
        )
        self.stats["forward_s"] += self.now() - t0
        self.stats["prefill_s"] += self.now() - t0
        done: dict[Any, list[int]] = {}  # by sampling settings: the rows whose prompt is complete
        for i, request in enumerate(rows):
            request.record_prompt_logprobs(out.logits_BTV[i], request.num_prefilled)
            request.prefill_parts.append(last_logits_only(row_output(out, i)))
            request.num_prefilled += n
            if request.num_prefilled == len(request.prompt_ids):
                done.setdefault(request.params.sampling, []).append(i)
        if not done:
            return
        units = [self._plain_unit([rows[i] for i in index]) for index in done.values()]
        outs = [TargetOutput(out.logits_BTV[index, -1:]) for index in done.values()]
        start_B = torch.tensor([rows[i].length - 1 for index in done.values() for i in index])
        verdicts = self._verdicts(units, outs, start_B, out.logits_BTV, "prefill")
        t_first = self.now()
        for unit, o, verdict in zip(units, outs, verdicts, strict=True):
            for j, request in enumerate(unit.rows):
                request.metrics.first_token_s = t_first
                self._commit(request, verdict.tokens_BA[j, :1].tolist(), report, o.logits_BTV[j])
            self._begin([r for r in unit.rows if r.status is not RequestStatus.FINISHED])

    def _begin(self, rows: list[Request]) -> None:
        """The drafter adds the slots of rows that begin decoding (their prompt's prefill output)."""
        t0 = self.now()
        for r in rows:
            r.status = RequestStatus.DECODE
            self.drafter.add(r.slot, r.prompt_ids, join_outputs(r.prefill_parts))
            r.prefill_parts = []
        self.stats["draft_s"] += self.now() - t0
        self.stats["begin_s"] += self.now() - t0

    # --- commit -------------------------------------------------------------------------------------
    def _commit(self, request: Request, tokens: list[int], report: StepReport, logits_NV: Any = None) -> None:
        """Append tokens to a request (cut at its stops) and to its row of ``tokens_SL``."""
        n0 = request.length
        kept = request.commit(tokens)
        request.record_logprobs(kept, logits_NV)
        if kept:
            self._tokens_np[request.slot, n0 : n0 + len(kept)] = kept
            request.metrics.token_times_s.extend([self.now()] * len(kept))
        report.new_tokens.setdefault(request.request_id, []).extend(kept)
        if request.finish_reason is not None:
            self.finish(request)
