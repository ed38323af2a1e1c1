"""Capacity dropping (exact drop fractions, the priority rule, the binomial tail) and the router losses.

Legend: T tokens, E experts, K experts per token, C expert capacity.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

import kernels
import moe


def test_expert_capacity_formula():
    assert moe.expert_capacity(16, 1, 4, 1.0) == 4
    assert moe.expert_capacity(16, 2, 4, 1.25) == 10  # ceil(1.25 * 16 * 2 / 4)
    assert moe.expert_capacity(3, 1, 8, 1.0) == 1  # never below 1


def test_keep_mask_follows_the_priority_rule():
    # T=4, K=2, E=2, C=2. Expert 0 is the first choice of tokens 0, 2, 3 and the second of token 1:
    # first choices outrank second choices, earlier tokens outrank later ones -> keeps (t0,k0), (t2,k0).
    # Expert 1 is the first choice of token 1 and the second of 0, 2, 3 -> keeps (t1,k0), (t0,k1).
    experts_TK = torch.tensor([[0, 1], [1, 0], [0, 1], [0, 1]])
    keep = moe.keep_mask(experts_TK, num_experts=2, capacity=2)
    expected = torch.tensor([[True, True], [True, False], [True, False], [False, False]])
    assert torch.equal(keep, expected)


def test_drop_overflow_returns_the_kept_plan():
    experts_TK = torch.tensor([[0, 1], [1, 0], [0, 1], [0, 1]])
    full = kernels.sort_by_expert(experts_TK, 3)
    kept, dropped = moe.drop_overflow(experts_TK, full, num_experts=3, capacity=2)
    assert dropped == 4
    # slot = t*K + k; expert 0 keeps slots 0 (t0,k0) and 4 (t2,k0); expert 1 keeps 1 (t0,k1), 2 (t1,k0).
    assert kept.sorted_slots_M.tolist() == [0, 4, 1, 2]
    assert kept.group_sizes_E.tolist() == [2, 2, 0]
    assert kept.expert_offsets_E1.tolist() == [0, 2, 4, 4]
    same, none = moe.drop_overflow(experts_TK, full, num_experts=3, capacity=4)
    assert none == 0 and same is full


@pytest.mark.parametrize("top_k", [1, 2])
def test_layer_drop_fraction_exact_on_constructed_routing(top_k):
    """Tokens i < 12 prefer expert 0 (then 1); tokens i >= 12 prefer expert 2 (then 3)."""
    num_tokens, num_experts = 16, 4
    layer = moe.MoE(4, 3, num_experts, top_k, capacity_factor=1.0)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0], layer.router.weight[1, 0] = 4.0, 2.0
        layer.router.weight[2, 1], layer.router.weight[3, 1] = 4.0, 2.0
    x = torch.zeros(num_tokens, 4)
    x[:12, 0] = 1.0
    x[12:, 1] = 1.0
    y = layer(x)
    capacity = math.ceil(num_tokens * top_k / num_experts)  # 4 (top-1) or 8 (top-2)
    routed = {1: [12, 0, 4, 0], 2: [12, 12, 4, 4]}[top_k]
    kept = [min(c, capacity) for c in routed]
    assert layer.last_tokens_per_expert.tolist() == kept
    assert layer.last_drop_fraction == (sum(routed) - sum(kept)) / (num_tokens * top_k)
    # The earliest tokens of expert 0 are kept; tokens 0..capacity-1 get expert 0's output.
    routing = layer.router(x)
    w0 = routing.weights_TK[0, 0]
    torch.testing.assert_close(y[0], w0 * layer.experts.expert(0, x[:1])[0] + _second(layer, x, routing, 0))
    if top_k == 1:
        assert torch.equal(y[capacity:12], torch.zeros(12 - capacity, 4))  # dropped: the layer adds 0


def _second(layer, x, routing, t):
    if routing.experts_TK.shape[1] == 1:
        return torch.zeros(4)
    e = int(routing.experts_TK[t, 1])
    return routing.weights_TK[t, 1] * layer.experts.expert(e, x[t : t + 1])[0]


@pytest.mark.statistical
def test_drop_fraction_under_uniform_random_routing_matches_the_binomial_tail():
    """Top-1, uniform random experts: each expert's load is Binomial(T, 1/E), it drops max(0, load - C).

    E[dropped fraction] = E * E[max(0, X - C)] / T with X ~ Binomial(T, 1/E). Over 400 independent
    batches the mean has standard error ~0.002; we allow 5 standard errors (false alarm < 1e-6).
    """
    num_tokens, num_experts, factor, trials = 64, 8, 1.0, 400
    capacity = moe.expert_capacity(num_tokens, 1, num_experts, factor)
    generator = torch.Generator().manual_seed(0)
    fractions = []
    for _ in range(trials):
        experts_TK = torch.randint(num_experts, (num_tokens, 1), generator=generator)
        keep = moe.keep_mask(experts_TK, num_experts, capacity)
        fractions.append(1.0 - keep.float().mean().item())
    loads = torch.arange(num_tokens + 1, dtype=torch.float64)
    pmf = torch.from_numpy(stats.binom.pmf(loads.numpy(), num_tokens, 1 / num_experts))
    expected = float(num_experts * (pmf * (loads - capacity).clamp(min=0)).sum() / num_tokens)
    observed = torch.tensor(fractions, dtype=torch.float64)
    stderr = float(observed.std() / math.sqrt(trials))
    assert 0.05 < expected < 0.2
    assert abs(float(observed.mean()) - expected) < 5 * stderr, (float(observed.mean()), expected, stderr)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_load_balancing_loss_equals_its_coefficient_under_uniform_routing(top_k):
    num_tokens, num_experts, coef = 32, 8, 0.01
    probs_TE = torch.full((num_tokens, num_experts), 1 / num_experts)
    counts_E = torch.full((num_experts,), num_tokens * top_k // num_experts)
    loss = moe.load_balancing_loss(probs_TE, counts_E, coef)
    assert loss.item() == pytest.approx(coef, rel=1e-6)


def test_load_balancing_loss_hand_computed_and_against_transformers():
    probs_TE = torch.tensor([[0.75, 0.25], [0.75, 0.25]])
    # all slots on expert 0: f = [1, 0], P = [0.75, 0.25] -> 2 * 0.75 = 1.5
    assert moe.load_balancing_loss(probs_TE, torch.tensor([2, 0])).item() == pytest.approx(1.5)
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    logits_TE = torch.randn(20, 6)
    for top_k in (1, 2, 3):
        experts_TK = torch.softmax(logits_TE, -1).topk(top_k, -1).indices
        counts_E = torch.bincount(experts_TK.reshape(-1), minlength=6)
        ours = moe.load_balancing_loss(torch.softmax(logits_TE, -1), counts_E)
        theirs = load_balancing_loss_func((logits_TE,), num_experts=6, top_k=top_k)
        torch.testing.assert_close(ours * top_k, theirs)  # transformers counts per token, not per slot


def test_layer_aux_loss_under_uniform_routing_equals_coefficient():
    """A zero router gives uniform probabilities; balanced inputs give uniform counts."""
    layer = moe.MoE(8, 4, 4, 1, aux_loss_coef=0.02, router="switch")
    with torch.no_grad():
        layer.router.weight.zero_()
    layer.train()
    layer(torch.randn(16, 8))  # ties all go to expert 0: f = [1, 0, 0, 0], P uniform -> still coef
    assert layer.last_aux_loss.item() == pytest.approx(0.02)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4, 8) * 1e-6)  # near-uniform P, one token per expert
    x = torch.eye(4, 8).repeat(4, 1)
    layer(x)
    assert layer.last_tokens_per_expert.tolist() == [4, 4, 4, 4]
    assert layer.last_aux_loss.item() == pytest.approx(0.02, rel=1e-5)


def test_router_z_loss_on_known_logits():
    assert moe.router_z_loss(torch.zeros(5, 4), coef=1.0).item() == pytest.approx(math.log(4) ** 2)
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    expected = 0.001 * ((math.log(math.e + math.e**2 + math.e**3)) ** 2 + math.log(3) ** 2) / 2
    assert moe.router_z_loss(logits, coef=0.001).item() == pytest.approx(expected, rel=1e-6)
    logits.requires_grad_(True)
    moe.router_z_loss(logits).backward()
    assert logits.grad.abs().sum() > 0


def test_loss_bad_input():
    with pytest.raises(ValueError, match="probs_TE"):
        moe.load_balancing_loss(torch.ones(4), torch.ones(4))
    with pytest.raises(ValueError, match="routed_counts_E"):
        moe.load_balancing_loss(torch.ones(2, 4), torch.ones(3))
    with pytest.raises(ValueError, match="logits_TE"):
        moe.router_z_loss(torch.ones(4))
