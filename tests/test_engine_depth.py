"""The engine's depth policies and verify-cost model (:mod:`specdec.engine.depth`,
:mod:`specdec.engine.cost_model`): pure functions of acceptance estimates and a cost grid, no model.

Legend: B rows in a step, K draft depth, T = K + 1 tokens per row.
"""

from __future__ import annotations

import pytest

from specdec.engine.cost_model import MIN_CALLS, OnlineVerifyCost, VerifyCostModel
from specdec.engine.depth import (
    DEPTH_POLICIES,
    BatchTableDepth,
    DepthPolicy,
    FixedDepth,
    GoodputDepth,
    RowView,
    expected_tokens,
    local_depth,
    make_depth_policy,
)
from specdec.metrics import expected_tokens_per_step


def rows(n: int, acceptance: float, *, cap: int = 6, free: bool = True) -> list[RowView]:
    return [RowView([acceptance] * cap, cap, free) for _ in range(n)]


def cost_model(per_token: float, per_row: float = 0.0) -> VerifyCostModel:
    """Seconds = 1 + per_token·(T − 1)·(1 + per_row·(B − 1)) on a (B, T) grid."""
    B_grid, T_grid = (1, 2, 4, 8), (1, 2, 3, 5, 8)
    seconds = tuple(
        tuple(1.0 + per_token * (T - 1) * (1.0 + per_row * (B - 1)) for T in T_grid) for B in B_grid
    )
    return VerifyCostModel(B_grid, T_grid, seconds)


# --- expected tokens and the request-local rule -----------------------------------------------
def test_expected_tokens_is_the_sum_of_acceptance_prefix_products():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([0.9, 0.5, 0.2], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    assert expected_tokens([1.0] * 4, 4) == 5.0
    assert expected_tokens([0.8, 0.8], 5) == pytest.approx(1 + 0.8 + 0.64)  # K beyond the estimates


def test_local_depth_drafts_only_when_acceptance_pays_for_the_draft_cost():
    assert local_depth(RowView([0.0] * 5, 5, False), 0.35) == 0
    assert local_depth(RowView([0.99] * 5, 5, False), 0.05) == 5
    assert local_depth(RowView([0.99] * 5, 3, False), 0.05) == 3  # the cap
    assert local_depth(RowView([0.99] * 5, 0, False), 0.05) == 0
    # a_1 = 0.9 then nothing: one draft pays (1.9 / 1.35 > 1), a second adds only cost.
    assert local_depth(RowView([0.9, 0.0, 0.0], 3, False), 0.35) == 1


# --- fixed ------------------------------------------------------------------------------------
def test_fixed_gives_every_row_gamma_capped_whatever_the_cost_and_acceptance():
    policy = FixedDepth(4)
    views = [RowView([0.0] * 6, 6, True), RowView([0.9] * 2, 2, False), RowView([], 0, True)]
    expensive = cost_model(per_token=100.0, per_row=10.0)
    assert policy.depths(views, None, 0.0) == [4, 2, 0]
    assert policy.depths(views, expensive, 1.0) == [4, 2, 0]
    assert make_depth_policy(4).depths(views, None, 0.0) == [4, 2, 0]


# --- batch-table --------------------------------------------------------------------------------
def test_batch_table_takes_the_entry_of_the_largest_size_at_most_b():
    policy = BatchTableDepth({1: 5, 4: 3, 8: 1})
    assert policy.gamma == 5
    for B, K in [(1, 5), (2, 5), (3, 5), (4, 3), (7, 3), (8, 1), (20, 1)]:
        assert policy.depth_for(B) == K
        assert policy.depths(rows(B, 0.5), None, 0.0) == [K] * B
    below = BatchTableDepth({2: 3, 4: 1})
    assert below.depth_for(1) == 3  # smaller than every size: the smallest size's entry
    capped = policy.depths([RowView([0.5] * 2, 2, True), RowView([0.5] * 6, 6, True)], None, 0.0)
    assert capped == [2, 5]
    assert BatchTableDepth({1: 5, 2: 4}, gamma=2).depths(rows(1, 0.5), None, 0.0) == [2]  # gamma caps


def test_pinned_rows_take_the_local_rule_whatever_the_batch_size():
    """A sampled ``exact`` row (``free=False``) drafts from its own acceptance only: the same depth in
    a batch of 1 and of 8, under every policy but ``fixed``, cost model or not."""
    pinned_high = RowView([0.95] * 6, 6, False)
    pinned_low = RowView([0.05] * 6, 6, False)
    want_high, want_low = local_depth(pinned_high, 0.35), local_depth(pinned_low, 0.35)
    assert want_high > 0 and want_low == 0
    expensive = cost_model(per_token=50.0, per_row=5.0)
    cheap = cost_model(per_token=0.0)
    for policy in (BatchTableDepth({1: 6, 4: 2, 8: 0}), GoodputDepth(gamma=6)):
        for cost in (None, expensive, cheap):
            for B in (1, 4, 8):
                others = rows(B - 1, 0.95)  # free rows that do follow the policy
                got = policy.depths([pinned_high, *others], cost, 0.0)
                assert got[0] == want_high, (type(policy).__name__, cost is not None, B)
                got = policy.depths([pinned_low, *others], cost, 0.0)
                assert got[0] == want_low
    # while the free rows of the same table follow the batch size
    assert BatchTableDepth({1: 6, 4: 2, 8: 0}).depths(rows(8, 0.95), None, 0.0) == [0] * 8


# --- goodput ------------------------------------------------------------------------------------
def test_goodput_picks_zero_when_blocks_are_expensive_and_acceptance_low():
    policy = GoodputDepth(gamma=6)
    expensive = cost_model(per_token=1.0)  # a T-token block costs T plain steps
    for B in (1, 4, 8):
        assert policy.depths(rows(B, 0.1), expensive, 0.0) == [0] * B


def test_goodput_drafts_deep_when_blocks_are_cheap_and_acceptance_high():
    policy = GoodputDepth(gamma=6)
    cheap = cost_model(per_token=0.01)
    for B in (1, 4, 8):
        assert policy.depths(rows(B, 0.95), cheap, 0.0) == [6] * B
    # the per-row caps still bound each row
    views = [RowView([0.95] * 2, 2, True), RowView([0.95] * 6, 6, True)]
    assert policy.depths(views, cheap, 0.0) == [2, 6]


def test_goodput_follows_the_batch_size_through_the_cost_model():
    """Blocks cheap for one row, expensive for many: speculation at B = 1, none at B = 8."""
    policy = GoodputDepth(gamma=6)
    load_sensitive = cost_model(per_token=0.02, per_row=20.0)
    assert policy.depths(rows(1, 0.8), load_sensitive, 0.0)[0] > 0
    assert policy.depths(rows(8, 0.8), load_sensitive, 0.0) == [0] * 8


def test_goodput_counts_the_draft_time():
    policy = GoodputDepth(gamma=6)
    cheap = cost_model(per_token=0.0)
    assert policy.depths(rows(2, 0.7), cheap, 0.0) == [6, 6]
    assert policy.depths(rows(2, 0.7), cheap, 10.0) == [0, 0]  # a draft token costs 10 plain steps


def test_goodput_matches_the_closed_form_optimum():
    """One row of constant α (the i.i.d. model): the depth maximises τ(α, K) / (K·t_draft + t_verify(K+1)),
    the closed form of Leviathan et al. (arXiv 2211.17192, §3.4) with a measured verify curve (the
    test the removed γ policy ``cost`` had)."""
    alpha, t_draft = 0.7, 0.004
    T_grid = tuple(range(1, 10))
    t_verify = {T: 0.03 + 0.003 * (T - 1) for T in T_grid}
    model = VerifyCostModel((1,), T_grid, (tuple(t_verify[T] for T in T_grid),))
    rate = {K: expected_tokens_per_step(alpha, K) / (K * t_draft + t_verify[K + 1]) for K in range(9)}
    best = max(rate, key=rate.get)
    row = [RowView([alpha] * 8, 8, True)]
    assert GoodputDepth(gamma=8, margin=0).depths(row, model, t_draft) == [best]
    # with a margin: the deepest depth predicted within it of the best (the model is unsure there)
    near = max(K for K in rate if rate[K] >= (1 - 0.04) * rate[best])
    assert near > best and GoodputDepth(gamma=8).depths(row, model, t_draft) == [near]


def test_goodput_keeps_its_depth_where_the_model_is_unsure():
    """Hysteresis: the previous K stays while its predicted rate is within the margin of the best, so a
    few per cent of timing noise does not flip the depth; a clear change does."""
    T_grid = (1, 2, 3, 4, 5)
    row = [RowView([0.7] * 4, 4, True)]
    policy = GoodputDepth(gamma=4)

    def grid(slope: float) -> VerifyCostModel:
        return VerifyCostModel((1,), T_grid, (tuple(0.01 + slope * (T - 1) for T in T_grid),))

    noisy = (0.0019, 0.0017, 0.0019, 0.0017)  # one verify curve measured with ±6 % noise
    exact = GoodputDepth(gamma=4, margin=0)
    assert [exact.depths(row, grid(slope), 0.0005)[0] for slope in noisy] == [2, 3, 2, 3]  # flips
    assert [policy.depths(row, grid(slope), 0.0005)[0] for slope in noisy] == [3, 3, 3, 3]
    assert policy.depths(row, grid(0.02), 0.0005) == [0]  # drafting no longer pays: it stops
    with pytest.raises(ValueError, match="margin"):
        GoodputDepth(margin=1.5)


def test_goodput_tracks_a_step_shaped_verify_curve():
    """A verify block that doubles from 1 to 2 tokens, then stays flat (as on a CPU): one draft is never
    worth it, many are or none are."""
    T_grid = tuple(range(1, 10))
    model = VerifyCostModel((1,), T_grid, (tuple(0.035 if T == 1 else 0.07 for T in T_grid),))
    policy = GoodputDepth(gamma=8)
    assert policy.depths([RowView([0.8] * 8, 8, True)], model, 0.002)[0] >= 4
    for alpha in (0.3, 0.5, 0.6, 0.8, 0.95):
        assert policy.depths([RowView([alpha] * 8, 8, True)], model, 0.002)[0] != 1


def test_goodput_without_a_cost_model_uses_the_local_rule():
    policy = GoodputDepth(gamma=6, local_cost=0.35)
    views = [RowView([0.95] * 6, 6, True), RowView([0.05] * 6, 6, True), RowView([0.95] * 3, 3, True)]
    assert policy.depths(views, None, 0.0) == [local_depth(v, 0.35) for v in views]
    assert policy.depths(views, None, 0.0)[1] == 0


# --- the cost model -------------------------------------------------------------------------------
def test_cost_model_interpolates_bilinearly_and_extends_linearly_in_tokens():
    model = VerifyCostModel((1, 4), (1, 3), ((1.0, 3.0), (2.0, 6.0)))
    assert model.cost(1, 1) == 1.0 and model.cost(4, 3) == 6.0  # grid points
    assert model.cost(1, 2) == pytest.approx(2.0)  # halfway in tokens
    assert model.cost(2, 1) == pytest.approx(1.0 + (2.0 - 1.0) / 3)  # a third of the way in rows
    assert model.cost(2, 2) == pytest.approx((2.0 * 2 + 4.0 * 1) / 3)  # bilinear
    assert model.cost(8, 1) == 2.0 and model.cost(8, 3) == 6.0  # flat beyond the rows
    assert model.cost(1, 0) == 1.0  # flat below the tokens
    assert model.cost(1, 5) == pytest.approx(3.0 + 1.0 * 2)  # the last slope (1 s/token) beyond
    assert model.cost(4, 5) == pytest.approx(6.0 + 2.0 * 2)
    falling = VerifyCostModel((1,), (1, 2), ((2.0, 1.0),))
    assert falling.cost(1, 10) == 1.0  # a negative slope is not extrapolated
    assert model.to_dict() == {"rows": [1, 4], "tokens": [1, 3], "seconds": [[1.0, 3.0], [2.0, 6.0]]}


def test_cost_model_refuses_a_ragged_or_empty_grid():
    with pytest.raises(ValueError, match="non-empty grid"):
        VerifyCostModel((), (1,), ())
    with pytest.raises(ValueError, match="non-empty grid"):
        VerifyCostModel((1, 2), (1,), ((1.0,),))
    with pytest.raises(ValueError, match="one entry per"):
        VerifyCostModel((1,), (1, 2), ((1.0,),))


def test_online_cost_scales_each_row_counts_grid_by_the_median_of_its_forwards():
    """The engine's forwards set the level (robust to outliers), the grid keeps the shape in T."""
    grid = cost_model(per_token=0.25)
    online = OnlineVerifyCost(grid, window=16, min_samples=4)
    for _ in range(3):
        online.observe(1, 4, 2.0 * grid.cost(1, 4))
    assert online.scale(1) == 1.0 and online.cost(1, 3) == grid.cost(1, 3)  # too few forwards yet
    for seconds in (2.0, 2.0, 2.0, 2.0, 2.0, 50.0, 60.0):  # two stalls among them
        online.observe(1, 4, seconds * grid.cost(1, 4))
    assert online.scale(1) == pytest.approx(2.0)
    for T in (1, 2, 3, 4, 5, 8):
        assert online.cost(1, T) == pytest.approx(2.0 * grid.cost(1, T))
    # a row count not seen reads the nearest one seen; once seen, its own
    assert online.cost(8, 2) == pytest.approx(2.0 * grid.cost(8, 2))
    for _ in range(4):
        online.observe(8, 2, 0.5 * grid.cost(8, 2))
    assert online.scale(8) == pytest.approx(0.5) and online.scale(4) == pytest.approx(2.0)
    # the window forgets: a machine that became faster is followed
    for _ in range(16):
        online.observe(1, 2, 1.0 * grid.cost(1, 2))
    assert online.scale(1) == pytest.approx(1.0)
    assert online.to_dict()["scale"] == {1: pytest.approx(1.0), 8: pytest.approx(0.5)}
    with pytest.raises(ValueError, match="window"):
        OnlineVerifyCost(grid, window=4, min_samples=5)


# --- make_depth_policy --------------------------------------------------------------------------
def test_make_depth_policy_by_int_name_and_instance():
    assert isinstance(make_depth_policy(3), FixedDepth) and make_depth_policy(3).gamma == 3
    assert make_depth_policy(0).gamma == 0
    assert isinstance(make_depth_policy("auto"), GoodputDepth)
    assert isinstance(make_depth_policy("goodput", {"gamma": 2}), GoodputDepth)
    assert make_depth_policy("goodput", {"gamma": 2}).gamma == 2
    table = make_depth_policy("batch-table", {"table": {1: 3, 4: 1}})
    assert isinstance(table, BatchTableDepth) and table.gamma == 3
    assert make_depth_policy("fixed", {"gamma": 5}).gamma == 5
    mine = FixedDepth(2)
    assert make_depth_policy(mine) is mine
    assert {"fixed", "batch-table", "goodput", "auto"} <= set(DEPTH_POLICIES.names())


@pytest.mark.parametrize(
    ("gamma", "options", "match"),
    [
        (-1, None, "gamma must be an int >= 0"),
        (True, None, "gamma must be an int >= 0"),
        (2.5, None, "gamma must be an int >= 0"),
        ("nope", None, "unknown depth policy 'nope'"),
        ("goodput", {"depth": 3}, "depth policy 'goodput'"),
        ("goodput", {"local_cost": 0.0}, "local_cost"),
        ("goodput", {"gamma": -2}, "gamma must be an int >= 0"),
        ("batch-table", {"table": {0: 3}}, "table must map batch sizes"),
        ("batch-table", {"table": {1: -1}}, "gamma must be an int >= 0"),
        (FixedDepth(2), {"gamma": 3}, "gamma_options only apply"),
    ],
)
def test_make_depth_policy_errors(gamma, options, match):
    with pytest.raises(ValueError, match=match):
        make_depth_policy(gamma, options)


def test_depth_policy_base_is_abstract():
    with pytest.raises(NotImplementedError):
        DepthPolicy().depths(rows(1, 0.5), None, 0.0)


# --- measuring the cost grid ------------------------------------------------------------------
class ClockTarget:
    """A target whose forward costs ``base(B, T)`` on a fake clock, plus ``cold`` for the first
    ``cold_calls`` forwards after a change of shape, plus ``stuck[(B, T)]`` on every forward of that
    point (a point that always reads slow)."""

    vocab_size = 16

    def __init__(self, *, cold: float = 0.0, cold_calls: int = 0, stuck=None) -> None:
        self.now, self.shape, self.run = 0.0, None, 0
        self.cold, self.cold_calls, self.stuck = cold, cold_calls, dict(stuck or {})

    @staticmethod
    def base(B: int, T: int) -> float:
        return 1.0 + 0.25 * B * T

    def forward(self, tokens_BT, start_B, *, rows_B=None):
        shape = tuple(tokens_BT.shape)
        self.run = self.run + 1 if shape == self.shape else 1
        self.shape = shape
        self.now += self.base(*shape) + self.stuck.get(shape, 0.0)
        self.now += self.cold if self.run <= self.cold_calls else 0.0

    def rollback(self, lengths_B, rows_B=None) -> None:
        pass


def measured(target: ClockTarget, monkeypatch) -> VerifyCostModel:
    from specdec.engine import cost_model

    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: target.now)
    return cost_model.measure_verify_cost(target, max_rows=4, context=4)


def test_the_cost_grid_is_each_shapes_steady_cost(monkeypatch):
    """The first forwards after another shape run slower (caches held the other shape's data);
    decoding repeats a shape, so the grid holds the steady cost."""
    model = measured(ClockTarget(cold=3.0, cold_calls=MIN_CALLS - 1), monkeypatch)
    for i, B in enumerate(model.rows):
        for j, T in enumerate(model.tokens):
            assert model.seconds[i][j] == pytest.approx(ClockTarget.base(B, T))


def test_a_point_that_reads_slow_does_not_raise_the_larger_blocks(monkeypatch):
    """Noise only adds time: a slow small point is capped by the larger blocks' times, never the
    other way round (which flattened the grid and made deep blocks look free)."""
    model = measured(ClockTarget(stuck={(1, 1): 10.0}), monkeypatch)
    assert model.cost(1, 1) == pytest.approx(min(ClockTarget.base(1, 2), ClockTarget.base(2, 1)))
    assert model.cost(1, 2) == pytest.approx(ClockTarget.base(1, 2))
    assert model.cost(4, 8) == pytest.approx(ClockTarget.base(4, 8))
    flat = [x for line in model.seconds for x in line]
    assert len(set(flat)) > len(flat) // 2  # not flattened
    for i in range(len(model.rows)):
        for j in range(len(model.tokens)):
            if i:
                assert model.seconds[i][j] >= model.seconds[i - 1][j]
            if j:
                assert model.seconds[i][j] >= model.seconds[i][j - 1]


def test_goodput_counts_a_drafting_rows_fixed_cost():
    """A row's drafter may pay a fixed cost on every step it drafts (an EAGLE head's catch-up):
    where that outweighs the expected gain, goodput keeps the row at K = 0."""
    model = cost_model(per_token=0.05)  # a 2-token block: 1.05 x one token
    free = GoodputDepth(gamma=4)
    cheap = [RowView([0.6] * 4, 4, True, overhead=0.0)]
    dear = [RowView([0.6] * 4, 4, True, overhead=2.0)]  # twice a whole step
    assert free.depths(cheap, model, 0.05)[0] > 0
    assert free.depths(dear, model, 0.05) == [0]
    # the same row with a moderate fixed cost drafts deeper (the cost spreads over more tokens)
    some = [RowView([0.9] * 4, 4, True, overhead=0.5)]
    assert free.depths(some, model, 0.05)[0] == 4
