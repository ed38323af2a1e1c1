"""moe.MoE: forward against a dense plain-PyTorch reference, shared experts, statistics, gradients, bad input.

Legend: T tokens, D model dim, H expert hidden dim, E experts, K experts per token.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import moe


def swiglu_ref(x_TD, w_gate_up, w_down):
    h = x_TD @ w_gate_up
    hidden = w_down.shape[0]
    return (F.silu(h[:, :hidden]) * h[:, hidden:]) @ w_down


def dense_reference(layer: moe.MoE, x: torch.Tensor) -> torch.Tensor:
    """Softmax top-k MoE computed densely (every expert on every token), no kernels ops, in x's dtype."""
    config = layer.config
    x_TD = x.reshape(-1, config.dim)
    probs_TE = torch.softmax(x_TD @ layer.router.weight.T, dim=-1)
    top_TK, experts_TK = probs_TE.topk(config.top_k, dim=-1)
    if config.router.renormalize:
        top_TK = top_TK / top_TK.sum(dim=-1, keepdim=True)
    gates_TE = torch.zeros_like(probs_TE).scatter(1, experts_TK, top_TK)
    y_TD = torch.zeros_like(x_TD)
    for e in range(config.num_experts):
        y_e = swiglu_ref(x_TD, layer.experts.w_gate_up[e], layer.experts.w_down[e])
        y_TD = y_TD + gates_TE[:, e : e + 1] * y_e
    if layer.shared_experts is not None:
        shared = layer.shared_experts
        s_TD = swiglu_ref(x_TD, shared.w_gate_up, shared.w_down)
        if shared.output_gate is not None:
            s_TD = s_TD * torch.sigmoid(x_TD @ shared.output_gate.T)
        y_TD = y_TD + s_TD
    return y_TD.view(x.shape)


def spread_router(layer: moe.MoE, std: float = 1.0) -> None:
    """Router logits of order 1, so top-k choices are far from ties."""
    with torch.no_grad():
        layer.router.weight.normal_(std=std)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_forward_matches_dense_reference(top_k, renormalize):
    torch.manual_seed(top_k)
    layer = moe.MoE(16, 24, 5, top_k, router=moe.SoftmaxTopKRouter.Config(renormalize=renormalize))
    spread_router(layer)
    x = torch.randn(3, 7, 16)
    y = layer(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y, dense_reference(layer, x), atol=1e-5, rtol=1e-5)


def test_accepts_any_leading_shape_and_is_deterministic():
    torch.manual_seed(0)
    layer = moe.MoE(8, 12, 4, 2)
    spread_router(layer)
    x = torch.randn(2, 3, 5, 8)
    y1, y2 = layer(x), layer(x)
    assert torch.equal(y1, y2)
    torch.testing.assert_close(layer(x.reshape(-1, 8)).reshape(x.shape), y1)
    torch.testing.assert_close(layer(x[0, 0, 0]), y1[0, 0, 0])  # a single [D] vector
    assert layer(torch.randn(0, 8)).shape == (0, 8)


def test_config_and_constructor_forms_agree():
    config = moe.MoEConfig(dim=8, hidden_dim=12, num_experts=4, top_k=2, num_shared_experts=1)
    torch.manual_seed(0)
    a = moe.MoE(config=config)
    torch.manual_seed(0)
    b = moe.MoE.from_config(config)
    torch.manual_seed(0)
    c = moe.MoE(8, 12, 4, 2, num_shared_experts=1)
    assert a.config == b.config == c.config
    for (na, pa), (nb, pb), (nc, pc) in zip(
        a.named_parameters(), b.named_parameters(), c.named_parameters(), strict=True
    ):
        assert na == nb == nc and torch.equal(pa, pb) and torch.equal(pa, pc)
    assert a.experts.w_gate_up.shape == (4, 8, 24) and a.experts.w_down.shape == (4, 12, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.top_k = 3


@pytest.mark.parametrize("gated", [False, True])
def test_shared_experts_add_a_dense_swiglu(gated):
    torch.manual_seed(1)
    layer = moe.MoE(8, 6, 4, 2, num_shared_experts=2, shared_expert_gate=gated)
    spread_router(layer)
    shared = layer.shared_experts
    assert shared.hidden_dim == 12  # num_shared_experts * hidden_dim, fused
    assert (shared.output_gate is not None) == gated
    x = torch.randn(9, 8)
    torch.testing.assert_close(layer(x), dense_reference(layer, x), atol=1e-5, rtol=1e-5)
    routed_only = moe.MoE(8, 6, 4, 2)
    routed_only.load_state_dict({k: v for k, v in layer.state_dict().items() if "shared" not in k})
    s = swiglu_ref(x, shared.w_gate_up, shared.w_down)
    if gated:
        s = s * torch.sigmoid(x @ shared.output_gate.T)
    torch.testing.assert_close(layer(x) - routed_only(x), s, atol=1e-5, rtol=1e-5)


def test_shared_hidden_dim_overrides_the_default():
    layer = moe.MoE(8, 6, 4, 2, num_shared_experts=1, shared_hidden_dim=20)
    assert layer.shared_experts.w_gate_up.shape == (8, 40)
    assert layer.shared_experts.w_down.shape == (20, 8)


def test_reference_dispatcher_agrees_with_kernels_dispatcher():
    torch.manual_seed(2)
    for options in ({}, {"capacity_factor": 0.7}, {"router": "expert_choice"}, {"router": "sigmoid_bias"}):
        layer = moe.MoE(12, 10, 6, 2, **options)
        spread_router(layer)
        x = torch.randn(20, 12)
        fast = layer(x)
        layer.dispatcher = moe.ReferenceDispatcher()
        torch.testing.assert_close(layer(x), fast, atol=1e-5, rtol=1e-5, msg=str(options))


def test_statistics_accumulate_and_reset():
    torch.manual_seed(3)
    layer = moe.MoE(8, 6, 4, 2)
    spread_router(layer)
    x = torch.randn(10, 8)
    layer(x)
    first = layer.last_tokens_per_expert.clone()
    assert int(first.sum()) == 20 and layer.last_drop_fraction == 0.0
    layer(x)
    stats = layer.stats()
    assert stats["expert_counts"] == (2 * first).tolist()
    assert stats["routed_counts"] == stats["expert_counts"]
    assert stats["total_slots"] == 40 and stats["dropped_slots"] == 0 and stats["drop_fraction"] == 0.0
    layer.reset_stats()
    assert layer.stats()["expert_counts"] == [0, 0, 0, 0] and layer.stats()["total_slots"] == 0
    assert layer.last_tokens_per_expert is None
    quiet = moe.MoE(8, 6, 4, 2, track_stats=False)
    quiet(x)
    assert quiet.stats()["total_slots"] == 0
    assert "expert_counts" not in layer.state_dict()  # statistics are not weights


def test_statistics_count_drops():
    torch.manual_seed(4)
    layer = moe.MoE(8, 6, 4, 1, capacity_factor=1.0)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2, 0] = 10.0  # every token with x[:, 0] > 0 prefers expert 2
    x = torch.randn(16, 8)
    x[:, 0] = 1.0
    layer(x)
    # capacity ceil(1.0 * 16 * 1 / 4) = 4: expert 2 keeps 4 of 16 slots.
    assert layer.last_tokens_per_expert.tolist() == [0, 0, 4, 0]
    assert layer.last_drop_fraction == 12 / 16
    stats = layer.stats()
    assert stats["routed_counts"] == [0, 0, 16, 0] and stats["expert_counts"] == [0, 0, 4, 0]
    assert stats["dropped_slots"] == 12 and stats["drop_fraction"] == 0.75


def test_losses_in_training_mode_only_and_differentiable():
    torch.manual_seed(5)
    layer = moe.MoE(8, 6, 4, 2, aux_loss_coef=0.01, z_loss_coef=0.001)
    x = torch.randn(12, 8)
    layer.eval()
    layer(x)
    assert layer.last_aux_loss is None and layer.last_z_loss is None
    assert float(layer.aux_loss) == 0.0
    layer.train()
    layer(x)
    assert layer.last_aux_loss is not None and layer.last_z_loss is not None
    model = torch.nn.Sequential(layer, torch.nn.Linear(8, 8), moe.MoE(8, 6, 4, 2))
    model.train()
    model(x)
    total = moe.collect_aux_losses(model)
    expected = layer.last_aux_loss + layer.last_z_loss + model[2].last_aux_loss
    torch.testing.assert_close(total, expected)
    total.backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    assert moe.moe_layers(model) == [layer, model[2]]


def test_gradients_match_dense_reference_float64():
    torch.manual_seed(6)
    layer = moe.MoE(6, 5, 4, 2, num_shared_experts=1, shared_expert_gate=True, dtype=torch.float64)
    spread_router(layer)
    x = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(11, 6, dtype=torch.float64)
    params = dict(layer.named_parameters())
    grads = torch.autograd.grad((layer(x) * probe).sum(), [x, *params.values()])
    ref_grads = torch.autograd.grad((dense_reference(layer, x) * probe).sum(), [x, *params.values()])
    for name, g, r in zip(["x", *params], grads, ref_grads, strict=True):
        # kernels computes routing weights and the combine in float32, hence 1e-6 rather than 1e-12.
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5, msg=name)
        assert g.abs().sum() > 0, name


def test_gradcheck_float64_tiny_layer():
    torch.manual_seed(0)
    layer = moe.MoE(4, 3, 4, 2, num_shared_experts=1, shared_expert_gate=True, dtype=torch.float64)
    spread_router(layer)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    names = [n for n, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_() for _, p in layer.named_parameters()]

    def f(x, *ps):
        return functional_call(layer, dict(zip(names, ps, strict=True)), (x,))

    # The routing weights and the combine go through float32 inside kernels, so finite differences use
    # eps=1e-3 (no top-k choice flips at this seed; none in 20 seeds tried) and atol=1e-4 against
    # gradients of order 0.1. fast_mode checks random directional derivatives over all inputs at once;
    # the full Jacobian is checked for x and the router weight (the routing path).
    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-3, atol=1e-4, rtol=1e-3, fast_mode=True)
    router_index = names.index("router.weight")

    def g(x, router_weight):
        return f(x, *params[:router_index], router_weight, *params[router_index + 1 :])

    assert torch.autograd.gradcheck(g, (x, params[router_index]), eps=1e-3, atol=1e-4, rtol=1e-3)


def test_bad_input_raises_value_error_naming_the_argument():
    with pytest.raises(ValueError, match="dim"):
        moe.MoE(0, 8, 4, 2)
    with pytest.raises(ValueError, match="top_k"):
        moe.MoE(8, 8, 4, 5)
    with pytest.raises(ValueError, match="num_experts"):
        moe.MoE(8, 8, 0, 1)
    with pytest.raises(ValueError, match="hidden_dim"):
        moe.MoE(8, None, 4, 2)
    with pytest.raises(ValueError, match="capacity_factor"):
        moe.MoE(8, 8, 4, 2, capacity_factor=0.0)
    with pytest.raises(ValueError, match="shared_expert_gate"):
        moe.MoE(8, 8, 4, 2, shared_expert_gate=True)
    with pytest.raises(ValueError, match="config"):
        moe.MoE(8, config=moe.MoEConfig(dim=8, hidden_dim=8, num_experts=4))
    with pytest.raises(TypeError):
        moe.MoEConfig(8, 8, 4)  # keyword-only
    layer = moe.MoE(8, 8, 4, 2)
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., dim=8\]"):
        layer(torch.randn(3, 7))
    with pytest.raises(ValueError, match="x has dtype torch.float64"):
        layer(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must be a torch.Tensor"):
        layer([[0.0] * 8])
    on_meta = moe.MoE(8, 8, 4, 2, device="meta")
    with pytest.raises(ValueError, match="x is on cpu"):
        on_meta(torch.randn(3, 8))
