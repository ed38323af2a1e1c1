"""Two pieces of the engine's depth control that cost nothing in correctness but matter for speed:

- probes share a step: a probe pads the whole verify forward to two tokens, so once one row is due
  (``PROBE_EVERY`` plain steps), the free rows idle at least half as long probe with it;
- the per-drafted-token draft time the goodput policy reads leaves out a drafter's lazy catch-up
  (``catch_up_s``), which is owed for committed tokens whatever the depth.

A table target (``_tiny.TableTarget``) and a fake clock: nothing is timed for real.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _tiny import TableTarget, random_table

from specdec.engine import Engine
from specdec.engine.cost_model import OnlineVerifyCost, VerifyCostModel
from specdec.engine.depth import DepthPolicy, RowView
from specdec.engine.draft_cost import PerTokenDraftCost
from specdec.engine.request import RequestStatus
from specdec.engine.scheduler import PROBE_ACCEPTANCE, PROBE_COST_RATIO, PROBE_EVERY
from specdec.protocols import DecodeState, Proposal, TargetOutput


class PlainSteps(DepthPolicy):
    """Depth 0 for every row (so only probes draft); γ 4."""

    gamma = 4

    def depths(self, rows: list[RowView], cost: Any, t_draft: float) -> list[int]:
        return [0] * len(rows)


def _decoding(engine: Engine, temperatures: list[float]) -> list[Any]:
    for k, temperature in enumerate(temperatures):
        engine.add_request([1 + k, 2, 3], max_new_tokens=40, temperature=temperature, seed=k)
    while sum(r.status is RequestStatus.DECODE for r in engine.running) < len(temperatures):
        engine.step()
    return [r for r in engine.running if r.status is RequestStatus.DECODE]


def test_rows_half_way_to_a_probe_probe_with_the_row_that_is_due():
    engine = Engine(
        TableTarget(random_table(16, seed=0)), drafter="none", gamma=PlainSteps(), measure_cost=False
    )
    rows = _decoding(engine, [0.0, 0.0, 0.0, 0.0, 0.8])  # the last sampled: its depth is pinned
    assert engine.scheduler._depths(rows) == [0, 0, 0, 0, 0]  # nobody due
    for r, idle in zip(rows, (PROBE_EVERY - 1, PROBE_EVERY // 2, 3, 0, PROBE_EVERY), strict=True):
        r.idle_steps = idle
    assert engine.scheduler._depths(rows) == [0, 0, 0, 0, 0]  # no free row due (the sampled row never probes)
    rows[0].idle_steps = PROBE_EVERY
    assert engine.scheduler._depths(rows) == [1, 1, 0, 0, 0]  # the due row, and the one half-way there
    # Where a 2-token block of these 5 rows costs much more than one token, nobody probes.
    for ratio, want in ((PROBE_COST_RATIO + 0.05, [0] * 5), (PROBE_COST_RATIO - 0.05, [1, 1, 0, 0, 0])):
        engine.scheduler.cost = OnlineVerifyCost(VerifyCostModel((1, 8), (1, 2), ((1.0, ratio),) * 2))
        assert engine.scheduler._depths(rows) == want, ratio
    # Nor where the drafters' own costs are such that a drafted token could not pay even if the
    # target accepted it at PROBE_ACCEPTANCE: a cheap 2-token block, but each draft costs a step.
    engine.scheduler.cost = OnlineVerifyCost(VerifyCostModel((1, 8), (1, 2), ((1.0, 1.1),) * 2))
    B = len(rows)
    pays = (1 + PROBE_ACCEPTANCE) / 1.1 - 1  # extra tokens per unit of time beyond a plain step
    for t_catch, want in ((1.2 * pays * 1.1 / B, [0] * 5), (0.8 * pays * 1.1 / B, [1, 1, 0, 0, 0])):
        engine.scheduler.draft_cost = PerTokenDraftCost(0.0, overhead=t_catch)  # each drafting row's catch-up
        assert engine.scheduler._depths(rows) == want, t_catch


class SlowCatchUp:
    """A drafter proposing ``K`` copies of the last token; each propose advances the engine's fake
    clock by ``catch_up`` seconds of catch-up of ``caught`` positions (counted in ``catch_up_s`` and
    ``catch_up_tokens``) plus ``per_token`` per drafted token."""

    def __init__(self, clock: list[float], catch_up: float, per_token: float, caught: int = 2) -> None:
        self.clock, self.catch_up, self.per_token, self.caught = clock, catch_up, per_token, caught
        self.catch_up_s = 0.0
        self.catch_up_tokens = 0

    def begin(self, state: DecodeState, target_out: TargetOutput) -> None:
        pass

    def propose(self, state: DecodeState, gamma: int, generator: torch.Generator | None = None) -> Proposal:
        self.clock[0] += self.catch_up + self.per_token * gamma
        self.catch_up_s += self.catch_up
        self.catch_up_tokens += self.caught
        return Proposal(state.last_tokens_B()[:, None].repeat(1, gamma))

    def observe(self, state: DecodeState, num_accepted_B: torch.Tensor, target_out: TargetOutput) -> None:
        pass


def _run_slow(catch_up: float, caught: int) -> Engine:
    """One request through an engine whose drafter is a :class:`SlowCatchUp` on a fake clock."""
    clock = [0.0]
    drafter = SlowCatchUp(clock, catch_up, per_token=0.01, caught=caught)
    engine = Engine(
        TableTarget(random_table(16, seed=1)), drafter=drafter, gamma=3, max_num_seqs=1, measure_cost=False
    )
    engine.now = lambda: clock[0]
    engine.add_request([1, 2, 3], max_new_tokens=12, temperature=0.0)
    while engine.has_unfinished():
        engine.step()
    return engine


@pytest.mark.parametrize("catch_up", [0.0, 0.5])
def test_the_draft_cost_per_token_leaves_out_the_catch_up(catch_up):
    engine = _run_slow(catch_up, caught=2)
    assert engine.scheduler.draft_cost.position == {1: pytest.approx(0.01)}  # one row: per draft position
    # the catch-up a drafting step pays, apart (none learned where it took no time)
    assert engine.scheduler.draft_cost.catch == ({1: pytest.approx(catch_up)} if catch_up else {})


def test_a_long_catch_up_is_not_the_cost_of_drafting_on():
    """A catch-up of more positions than one step commits (after idle or lookup steps) is paid once:
    it does not count as what each drafting step costs."""
    engine = _run_slow(0.5, caught=9)  # gamma 3: at most 4 positions per step
    assert engine.scheduler.draft_cost.catch == {} and engine.scheduler.draft_cost.position == {
        1: pytest.approx(0.01)
    }


class ClockedTable(TableTarget):
    """A table target whose forward of T tokens per row advances a fake clock by 2 + 0.5 (T - 1)."""

    def __init__(self, table: torch.Tensor, clock: list[float]) -> None:
        super().__init__(table)
        self.clock = clock

    def forward(self, tokens_BT, start_B, rows_B=None, **kwargs):
        self.clock[0] += 2.0 + 0.5 * (tokens_BT.shape[1] - 1)
        return super().forward(tokens_BT, start_B, rows_B=rows_B, **kwargs)


def test_the_engine_scales_the_verify_cost_by_its_own_forwards():
    """Every chain verify forward is observed: a grid at half the engine's forward times reads 2x."""
    clock = [0.0]
    engine = Engine(
        ClockedTable(random_table(16, seed=1), clock), drafter="ngram", gamma="goodput", max_num_seqs=1,
        measure_cost=False,
    )  # fmt: skip
    engine.now = lambda: clock[0]
    grid = VerifyCostModel((1,), (1, 2, 5), ((1.0, 1.25, 2.0),))  # 1 + 0.25 (T - 1)
    engine.scheduler.cost = OnlineVerifyCost(grid, min_samples=4)
    engine.add_request([1, 2, 3], max_new_tokens=16, temperature=0.0)
    while engine.has_unfinished():
        engine.step()
    assert engine.cost is engine.scheduler.cost
    assert engine.cost.scale(1) == pytest.approx(2.0)
    assert engine.cost.cost(1, 3) == pytest.approx(2.0 * 1.5)
