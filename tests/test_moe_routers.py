"""Routers: registry, softmax top-k renormalisation, Switch top-1, DeepSeek-V3 bias balancing, expert choice.

Legend: T tokens, D model dim, E experts, K experts per token, C expert capacity.
"""

from __future__ import annotations

import math

import pytest
import torch

import moe


def make_router(**options) -> moe.Router:
    fields = {"dim": 8, "hidden_dim": 4, "num_experts": 6, "top_k": 2, **options}
    router = moe.build_router(moe.MoEConfig(**fields))
    with torch.no_grad():
        router.weight.normal_()
    return router


def test_registry_lists_builtins_and_rejects_unknown_names():
    assert {"softmax_topk", "switch", "sigmoid_bias", "expert_choice"} <= set(moe.router_names())
    with pytest.raises(ValueError, match=r"unknown router 'nope'; known routers: .*softmax_topk"):
        moe.MoE(8, 8, 4, 2, router="nope")


def test_register_router_adds_a_plugin():
    @moe.register_router("test_first_expert")
    class FirstExpert(moe.Router):
        def route(self, logits_TE):
            num_tokens = logits_TE.shape[0]
            experts_TK = torch.zeros(num_tokens, 1, dtype=torch.int64)
            return moe.Routing(logits_TE, experts_TK, torch.ones(num_tokens, 1))

    try:
        layer = moe.MoE(8, 6, 3, 1, router="test_first_expert")
        x = torch.randn(5, 8)
        torch.testing.assert_close(layer(x), layer.experts.expert(0, x))
        assert layer.last_tokens_per_expert.tolist() == [5, 0, 0]
    finally:
        moe.ROUTERS.unregister("test_first_expert")
    with pytest.raises(ValueError, match="subclass"):
        moe.register_router("bad")(object)


def test_router_config_by_name_or_by_config():
    sizes = {"dim": 8, "hidden_dim": 4, "num_experts": 6}
    by_name = moe.MoEConfig(**sizes, router="sigmoid_bias")
    assert by_name == moe.MoEConfig(**sizes, router=moe.SigmoidBiasRouter.Config())
    assert by_name.router.name == "sigmoid_bias" and by_name.router.bias_update_rate == 1e-3
    assert moe.MoEConfig(**sizes, router="expert_choice").router == moe.RouterConfig(name="expert_choice")
    with pytest.raises(ValueError, match=r"router 'softmax_topk' takes a SoftmaxTopKRouter\.Config"):
        moe.MoEConfig(**sizes, router=moe.SwitchRouter.Config(name="softmax_topk"))
    with pytest.raises(ValueError, match="unknown router 'nope'"):
        moe.MoEConfig(**sizes, router=moe.RouterConfig(name="nope"))
    with pytest.raises(ValueError, match="router name or a moe.RouterConfig"):
        moe.MoEConfig(**sizes, router=3)
    with pytest.raises(ValueError, match="bias_update_rate must be a finite number >= 0"):
        moe.SigmoidBiasRouter.Config(bias_update_rate=-1.0)
    with pytest.raises(ValueError, match="routed_scaling_factor must be > 0"):
        moe.SoftmaxTopKRouter.Config(routed_scaling_factor=float("nan"))


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_weights(renormalize):
    torch.manual_seed(0)
    router = make_router(top_k=3, router=moe.SoftmaxTopKRouter.Config(renormalize=renormalize))
    x = torch.randn(10, 8)
    routing = router(x)
    probs_TE = torch.softmax(x @ router.weight.T, dim=-1)
    top_TK, experts_TK = probs_TE.topk(3, dim=-1)
    assert torch.equal(routing.experts_TK, experts_TK)
    expected = top_TK / top_TK.sum(-1, keepdim=True) if renormalize else top_TK
    torch.testing.assert_close(routing.weights_TK, expected)
    sums = routing.weights_TK.sum(-1)
    if renormalize:
        torch.testing.assert_close(sums, torch.ones(10))
    else:
        assert (sums < 1).all()


def test_routed_scaling_factor_multiplies_weights():
    torch.manual_seed(0)
    plain, scaled = make_router(), make_router(router=moe.SoftmaxTopKRouter.Config(routed_scaling_factor=2.5))
    scaled.load_state_dict(plain.state_dict())
    x = torch.randn(4, 8)
    torch.testing.assert_close(scaled(x).weights_TK, 2.5 * plain(x).weights_TK)


def test_switch_is_top1_weighted_by_its_probability():
    torch.manual_seed(1)
    router = make_router(router="switch", top_k=1)
    x = torch.randn(12, 8)
    routing = router(x)
    probs_TE = torch.softmax(x @ router.weight.T, dim=-1)
    assert routing.experts_TK.shape == (12, 1)
    assert torch.equal(routing.experts_TK[:, 0], probs_TE.argmax(-1))
    torch.testing.assert_close(routing.weights_TK[:, 0], probs_TE.max(-1).values)  # p_i, not 1
    with pytest.raises(ValueError, match="top_k must be 1"):
        moe.MoE(8, 8, 4, 2, router="switch")


def test_sigmoid_bias_selects_with_bias_but_weights_without_it():
    torch.manual_seed(2)
    router = make_router(router="sigmoid_bias", top_k=2)
    router.expert_bias[4] = 100.0  # expert 4 always selected
    x = torch.randn(7, 8)
    routing = router(x)
    scores_TE = torch.sigmoid(x @ router.weight.T)
    assert (routing.experts_TK == 4).any(dim=1).all()
    picked = scores_TE.gather(1, routing.experts_TK)
    torch.testing.assert_close(routing.weights_TK, picked / picked.sum(-1, keepdim=True))
    assert "expert_bias" in router.state_dict() and "expert_bias" not in dict(router.named_parameters())


def test_sigmoid_bias_update_rule():
    router = make_router(router=moe.SigmoidBiasRouter.Config(bias_update_rate=0.01), num_experts=4)
    load = router.update_bias(torch.tensor([10, 0, 5, 5]))
    assert load.tolist() == [10.0, 0.0, 5.0, 5.0]
    # mean 5: overloaded expert 0 goes down by gamma, underloaded expert 1 up, balanced ones stay.
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    with pytest.raises(ValueError, match="load_E"):
        router.update_bias(torch.ones(3))


def test_bias_balancing_moves_load_toward_uniform():
    """DeepSeek-V3 aux-loss-free balancing: a skewed router becomes balanced by bias updates alone."""
    torch.manual_seed(3)
    layer = moe.MoE(
        16, 8, 8, 2, router=moe.SigmoidBiasRouter.Config(bias_update_rate=0.05), aux_loss_coef=0.0
    )
    with torch.no_grad():
        layer.router.weight.normal_(std=0.3)
        layer.router.weight[:2] += 1.0  # experts 0 and 1 are preferred by every token with x ~ 1 + noise
    weight_before = layer.router.weight.detach().clone()
    layer.train()

    def imbalance(counts):  # max load / mean load (1.0 is perfectly uniform)
        counts = counts.float()
        return float(counts.max() / counts.mean())

    loads = []
    for step in range(60):
        x = 1.0 + torch.randn(256, 16, generator=torch.Generator().manual_seed(step))
        with torch.no_grad():
            layer(x)
        loads.append(layer.last_tokens_per_expert.clone())
        assert torch.equal(layer.router.pending_load, loads[-1])
        assert moe.update_router_biases(layer) == 1
        assert int(layer.router.pending_load.sum()) == 0
    first, last = imbalance(loads[0]), imbalance(torch.stack(loads[-10:]).sum(0))
    assert first > 3.0, first  # badly skewed at the start
    assert last < 1.3, last  # near uniform after the bias updates
    assert torch.equal(layer.router.weight, weight_before)  # the router weights never moved
    assert layer.router.expert_bias[:2].max() < 0 < layer.router.expert_bias[2:].min()


def test_bias_is_not_updated_in_eval_mode():
    layer = moe.MoE(8, 4, 4, 2, router="sigmoid_bias")
    layer.eval()
    layer(torch.randn(10, 8))
    assert int(layer.router.pending_load.sum()) == 0
    with pytest.raises(ValueError, match="sigmoid_bias"):
        moe.MoE(8, 4, 4, 2).update_router_bias()


@pytest.mark.parametrize(("num_tokens", "capacity_factor"), [(12, None), (10, 1.5), (3, 0.5), (1, None)])
def test_expert_choice_shapes_and_capacity(num_tokens, capacity_factor):
    torch.manual_seed(num_tokens)
    num_experts, top_k = 6, 2
    layer = moe.MoE(8, 5, num_experts, top_k, router="expert_choice", capacity_factor=capacity_factor)
    with torch.no_grad():
        layer.router.weight.normal_()
    x = torch.randn(num_tokens, 8)
    routing = layer.router(x)
    factor = 1.0 if capacity_factor is None else capacity_factor
    capacity = max(1, min(num_tokens, math.ceil(factor * num_tokens * top_k / num_experts)))
    assert layer.router.capacity(num_tokens) == capacity
    assert routing.experts_TK.shape == routing.weights_TK.shape == (num_tokens, num_experts)
    assert routing.kept.group_sizes_E.tolist() == [capacity] * num_experts
    assert routing.kept.sorted_slots_M.shape == (capacity * num_experts,)
    # Expert e picked the `capacity` tokens with the highest probability for e.
    probs_TE = torch.softmax(x @ layer.router.weight.T, dim=-1)
    chosen_TE = routing.weights_TK > 0
    for e in range(num_experts):
        picked = chosen_TE[:, e].nonzero().squeeze(1)
        assert picked.numel() == capacity
        assert set(picked.tolist()) == set(probs_TE[:, e].topk(capacity).indices.tolist())
    torch.testing.assert_close(routing.weights_TK, probs_TE * chosen_TE)
    # The layer output is sum_e S[t, e] * expert_e(x_t) over the experts that picked token t.
    expected = sum(routing.weights_TK[:, e : e + 1] * layer.experts.expert(e, x) for e in range(num_experts))
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    unpicked = int((~chosen_TE.any(dim=1)).sum())
    assert layer.last_drop_fraction == unpicked / num_tokens
