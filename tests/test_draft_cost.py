"""The engine's drafting cost by drafting rows and depth (:mod:`specdec.engine.draft_cost`), and the
goodput policy reading it: batched drafting that costs little more at 8 rows than at one lets the
policy draft under load, where a cost charged per row would stop it."""

from __future__ import annotations

import pytest

from specdec.engine.cost_model import VerifyCostModel
from specdec.engine.depth import GoodputDepth, RowView
from specdec.engine.draft_cost import DraftCost, PerTokenDraftCost


def test_tables_interpolate_in_rows_and_scale_past_the_largest_measured():
    cost = DraftCost()
    assert not cost.known and cost.step_seconds([3, 3]) == 0.0
    cost.learn(1, 3, 0.003)  # 1 ms per position at one row
    cost.learn(4, 2, 0.004)  # 2 ms per position at four rows
    cost.learn_catch_up(1, 0.0005)
    assert cost.known
    assert cost.step_seconds([0, 0]) == 0.0
    assert cost.step_seconds([3]) == pytest.approx(0.0005 + 3 * 0.001)
    # G = 2: catch-up linear past G = 1, the position cost between G = 1 and G = 4
    assert cost.step_seconds([2, 0, 1]) == pytest.approx(2 * 0.0005 + 2 * (0.001 + 0.001 / 3))
    assert cost.step_seconds([1] * 8) == pytest.approx(0.0005 * 8 + 0.002 * 2)  # past G = 4: linear
    cost.learn(1, 1, 0.002)  # an exponential average: 0.8 old + 0.2 new
    assert cost.position[1] == pytest.approx(0.8 * 0.001 + 0.2 * 0.002)
    cost.learn(4, 1, 1.0)  # one very slow step counts as twice the estimate
    assert cost.position[4] == pytest.approx(0.8 * 0.002 + 0.2 * 0.004)
    cost.position[2] = 0.01  # noise: more than at four rows
    cost.make_monotone()
    assert cost.position[2] == cost.position[4]


def test_bad_measurements_are_not_learned():
    cost = DraftCost()
    cost.learn(0, 3, 1.0)
    cost.learn(2, 0, 1.0)
    cost.learn(2, 3, -1.0)
    assert cost.position == {}


def test_a_float_t_draft_charges_each_row():
    assert PerTokenDraftCost(0.01, overhead=0.1).step_seconds([2, 0, 3]) == pytest.approx(0.05 + 0.2)


def test_goodput_drafts_under_load_where_drafting_is_batched():
    """8 rows of acceptance 0.7, a block of 4 tokens costing 1.3x one token: at 1.5 ms per draft token
    and row (per-request drafters) drafting does not pay; at the same cost for one row growing to only
    2x at 8 rows (one slot drafter), it does."""
    verify = VerifyCostModel((1, 8), (1, 2, 4), ((0.010, 0.011, 0.013), (0.020, 0.022, 0.026)))
    rows = [RowView([0.7] * 3, 3, True)] * 8
    policy = GoodputDepth(gamma=3)
    assert policy.depths(rows, verify, 0.0015) == [0] * 8
    batched = DraftCost()
    batched.learn(1, 3, 3 * 0.0015)
    batched.learn(8, 3, 3 * 0.003)
    assert policy.depths(rows, verify, batched)[0] > 0
