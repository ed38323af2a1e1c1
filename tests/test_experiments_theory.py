"""Closed forms against the paper (Leviathan Table 1), brute force, and Monte-Carlo (MoE routing statistics).

Monte-Carlo tests compare a mean with its closed form at 5 standard errors: with a fixed seed they are
deterministic; over seeds a false alarm has probability < 1e-6 per comparison.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from experiments.catalog.leviathan_table1 import PUBLISHED
from experiments.catalog.switch_tables import capacity
from experiments.theory.leviathan import (
    expected_tokens,
    operations_factor,
    optimal_gamma,
    reproducing_interval,
    walltime_improvement,
)
from experiments.theory.moe_routing import (
    distinct_experts_per_block,
    drop_fraction,
    expected_distinct_experts,
    expected_drop_fraction,
    measure_distinct_experts,
    random_topk_routing,
    switch_load_balancing_loss,
)

# ------------------------------------------------------------------------------------ Leviathan et al.


@pytest.mark.parametrize(("alpha", "gamma"), list(PUBLISHED))
def test_table1_is_reproduced_to_two_decimals_at_zero_draft_cost(alpha, gamma):
    ops, speed = PUBLISHED[(alpha, gamma)]
    assert round(operations_factor(alpha, gamma, 0.0), 2) == pytest.approx(ops, abs=1e-9)
    assert round(walltime_improvement(alpha, gamma, 0.0), 2) == pytest.approx(speed, abs=1e-9)


def test_table1_values_are_the_paper_numbers():
    """The six pairs as printed in arXiv 2211.17192 Table 1 (and in our issue)."""
    assert PUBLISHED == {
        (0.6, 2): (1.53, 1.96),
        (0.7, 3): (1.58, 2.53),
        (0.8, 2): (1.23, 2.44),
        (0.8, 5): (1.63, 3.69),
        (0.9, 2): (1.11, 2.71),
        (0.9, 10): (1.60, 6.86),
    }


def test_only_a_near_zero_cost_reproduces_table1():
    walltime = [(a, g, w) for (a, g), (_, w) in PUBLISHED.items()]
    operations = [(a, g, o) for (a, g), (o, _) in PUBLISHED.items()]
    low, high = reproducing_interval(walltime, kind="walltime")
    assert low == 0.0 and 5e-5 < high < 2e-4
    for c in (0.0, high * 0.999):
        assert all(abs(walltime_improvement(a, g, c) - w) <= 0.005 for a, g, w in walltime)
    assert any(abs(walltime_improvement(a, g, high * 1.01) - w) > 0.005 for a, g, w in walltime)
    low, high = reproducing_interval(operations, kind="operations")
    assert low == 0.0 and 1e-3 < high < 2e-3
    assert any(abs(operations_factor(a, g, high * 1.01) - o) > 0.005 for a, g, o in operations)
    assert reproducing_interval([(0.6, 2, 1.96), (0.6, 2, 1.50)], kind="walltime") is None


def test_expected_tokens_matches_a_direct_sum():
    for alpha, gamma in itertools.product((0.0, 0.3, 0.77, 1.0), (0, 1, 5)):
        direct = sum(alpha**i for i in range(gamma + 1))  # P(at least i drafts accepted), i = 0..gamma
        assert expected_tokens(alpha, gamma) == pytest.approx(direct)


def test_optimal_gamma_brute_force_and_corollary():
    for alpha, c in itertools.product((0.1, 0.5, 0.8, 0.9, 0.95), (0.01, 0.05, 0.2, 0.6)):
        best = max(range(0, 300), key=lambda g: (walltime_improvement(alpha, g, c), -g))
        assert optimal_gamma(alpha, c) == best
        assert (optimal_gamma(alpha, c) > 0) == (alpha > c)  # Corollary 3.9: speculation helps iff alpha > c
    gammas = [optimal_gamma(a / 20, 0.05) for a in range(20)]
    assert gammas == sorted(gammas)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: expected_tokens(1.2, 2), "alpha must be"),
        (lambda: expected_tokens(0.5, -1), "gamma must be"),
        (lambda: walltime_improvement(0.5, 2, -0.1), "c must be"),
        (lambda: operations_factor(0.5, 2, float("inf")), "c_hat must be"),
        (lambda: optimal_gamma(0.5, 0.1, max_gamma=-1), "max_gamma"),
        (lambda: reproducing_interval([(0.5, 2, 1.0)], kind="speed"), "kind must be"),
    ],
)
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# -------------------------------------------------------------------------- distinct experts touched


def test_distinct_experts_counts_blocks_exactly():
    expert_ids_TK = torch.tensor([[0, 1], [1, 2], [3, 0], [3, 3], [2, 2]])
    assert distinct_experts_per_block(expert_ids_TK, 4, 1).tolist() == [2, 2, 2, 1, 1]
    assert distinct_experts_per_block(expert_ids_TK, 4, 2).tolist() == [3, 2]  # last partial block dropped
    assert distinct_experts_per_block(expert_ids_TK, 4, 5).tolist() == [4]
    with pytest.raises(ValueError, match="need at least block_size"):
        distinct_experts_per_block(expert_ids_TK, 4, 6)
    with pytest.raises(ValueError, match=r"lie in \[0, num_experts=3\)"):
        distinct_experts_per_block(expert_ids_TK, 3, 1)


def test_distinct_experts_formula_edge_cases():
    assert expected_distinct_experts(8, 2, 0) == 0.0
    assert expected_distinct_experts(8, 2, 1) == pytest.approx(2.0)
    assert expected_distinct_experts(8, 8, 3) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="top_k must be"):
        expected_distinct_experts(8, 9, 1)


@pytest.mark.statistical
@pytest.mark.parametrize(("num_experts", "top_k"), [(8, 2), (64, 6), (128, 8)])
def test_distinct_experts_formula_matches_uniform_routing(num_experts, top_k):
    route = random_topk_routing(num_experts, top_k)
    sample = route(200, torch.Generator().manual_seed(0))
    assert all(len(set(row)) == top_k for row in sample.tolist())  # k distinct experts per token
    generator = torch.Generator().manual_seed(1234)
    blocks = (1, 2, 3, 5, 8, 12)
    measured = measure_distinct_experts(
        route, num_experts, list(blocks), num_tokens=24000, generator=generator
    )
    for n in blocks:
        counts = measured[n].double()
        assert counts.numel() == 24000 // n
        sem = counts.std().item() / math.sqrt(counts.numel())
        expected = expected_distinct_experts(num_experts, top_k, n)
        assert abs(counts.mean().item() - expected) <= 5 * sem + 1e-12, (n, counts.mean().item(), expected)


@pytest.mark.statistical
def test_skewed_routing_touches_fewer_experts_than_the_formula():
    generator = torch.Generator().manual_seed(5)
    expert_ids_TK = random_topk_routing(64, 6, skew=1.0)(16000, generator)
    counts = distinct_experts_per_block(expert_ids_TK, 64, 8).double()
    assert counts.mean().item() < 0.85 * expected_distinct_experts(64, 6, 8)


# ------------------------------------------------------------------------------- capacity dropping


def test_binomial_tail_equals_exhaustive_enumeration():
    """Exact expectation over every top-1 routing of T tokens to E experts (each routing equally likely)."""
    for num_tokens, num_experts, cap in [(4, 2, 2), (5, 3, 1), (6, 2, 4), (3, 3, 0)]:
        total = 0.0
        for routing in itertools.product(range(num_experts), repeat=num_tokens):
            ids = torch.tensor(routing).view(-1, 1)
            total += drop_fraction(ids, num_experts, cap)
        exact = total / num_experts**num_tokens
        assert expected_drop_fraction(num_tokens, num_experts, 1, cap) == pytest.approx(exact, abs=1e-12)


def test_drop_fraction_edge_cases():
    assert expected_drop_fraction(16, 4, 1, 16) == 0.0
    assert expected_drop_fraction(16, 4, 2, 0) == pytest.approx(1.0)
    ids = torch.tensor([[0], [0], [0], [1]])
    assert drop_fraction(ids, 2, 2) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="capacity must be"):
        expected_drop_fraction(16, 4, 1, -1)


@pytest.mark.statistical
@pytest.mark.parametrize(
    ("num_experts", "top_k", "capacity_factor"), [(8, 1, 1.0), (8, 2, 1.0), (32, 1, 1.25), (32, 4, 1.5)]
)
def test_drop_fraction_matches_the_binomial_tail_under_uniform_routing(num_experts, top_k, capacity_factor):
    num_tokens, batches = 256, 300
    cap = capacity(num_tokens, num_experts, top_k, capacity_factor)
    assert cap == math.ceil(capacity_factor * num_tokens * top_k / num_experts)
    route = random_topk_routing(num_experts, top_k)
    generator = torch.Generator().manual_seed(99)
    fractions = torch.tensor(
        [drop_fraction(route(num_tokens, generator), num_experts, cap) for _ in range(batches)]
    )
    sem = fractions.std().item() / math.sqrt(batches)
    expected = expected_drop_fraction(num_tokens, num_experts, top_k, cap)
    assert expected > 1e-4
    assert abs(fractions.mean().item() - expected) <= 5 * sem, (fractions.mean().item(), expected, sem)


# ---------------------------------------------------------------------------------- Switch loss


@pytest.mark.parametrize(("num_experts", "top_k"), [(2, 1), (8, 1), (8, 2), (64, 6)])
def test_switch_loss_equals_its_coefficient_under_uniform_router_probabilities(num_experts, top_k):
    generator = torch.Generator().manual_seed(num_experts)
    probs_TE = torch.full((500, num_experts), 1.0 / num_experts, dtype=torch.float64)
    for skew in (0.0, 2.0):  # balanced or badly imbalanced dispatch: the loss is the coefficient either way
        ids = random_topk_routing(num_experts, top_k, skew=skew)(500, generator)
        for coefficient in (0.01, 0.5):
            loss = switch_load_balancing_loss(probs_TE, ids, coefficient).item()
            assert loss == pytest.approx(coefficient, rel=1e-12)


def test_switch_loss_hand_computed():
    probs_TE = torch.tensor([[0.9, 0.1], [0.7, 0.3]])
    ids = torch.tensor([[0], [0]])  # f = (1, 0), P = (0.8, 0.2): loss = c * 2 * 0.8
    assert switch_load_balancing_loss(probs_TE, ids, 0.1).item() == pytest.approx(0.16)
    with pytest.raises(ValueError, match="expert_ids_TK has 1 tokens"):
        switch_load_balancing_loss(probs_TE, ids[:1], 0.1)


def test_switch_loss_agrees_with_moe_load_balancing_loss():
    moe = pytest.importorskip("moe")
    generator = torch.Generator().manual_seed(3)
    probs_TE = torch.softmax(torch.randn(300, 16, generator=generator), dim=-1)
    ids = random_topk_routing(16, 4, skew=0.7)(300, generator)
    counts_E = torch.bincount(ids.reshape(-1), minlength=16)
    ours = switch_load_balancing_loss(probs_TE, ids, 0.02)
    theirs = moe.load_balancing_loss(probs_TE, counts_E, 0.02)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
