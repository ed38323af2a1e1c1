"""The decode half of an engine step: propose, one verify forward, then verify, commit, settle and
observe each unit of rows (:mod:`specdec.engine.units`).

Legend: B rows decoding in a step, G rows of a unit, K a row's draft depth, T = K + 1 its verify
block, T_max the step's longest block, V vocabulary.

:class:`DecodeSteps` is the part of :class:`specdec.engine.Engine` that runs decoding rows (the engine
holds the scheduling, the prefill and the public API). Randomness: a per-request drafter draws from a
generator keyed by (request seed, output position) (:func:`mix_seed`); a batched drafter gets the
rows' :class:`~specdec.verify.noise.PositionNoise`; the rule gets the rows' noise and positions. So
what a row emits never depends on the rows beside it.

The host: logits, proposals, keyed noise, probabilities and the rule's arithmetic stay on the
target's device; a verify forward's rows come to the host once, as one copy of their committed
tokens, accepted counts (a tree's path) and the faults of the step's checks
(:class:`~specdec.engine.transfer.HostTransfer`). On the CPU the same code runs, with the host's
fast paths (numpy argmax and checks, early exits) where :func:`specdec.host_sync.avoids_host` is
False.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from specdec.checks import check_logits, check_proposal, logits_faults, proposal_faults
from specdec.engine.request import Request, RequestStatus
from specdec.engine.transfer import HostTransfer
from specdec.engine.units import (
    Unit,
    group_state,
    merge_chains,
    row_output,
    select_rows,
    slice_output,
)
from specdec.host_sync import avoids_host
from specdec.metrics import StepStats
from specdec.protocols import Proposal, TargetOutput
from specdec.verify.blocks import ChainBlock, TreeBlock, Verdict, make_block
from specdec.verify.noise import PositionNoise

__all__ = ["DecodeSteps", "mix_seed", "raise_faults"]

_DECAY = 0.97  # forgetting of the acceptance estimates a_k per request


def mix_seed(seed: int, position: int, salt: int) -> int:
    """A 64-bit seed for a torch.Generator from (request seed, position, use): splitmix64."""
    z = (seed + 0x9E3779B97F4A7C15 * (position + 1) + salt) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


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


def raise_faults(fetched: dict[str, Any], checks: list[Any]) -> None:
    """After a step's read: where a device-side check found a fault (``fetched["faults"]``), run the
    full checks (``checks``: callables that raise their message) and, if none raises, say so."""
    faults = fetched.get("faults")
    if faults is None or not faults.any():
        return
    for check in checks:
        check()
    raise ValueError("a device-side check of the target's logits or a proposal failed, the host's passed")


def _drafts(block: Any) -> torch.Tensor:
    return block.draft_tokens_BK if isinstance(block, ChainBlock) else block.proposal.tokens_BN


def _catch_up_seconds(rows: list[Request]) -> float:
    """Seconds the rows' drafters have spent on lazy catch-up (``catch_up_s``, EAGLE drafters), each
    drafter once."""
    drafters = {id(r.drafter): r.drafter for r in rows}
    return sum(getattr(d, "catch_up_s", 0.0) for d in drafters.values())


def _decided_by(logits_BTV: torch.Tensor, verdict: Any, i: int) -> torch.Tensor:
    """Row i's logits in the order of its committed tokens: block position j for a chain, the path's
    j-th node for a tree (each committed token was decided at its input's position)."""
    if verdict.path_BA is None:
        return logits_BTV[i]
    return logits_BTV[i, verdict.path_BA[i].to(logits_BTV.device)]


class DecodeSteps:
    """Decoding rows of one engine step (mixed into :class:`specdec.engine.Engine`, whose attributes
    it reads: target, rule, keyed, drafters, tokens_SL, stats, recorder, ...)."""

    def _plain_unit(self, rows: list[Request], drafter: Any = None) -> Unit:
        """Rows at depth 0: an empty chain, built without calling their drafter (it would propose
        nothing, and under load most rows sit at depth 0)."""
        empty = Proposal(torch.zeros((len(rows), 0), dtype=torch.long))
        return Unit(rows, make_block(empty, self.target), drafter)

    def _fit_tree(self, proposal: Proposal, rows: list[Request]) -> Proposal:
        """A token tree the target cannot take (no tree attention, no room): its first-candidate chain."""
        if proposal.tree is not None:
            nodes = proposal.tree.tree.num_nodes
            last = max(r.length for r in rows)
            if not self.tree_ok or last - 1 + nodes > self.max_model_len:
                return Proposal(proposal.tokens_BK, proposal.probs_BKV)
        return proposal

    def _propose(self, request: Request, K: int) -> Unit:
        """One request's own drafter (its randomness from a generator keyed by seed and position)."""
        if K == 0:
            return self._plain_unit([request])
        position = request.length
        generator = torch.Generator().manual_seed(
            mix_seed(request.params.seed, position - len(request.prompt_ids), 1)
        )
        request.state.tree_ok = self._trees_now
        drafter = request.drafter
        caught_tokens, caught = getattr(drafter, "catch_up_tokens", 0), getattr(drafter, "catch_up_s", 0.0)
        proposal = drafter.propose(request.state, K, generator)
        self._note_catch_up(
            getattr(drafter, "catch_up_tokens", 0) - caught_tokens,
            getattr(drafter, "catch_up_s", 0.0) - caught,
        )
        return self._unit(proposal, [request], None, K, request.metrics.num_steps + 1)

    def _note_catch_up(self, tokens: int, seconds: float) -> None:
        """A propose caught up ``tokens`` positions in ``seconds``: more than one step's committed tokens
        (a prompt, or tokens of idle or lookup steps) is work owed once, not a cost of drafting on: the
        step's catch-up is not learned, and its seconds go to ``stats["owed_s"]``."""
        if tokens > self.gamma_max + 1:
            self._steady = False
            self.stats["owed_s"] += seconds

    def _unit(self, proposal: Any, rows: list[Request], drafter: Any, K: int, step: int) -> Unit:
        """The unit of a drafter's proposal, checked: on the host now, or, for a proposal on the
        device, its shapes now and its values with the step's read (:func:`raise_faults`)."""
        check = dict(
            batch_size=len(rows), gamma=K, vocab_size=self.vocab_size, step=step, source=self.drafter_name
        )
        if not isinstance(proposal, Proposal) or not any(avoids_host(t) for t in _proposal_tensors(proposal)):
            check_proposal(proposal, **check)
            return Unit(rows, make_block(self._fit_tree(proposal, rows), self.target), drafter)
        check_proposal(proposal, values=False, **check)
        faults = proposal_faults(proposal, vocab_size=self.vocab_size)
        block = make_block(self._fit_tree(_clamped(proposal, self.vocab_size), rows), self.target)
        return Unit(rows, block, drafter, [faults], [lambda: check_proposal(proposal, **check)])

    def _propose_cohort(self, rows: list[Request], K: int, sampling: Any) -> Unit:
        """A batched drafter over rows sharing depth K and sampling settings: one ``propose``, its
        randomness keyed by each row's seed (``noise``) where the drafter takes it."""
        drafter = self.drafters.fresh(0)
        if K == 0:
            return self._plain_unit(rows, drafter)
        state = group_state(rows, sampling, self.tokens_SL)
        state.tree_ok = self._trees_now
        kwargs = {"noise": PositionNoise([r.params.seed for r in rows])} if self.drafters.keyed else {}
        proposal = drafter.propose(state, K, None, **kwargs)
        return self._unit(proposal, rows, drafter, K, self.stats["steps"] + 1)

    def _propose_slots(self, rows: list[Request], depths: list[int]) -> list[Unit]:
        """The slot drafter over every decoding row at once: one ``propose`` (its randomness keyed by
        each row's seed), its ragged chains split into units of rows sharing count and sampling."""
        drafter = self.drafters.slots
        units: list[Unit] = []
        plain: dict[Any, list[Request]] = {}
        for r, K in zip(rows, depths, strict=True):
            if K == 0:
                plain.setdefault(r.params.sampling, []).append(r)
        units += [self._plain_unit(group, drafter) for group in plain.values()]
        drafting = [(r, K) for r, K in zip(rows, depths, strict=True) if K > 0]
        if not drafting:
            return units
        rows = [r for r, _ in drafting]
        state = group_state(rows, rows[0].params.sampling, self.tokens_SL)
        state.tree_ok = self._trees_now
        caught_tokens, caught = drafter.catch_up_tokens, drafter.catch_up_s
        proposal = drafter.propose(
            [r.slot for r in rows],
            [K for _, K in drafting],
            state=state,
            sampling=[r.params.sampling for r in rows],
            noise=PositionNoise([r.params.seed for r in rows]),
        )
        self._note_catch_up(drafter.catch_up_tokens - caught_tokens, drafter.catch_up_s - caught)
        step = self.stats["steps"] + 1
        if proposal.tree is not None:  # one row's token tree (a step of one row where trees pay)
            return units + [self._unit(proposal.tree, rows, drafter, drafting[0][1], step)]
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault((proposal.counts_B[i], r.params.sampling), []).append(i)
        for (count, sampling), index in groups.items():
            chains = proposal.chains(index, sampling.greedy)
            units.append(self._unit(chains, [rows[i] for i in index], drafter, count, step))
        return units

    def _decode(self, rows: list[Request], depths: list[int], changed: dict[str, list[int]]) -> int:
        """Draft, verify and commit every decoding row; returns the tokens the target ran (padding
        and tree nodes included), which the step's budget pays for."""
        t0 = self.now()
        self._trees_now = self.tree_pays and len(rows) == 1  # a tree would take a forward of its own
        caught0, self._steady = _catch_up_seconds(rows), True
        units: list[Unit] = []
        if self.drafters.slots is not None:
            units = self._propose_slots(rows, depths)
        elif self.drafters.batched:
            cohorts: dict[tuple, list[Request]] = {}
            for r, K in zip(rows, depths, strict=True):
                cohorts.setdefault((K, r.params.sampling), []).append(r)
            units = [self._propose_cohort(group, K, s) for (K, s), group in cohorts.items()]
        else:
            units = [self._propose(r, K) for r, K in zip(rows, depths, strict=True)]
        t1 = self.now()
        G = sum(1 for K in depths if K > 0)
        if G:  # the drafting cost of G rows at this depth, apart from the catch-up owed for committed tokens
            caught = _catch_up_seconds(rows) - caught0
            self.draft_cost.learn(G, max(depths), max(0.0, t1 - t0 - caught))
            if caught > 0 and self._steady:
                self.draft_cost.learn_catch_up(G, caught)
        self.stats["draft_s"] += t1 - t0
        units = merge_chains(units)
        chains = [u for u in units if isinstance(u.block, ChainBlock)]
        groups = [chains] if chains else []
        groups += [[u] for u in units if isinstance(u.block, TreeBlock)]
        forwarded = 0
        for g, group in enumerate(groups):
            forwarded += self._verify_group(group, changed, draft_s=(t1 - t0) if g == 0 else 0.0)
        return forwarded

    def _verify_group(self, units: list[Unit], changed: dict[str, list[int]], *, draft_s: float) -> int:
        """One target forward over these units' blocks (chains padded to the longest), every unit's
        verdict on the target's device, one read of them all (:class:`HostTransfer`), then per unit:
        commit, settle, observe; returns the tokens forwarded (rows x the longest block)."""
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
            tokens_BT = torch.zeros((len(rows), T_max), dtype=torch.long)
            tokens_BT = tokens_BT if where == "cpu" else tokens_BT.to(where)
            r0 = 0
            for u in units:
                seq = u.block.tokens_BT(roots_B[r0 : r0 + u.size])
                tokens_BT[r0 : r0 + u.size, : seq.shape[1]] = seq
                r0 += u.size
        t0 = self.now()
        out = self.target.forward(tokens_BT, start_B, rows_B=rows_B, **units[0].block.forward_kwargs("cpu"))
        t1 = self.now()
        self.stats["forward_s"] += t1 - t0
        step = self.stats["steps"] + 1
        transfer = HostTransfer(out.logits_BTV.device)
        faults = [f for u in units for f in u.faults]
        if avoids_host(out.logits_BTV):
            faults.append(logits_faults(out.logits_BTV))
        else:
            check_logits(out.logits_BTV, step=step, source="the target")
        if faults:
            transfer.add("faults", torch.stack([f.to(transfer.device) for f in faults]))
        t_rule = self.now()
        outs, r0 = [], 0
        for i, u in enumerate(units):
            outs.append(slice_output(out, r0, r0 + u.size, u.block.num_drafted + 1))
            verdict = self._verdict(u, outs[-1], start_B[r0 : r0 + u.size])
            for name, part in zip(("tokens", "accepted", "path"), verdict, strict=True):
                if part is not None:
                    transfer.add(f"{name}{i}", part)
            r0 += u.size
        fetched = transfer.fetch()  # the step's one read
        self.stats["rule_s"] += self.now() - t_rule
        recheck = lambda: check_logits(out.logits_BTV, step=step, source="the target")  # noqa: E731
        raise_faults(fetched, [recheck] + [c for u in units for c in u.rechecks])
        accepted: list[int] = []
        observe_s, r0 = 0.0, 0
        for i, u in enumerate(units):
            r1 = r0 + u.size
            path = fetched.get(f"path{i}")
            verdict = Verdict(
                torch.from_numpy(fetched[f"tokens{i}"]),
                torch.from_numpy(fetched[f"accepted{i}"]),
                None if path is None else torch.from_numpy(path),
            )
            a, dt = self._settle(u, outs[i], verdict, start_B[r0:r1], rows_B[r0:r1], changed)
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
        return len(rows) * T_max

    def _rule_kwargs(
        self, rows: list[Request], start_G: torch.Tensor, block: Any, T: int, device: Any
    ) -> dict[str, Any]:
        """The rule's noise and positions on ``device``: the output-stream index of the token each
        block position decides (docs/randomness.md)."""
        prompt_G = torch.tensor([len(r.prompt_ids) for r in rows], dtype=torch.long)
        offsets_T = block.forward_kwargs("cpu").get("depth_T", torch.arange(T))
        positions_GT = (start_G + 1 - prompt_G).unsqueeze(1) + offsets_T
        noise = PositionNoise([r.params.seed for r in rows], device=device)
        return {"noise": noise, "positions_BK": positions_GT.to(device)}

    def _verdict(self, unit: Unit, out: TargetOutput, start_G: torch.Tensor) -> Verdict:
        """One unit's verdict by the rule, where the logits are, with the rows' keyed noise."""
        rows, block = unit.rows, unit.block
        sampling = rows[0].params.sampling
        T = block.num_drafted + 1
        logits_BTV = out.logits_BTV
        fast = (
            block.verify_greedy(self.rule, logits_BTV)
            if sampling.greedy and isinstance(block, ChainBlock)
            else None
        )
        if fast is not None:  # argmax matching: no noise
            return fast
        kwargs = self._rule_kwargs(rows, start_G, block, T, logits_BTV.device)
        return block.verify(self.rule, logits_BTV, sampling, **kwargs)

    def _settle(
        self,
        unit: Unit,
        out: TargetOutput,
        verdict: Verdict,
        start_G: torch.Tensor,
        rows_G: torch.Tensor,
        changed: dict[str, list[int]],
    ) -> tuple[list[int], float]:
        """Commit, settle and observe one unit from its verdict on the host; returns (accepted drafts
        per row, observe s)."""
        rows, block = unit.rows, unit.block
        sampling = rows[0].params.sampling
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
            self._commit(request, tokens[i][: a + 1], changed, logits_TV)
        observed = block.settle(
            self.target, out, verdict, start_G, torch.tensor(lengths, dtype=torch.long), rows_B=rows_G
        )
        t0 = self.now()
        if unit.drafter is not None and unit.drafter is self.drafters.slots:
            live = [i for i, r in enumerate(rows) if r.status is RequestStatus.DECODE]
            if live:
                unit.drafter.observe(
                    [rows[i].slot for i in live],
                    [accepted[i] for i in live],
                    select_rows(observed, live),
                    state=group_state([rows[i] for i in live], sampling, self.tokens_SL),
                )
        elif unit.drafter is not None and not getattr(unit.drafter, "observes", True):
            pass  # a batched drafter that keeps nothing from the verified block (``none``)
        elif unit.drafter is not None:
            live = [i for i, r in enumerate(rows) if r.status is RequestStatus.DECODE]
            if len(live) == len(rows):  # every row goes on: the outputs as they are (no copy)
                state = group_state(rows, sampling, self.tokens_SL)
                sub = TargetOutput(observed.logits_BTV, observed.hidden_BTD)
                unit.drafter.observe(state, verdict.num_accepted_B, sub)
            elif live:
                state = group_state([rows[i] for i in live], sampling, self.tokens_SL)
                index = torch.tensor(live)
                sub = TargetOutput(
                    observed.logits_BTV[index],
                    None if observed.hidden_BTD is None else observed.hidden_BTD[index],
                )
                unit.drafter.observe(state, verdict.num_accepted_B[index], sub)
        else:
            for i, request in enumerate(rows):
                if request.status is RequestStatus.DECODE:
                    request.drafter.observe(
                        request.state,
                        verdict.num_accepted_B[i : i + 1],
                        row_output(observed, i, observed.logits_BTV.shape[1]),
                    )
        observe_s = self.now() - t0
        self.stats["draft_s"] += observe_s
        return accepted, observe_s
