"""Gamma policies: fixed, the transformers heuristic, and the measured-cost model."""

from __future__ import annotations

import pytest

from specdec.metrics import expected_tokens_per_step
from specdec.policies import (
    POLICIES,
    CostModelGamma,
    FixedGamma,
    GammaPolicy,
    HeuristicGamma,
    StepStats,
    as_policy,
    interpolate_block_cost,
    make_policy,
)

STATE = None  # the built-in policies do not read the decode state


def step(
    gamma: int,
    accepted: list[int],
    *,
    drafted: int | None = None,
    draft_s: float = 0.0,
    verify_s: float = 0.0,
):
    return StepStats(
        gamma=gamma,
        num_drafted=gamma if drafted is None else drafted,
        num_accepted=accepted,
        draft_time_s=draft_s,
        verify_time_s=verify_s,
    )


def test_registry_and_coercion():
    assert {"fixed", "heuristic", "cost"} <= set(POLICIES.names())
    for name in ("fixed", "heuristic", "cost"):
        p = make_policy(name, gamma=3)
        assert isinstance(p, GammaPolicy)
        assert p.next_gamma(STATE) == 3
    assert isinstance(as_policy(5), FixedGamma) and as_policy(5).max_gamma == 5
    assert isinstance(as_policy("heuristic"), HeuristicGamma)
    p = CostModelGamma()
    assert as_policy(p) is p
    with pytest.raises(ValueError, match="known gamma-policy names: .*cost"):
        make_policy("nope")
    with pytest.raises(ValueError, match="gamma"):
        as_policy(-1)
    with pytest.raises(ValueError, match="gamma"):
        as_policy(True)
    with pytest.raises(ValueError, match="gamma"):
        as_policy(2.5)


def test_fixed():
    p = FixedGamma(0)
    assert p.next_gamma(STATE) == 0 and p.max_gamma == 0
    p.update(step(0, [0]))
    assert p.next_gamma(STATE) == 0


def test_heuristic_follows_transformers():
    p = HeuristicGamma(4, max_gamma=9)
    p.update(step(4, [4]))
    assert p.next_gamma(STATE) == 6
    p.update(step(6, [6, 6]))
    assert p.next_gamma(STATE) == 8
    p.update(step(8, [8]))
    assert p.next_gamma(STATE) == 9  # capped
    p.update(step(9, [9, 3]))  # one row rejected → -1
    assert p.next_gamma(STATE) == 8
    for _ in range(20):
        p.update(step(p.gamma, [0]))
    assert p.next_gamma(STATE) == 1  # never below 1
    # fewer drafts than asked (an n-gram miss) counts as not all accepted, as in transformers
    p = HeuristicGamma(4)
    p.update(step(4, [2], drafted=2))
    assert p.next_gamma(STATE) == 3


def warm(p: CostModelGamma, *, alpha: float, t_draft: float, t_verify, gammas=range(0, 9), rounds: int = 30):
    """Feed the policy steps whose accepted counts follow α and whose costs follow the given model."""
    for _ in range(rounds):
        for g in gammas:
            # a deterministic "expected" outcome: accepted = round(E[accepted])
            acc = round(expected_tokens_per_step(alpha, g) - 1)
            p.update(step(g, [acc], draft_s=g * t_draft, verify_s=t_verify(g + 1)))


def test_cost_policy_declines_to_speculate_when_drafts_are_expensive():
    p = CostModelGamma(gamma=4, max_gamma=8)
    warm(p, alpha=0.5, t_draft=0.05, t_verify=lambda T: 0.035 * (1 + 0.25 * (T - 1)))
    assert p.next_gamma(STATE) == 0


def test_cost_policy_picks_long_drafts_when_cheap_and_accurate():
    p = CostModelGamma(gamma=1, max_gamma=8)
    warm(p, alpha=0.95, t_draft=0.001, t_verify=lambda T: 0.035 + 0.001 * (T - 1))
    assert p.alpha > 0.85
    assert p.next_gamma(STATE) >= 6


def test_cost_policy_tracks_the_verify_cost_curve():
    """Same α and draft cost; a verify cost that doubles from 1 to 2 tokens then stays flat (as on a
    CPU) makes a short γ pointless: the best γ is large or zero, never 1."""
    p = CostModelGamma(gamma=4, max_gamma=8)
    warm(p, alpha=0.8, t_draft=0.002, t_verify=lambda T: 0.035 if T == 1 else 0.07)
    g = p.next_gamma(STATE)
    assert g >= 4
    rates = [p.expected_rate(k) for k in range(9)]
    assert rates[1] < rates[0]  # one draft costs a doubled verify for at most 2 tokens


def test_cost_policy_matches_the_closed_form_optimum():
    alpha, t_draft = 0.7, 0.004
    t_verify = lambda T: 0.03 + 0.003 * (T - 1)
    p = CostModelGamma(gamma=2, max_gamma=8, decay=1.0, prior_weight=1e-6)
    p.accepted, p.trials = alpha * 1e6, 1e6  # α̂ = 0.7
    p.t_draft = t_draft
    p.t_verify = {T: t_verify(T) for T in range(1, 10)}
    best = max(range(9), key=lambda g: expected_tokens_per_step(alpha, g) / (g * t_draft + t_verify(g + 1)))
    assert p.next_gamma(STATE) == best


def test_cost_policy_probes_after_a_run_of_zero_steps():
    p = CostModelGamma(gamma=4, max_gamma=4, probe_every=5)
    warm(p, alpha=0.3, t_draft=0.05, t_verify=lambda T: 0.035 * T)
    choices = [p.next_gamma(STATE) for _ in range(6)]
    assert choices[:5] == [0] * 5 and choices[5] >= 1


def test_cost_policy_first_step_and_unmeasured_lengths():
    p = CostModelGamma(gamma=3, max_gamma=6)
    assert p.next_gamma(STATE) == 3  # nothing measured yet
    p.update(step(3, [3], draft_s=0.003, verify_s=0.05))
    # only T = 4 is measured: shorter blocks are estimated proportionally cheaper, longer ones equal
    assert p.verify_cost(4) == pytest.approx(0.05)
    assert p.verify_cost(2) == pytest.approx(0.025)
    assert p.verify_cost(7) == pytest.approx(0.05)
    p.update(step(0, [0], verify_s=0.03))
    assert p.verify_cost(2) == pytest.approx(0.03 + (0.05 - 0.03) / 3)


def test_cost_policy_options_are_validated():
    for bad in (
        dict(alpha_prior=1.5),
        dict(prior_weight=0),
        dict(decay=0.0),
        dict(ema=2.0),
        dict(max_gamma=0),
    ):
        with pytest.raises(ValueError):
            CostModelGamma(**bad)


def test_block_cost_interpolates_and_extrapolates_flat_or_linear():
    """The shared verify-cost curve of CostModelGamma ("flat" above) and the default drafter's
    DepthController ("linear" above)."""
    costs = {2: 0.02, 4: 0.03, 6: 0.06}
    for above in ("flat", "linear"):
        assert interpolate_block_cost(costs, 4, above=above) == 0.03
        assert interpolate_block_cost(costs, 5, above=above) == pytest.approx(0.045)
        assert interpolate_block_cost(costs, 1, above=above) == pytest.approx(0.01)  # ∝ T below
        assert interpolate_block_cost({}, 3, above=above) == 3.0
    assert interpolate_block_cost(costs, 8, above="flat") == 0.06
    assert interpolate_block_cost(costs, 8, above="linear") == pytest.approx(0.09)
    assert interpolate_block_cost({2: 0.02}, 8, above="linear") == pytest.approx(0.08)
