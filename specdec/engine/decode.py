"""The decode half of an engine step: propose, one verify forward, then verify, commit, settle and
observe each unit of rows (:mod:`specdec.engine.units`).

Legend: B rows decoding in a step, G rows of a unit, K a row's draft depth, T = K + 1 its verify
block, T_max the step's longest block, V vocabulary.

:class:`DecodeSteps` is the part of :class:`specdec.engine.Engine` that runs decoding rows (the engine
holds the scheduling, the prefill and the public API). Randomness: a per-request drafter draws from a
generator keyed by (request seed, output position) (:func:`mix_seed`); a batched drafter gets the
rows' :class:`~specdec.noise.PositionNoise`; the keyed rules get the rows' noise and positions, a rule
drawing from a generator one generator per row, keyed the same way. So what a row emits never depends
on the rows beside it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from specdec.blocks import ChainBlock, TreeBlock, make_block
from specdec.checks import check_logits, check_proposal
from specdec.engine.request import Request, RequestStatus
from specdec.engine.units import (
    Unit,
    group_state,
    join_verdicts,
    merge_chains,
    row_block,
    row_output,
    slice_output,
)
from specdec.metrics import StepStats
from specdec.noise import PositionNoise
from specdec.protocols import Proposal, TargetOutput

__all__ = ["DecodeSteps", "mix_seed", "on_host"]

_DECAY = 0.97  # forgetting of the acceptance estimates a_k per request


def mix_seed(seed: int, position: int, salt: int) -> int:
    """A 64-bit seed for a torch.Generator from (request seed, position, use): splitmix64."""
    z = (seed + 0x9E3779B97F4A7C15 * (position + 1) + salt) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def on_host(out: TargetOutput) -> TargetOutput:
    """A target's output with its logits on the CPU: the engine decides every token on the host
    (its keyed noise, generators and token table live there), whatever device the target runs on.
    The features stay on the target's device, for the drafters that run there."""
    if out.logits_BTV.device.type == "cpu":
        return out
    return TargetOutput(out.logits_BTV.cpu(), out.hidden_BTD, out.aux_hidden_BTD)


def _off_host(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


def proposal_on_host(proposal: Proposal) -> Proposal:
    """A drafter's proposal on the CPU (a drafter may run on the target's device; the engine
    verifies on the host, see :func:`on_host`). Anything else, and what is not a tensor, is left as
    it is, for :func:`~specdec.checks.check_proposal` to refuse with its message."""
    if not isinstance(proposal, Proposal):
        return proposal
    tree = proposal.tree
    parts = [proposal.tokens_BK, proposal.probs_BKV]
    if tree is not None:
        parts += [getattr(tree, "tokens_BN", None), getattr(tree, "draft_probs_BNV", None)]
    if not any(_off_host(t) for t in parts):
        return proposal
    cpu = lambda t: t.cpu() if _off_host(t) else t
    if tree is not None:
        tree = replace(tree, tokens_BN=cpu(tree.tokens_BN), draft_probs_BNV=cpu(tree.draft_probs_BNV))
    return Proposal(cpu(proposal.tokens_BK), cpu(proposal.probs_BKV), tree)


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
        caught = getattr(drafter, "catch_up_s", None)
        caught_tokens = getattr(drafter, "catch_up_tokens", 0)
        proposal = proposal_on_host(drafter.propose(request.state, K, generator))
        tokens = getattr(drafter, "catch_up_tokens", 0) - caught_tokens
        if caught is not None and 0 < tokens <= self.gamma_max + 1:
            # a catch-up of one step's committed tokens: what every step of a row drafting on pays
            # (after idle or lookup steps it is larger, once: not a cost of drafting on)
            spent = drafter.catch_up_s - caught
            self.t_catch = spent if self.t_catch == 0 else 0.8 * self.t_catch + 0.2 * spent
        check_proposal(
            proposal,
            batch_size=1,
            gamma=K,
            vocab_size=self.vocab_size,
            step=request.metrics.num_steps + 1,
            source=self.drafter_name,
        )
        return Unit([request], make_block(self._fit_tree(proposal, [request]), self.target))

    def _propose_cohort(self, rows: list[Request], K: int, sampling: Any) -> Unit:
        """A batched drafter over rows sharing depth K and sampling settings: one ``propose``, its
        randomness keyed by each row's seed (``noise``) where the drafter takes it."""
        drafter = self.drafters.fresh(0)
        if K == 0:
            return self._plain_unit(rows, drafter)
        state = group_state(rows, sampling, self.tokens_SL)
        state.tree_ok = self._trees_now
        kwargs = {"noise": PositionNoise([r.params.seed for r in rows])} if self.drafters.keyed else {}
        proposal = proposal_on_host(drafter.propose(state, K, None, **kwargs))
        check_proposal(
            proposal,
            batch_size=len(rows),
            gamma=K,
            vocab_size=self.vocab_size,
            step=self.stats["steps"] + 1,
            source=self.drafter_name,
        )
        return Unit(rows, make_block(self._fit_tree(proposal, rows), self.target), drafter)

    def _decode(self, rows: list[Request], depths: list[int], changed: dict[str, list[int]]) -> int:
        """Draft, verify and commit every decoding row; returns the tokens the target ran (padding
        and tree nodes included), which the step's budget pays for."""
        t0 = self.now()
        self._trees_now = self.tree_pays and len(rows) == 1  # a tree would take a forward of its own
        caught0 = _catch_up_seconds(rows)
        units: list[Unit] = []
        if self.drafters.batched:
            cohorts: dict[tuple, list[Request]] = {}
            for r, K in zip(rows, depths, strict=True):
                cohorts.setdefault((K, r.params.sampling), []).append(r)
            units = [self._propose_cohort(group, K, s) for (K, s), group in cohorts.items()]
        else:
            units = [self._propose(r, K) for r, K in zip(rows, depths, strict=True)]
        t1 = self.now()
        drafted = sum(u.block.num_drafted * u.size for u in units)
        if drafted:  # a lazy catch-up is owed for committed tokens whatever the depth: not a draft cost
            per_token = max(0.0, t1 - t0 - (_catch_up_seconds(rows) - caught0)) / drafted
            self.t_draft = per_token if self.t_draft == 0 else 0.8 * self.t_draft + 0.2 * per_token
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
        """One target forward over these units' blocks (chains padded to the longest), then per unit:
        verify, commit, settle, observe; returns the tokens forwarded (rows x the longest block)."""
        rows = [r for u in units for r in u.rows]
        roots_B = torch.tensor([r.generated[-1] for r in rows], dtype=torch.long)
        start_B = torch.tensor([r.length - 1 for r in rows], dtype=torch.long)
        rows_B = torch.tensor([r.slot for r in rows], dtype=torch.long)
        T_max = max(u.block.num_drafted for u in units) + 1
        if len(units) == 1:
            tokens_BT = units[0].block.tokens_BT(roots_B)
        else:
            tokens_BT = torch.zeros((len(rows), T_max), dtype=torch.long)
            r0 = 0
            for u in units:
                seq = u.block.tokens_BT(roots_B[r0 : r0 + u.size])
                tokens_BT[r0 : r0 + u.size, : seq.shape[1]] = seq
                r0 += u.size
        t0 = self.now()
        out = on_host(
            self.target.forward(tokens_BT, start_B, rows_B=rows_B, **units[0].block.forward_kwargs("cpu"))
        )
        t1 = self.now()
        self.stats["forward_s"] += t1 - t0
        check_logits(out.logits_BTV, step=self.stats["steps"] + 1, source="the target")
        accepted: list[int] = []
        observe_s, r0 = 0.0, 0
        for u in units:
            r1 = r0 + u.size
            unit_out = slice_output(out, r0, r1, u.block.num_drafted + 1)
            a, dt = self._settle(u, unit_out, start_B[r0:r1], rows_B[r0:r1], changed)
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

    def _rule_kwargs(self, rows: list[Request], start_G: torch.Tensor, block: Any, T: int) -> dict[str, Any]:
        """The keyed rule's noise and positions: the output-stream index of the token each block
        position decides (docs/randomness.md)."""
        prompt_G = torch.tensor([len(r.prompt_ids) for r in rows], dtype=torch.long)
        offsets_T = block.forward_kwargs("cpu").get("depth_T", torch.arange(T))
        positions_GT = (start_G + 1 - prompt_G).unsqueeze(1) + offsets_T
        return {"noise": PositionNoise([r.params.seed for r in rows]), "positions_BK": positions_GT}

    def _settle(
        self, unit: Unit, out: TargetOutput, start_G: torch.Tensor, rows_G: torch.Tensor, changed
    ) -> tuple[list[int], float]:
        """Verify, commit, settle and observe one unit; returns (accepted drafts per row, observe s)."""
        rows, block = unit.rows, unit.block
        sampling = rows[0].params.sampling
        T = block.num_drafted + 1
        t_rule = self.now()
        fast = (
            block.verify_greedy(self.rule, out.logits_BTV)
            if sampling.greedy and isinstance(block, ChainBlock)
            else None
        )
        if fast is not None:  # argmax matching: no noise, no generator (a keyed rule's too)
            verdict = fast
        elif self.keyed:
            verdict = block.verify(
                self.rule, out.logits_BTV, sampling, None, **self._rule_kwargs(rows, start_G, block, T)
            )
        elif sampling.greedy:
            verdict = block.verify(self.rule, out.logits_BTV, sampling, None)
        else:  # a rule drawing from a generator: one per row, keyed by its seed and position
            verdicts = []
            for i, r in enumerate(rows):
                position = int(start_G[i]) + 1 - len(r.prompt_ids)
                generator = torch.Generator().manual_seed(mix_seed(r.params.seed, position, 2))
                one = row_block(block, i)
                verdicts.append(one.verify(self.rule, out.logits_BTV[i : i + 1], sampling, generator))
            verdict = join_verdicts(verdicts)
        self.stats["rule_s"] += self.now() - t_rule
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
        if unit.drafter is not None and not getattr(unit.drafter, "observes", True):
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
