"""A step's drafts: the engine's one slot drafter over every drafting row, split into verify units.

Legend: G rows of a unit, K a row's draft depth.

Rows at depth 0 become empty chains without asking the drafter (under load most rows sit there); a
row whose grammar forces its whole depth proposes those tokens without the drafter
(:mod:`specdec.engine.grammar_drafts`); every other drafting row goes into **one**
:class:`~specdec.protocols.DraftCall`. The ragged proposal is cut at each row's grammar
(:func:`~specdec.engine.grammar_drafts.shape_chains`) and split into units of rows sharing draft count
and sampling settings (a token tree is a unit of its own), each checked before the target sees it
(:func:`~specdec.engine.units.checked_unit`). The call's catch-up (``SlotProposal.catch_up_s``) goes
into the step's report apart from drafting on.
"""

from __future__ import annotations

from typing import Any

import torch

from specdec.engine.faults import each_alone
from specdec.engine.grammar_drafts import shape_chains
from specdec.engine.judge import Fail
from specdec.engine.plan import RowPlan, StepReport
from specdec.engine.request import Request
from specdec.engine.units import Unit, checked_unit, group_state
from specdec.protocols import DraftCall, Proposal, SlotDrafter, SlotProposal
from specdec.verify.blocks import make_block
from specdec.verify.noise import PositionNoise

__all__ = ["Drafting"]


class Drafting:
    """The drafting part of a step (see the module doc); ``stats``: the engine's time counters."""

    def __init__(
        self,
        *,
        target: Any,
        drafter: SlotDrafter,
        drafter_name: str,
        tokens_SL: torch.Tensor,
        max_model_len: int,
        gamma_max: int,
        stats: dict[str, float],
    ) -> None:
        self.target, self.drafter, self.drafter_name = target, drafter, drafter_name
        self.tokens_SL, self.max_model_len, self.gamma_max, self.stats = (
            tokens_SL,
            max_model_len,
            gamma_max,
            stats,
        )

    def plain_unit(self, rows: list[Request]) -> Unit:
        """Rows at depth 0: an empty chain, built without asking the drafter (it would propose
        nothing, and under load most rows sit at depth 0)."""
        return Unit(rows, make_block(Proposal(torch.zeros((len(rows), 0), dtype=torch.long)), self.target))

    def units(self, plan: tuple[RowPlan, ...], tree_ok: bool, report: StepReport, fail: Fail) -> list[Unit]:
        """The step's units: the rows at depth 0 as empty chains, a row whose grammar forces its whole
        depth as those tokens, and the slot drafter over every other drafting row at once: one
        ``propose`` (its randomness keyed by each row's seed), its ragged chains split into units of
        rows sharing count and sampling. A call that raises is made again for each row alone; a row
        whose own call raises fails (``fail``), as does a row whose own proposal fails its check."""
        plain: dict[Any, list[Request]] = {}
        for p in plan:
            if p.depth == 0:
                plain.setdefault(p.request.params.sampling, []).append(p.request)
        units = [self.plain_unit(group) for group in plain.values()]
        drafting = []
        for p in plan:
            if p.depth > 0 and len(p.forced) >= p.depth:  # the grammar forces the whole depth:
                forced = Proposal(torch.tensor([p.forced[: p.depth]], dtype=torch.long))  # no drafter
                units.append(self._unit(forced, [p.request], p.depth))
            elif p.depth > 0:  # the drafter drafts (what the grammar forces comes after its chain)
                drafting.append(p)
        if not drafting:
            return units
        drafter = self.drafter

        def propose(part: list[RowPlan]) -> SlotProposal:
            rows = [p.request for p in part]
            processors = [r.processors for r in rows]  # each row's, for a drafter with a distribution
            call = DraftCall(
                [r.slot for r in rows],
                [p.depth for p in part],
                group_state(rows, rows[0].params.sampling, self.tokens_SL),
                [r.params.sampling for r in rows],
                PositionNoise([r.params.seed for r in rows]),
                tree_ok,
                processors if any(p is not None for p in processors) else None,
            )
            return drafter.propose(call)

        failed = lambda p, err: fail(p.request, "drafting", err)  # noqa: E731
        proposals = each_alone(drafting, propose, failed)
        report.draft_rows, report.draft_depth = len(drafting), max(p.depth for p in drafting)
        report.catch_up_s = sum(proposal.catch_up_s for _, proposal in proposals)
        # More than one step's committed tokens caught up (a prompt, or tokens of idle or lookup
        # steps) is work owed once, not a cost of drafting on: not learned, counted in owed_s.
        if max((proposal.catch_up_tokens for _, proposal in proposals), default=0) > self.gamma_max + 1:
            report.steady = False
            self.stats["owed_s"] += report.catch_up_s
        for part, proposal in proposals:
            proposal = shape_chains(proposal, [p.request for p in part], [p.depth for p in part])
            units += self._split(part, proposal, fail)
        return units

    def _split(self, drafting: list[RowPlan], proposal: SlotProposal, fail: Fail) -> list[Unit]:
        """One proposal's units, each checked; a row whose own proposal fails its check fails."""
        rows = [p.request for p in drafting]
        failed = lambda i, err: fail(rows[i], "the draft's check", err)  # noqa: E731
        if proposal.tree is not None:  # one row's token tree (a step of one row where trees pay)
            parts = [([0], proposal.tree, drafting[0].depth)]
        else:
            parts = [(index, tree, max(drafting[i].depth for i in index)) for index, tree in proposal.trees]
            in_trees = {i for index, _ in proposal.trees for i in index}
            groups: dict[tuple, list[int]] = {}
            for i, r in enumerate(rows):
                if i not in in_trees:
                    groups.setdefault((proposal.counts_B[i], r.params.sampling), []).append(i)
            for (count, sampling), index in groups.items():
                parts.append((index, proposal.chains(index, sampling.greedy), count))
        units = []
        for index, proposal_G, K in parts:
            if proposal_G.tree is not None:  # a tree (of one row, or a cohort's shared one) is one draft
                try:
                    units.append(self._unit(proposal_G, [rows[i] for i in index], K))
                except Exception as err:
                    for i in index:
                        failed(i, err)
                continue

            def check(
                sub: list[int], index: list[int] = index, K: int = K, chains: Proposal = proposal_G
            ) -> Unit:
                if len(sub) < len(index):  # the rows' own chains
                    chains = proposal.chains(sub, rows[sub[0]].params.sampling.greedy)
                return self._unit(chains, [rows[i] for i in sub], K)

            units += [unit for _, unit in each_alone(index, check, failed)]
        return units

    def _unit(self, proposal: Any, rows: list[Request], K: int) -> Unit:
        return checked_unit(
            proposal, rows, K, target=self.target, max_model_len=self.max_model_len, source=self.drafter_name
        )
