"""The fused C routing path (kernels/routing/native.py, moe/native_cpu.py) against the references.

Every native op is compared with the plain-PyTorch reference it replaces, over a grid of token counts,
expert counts, top-k, scoring functions, renormalisation, selection bias and scale; and the MoE layer's
native forward with the general path (forced by SPECDEC_ROUTING_BACKEND=torch), statistics included.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import kernels
import moe
from kernels.routing.reference import (
    permute_reference,
    sort_by_expert_reference,
    topk_routing_reference,
    unpermute_reference,
)
from moe.dispatch import ReferenceDispatcher

pytestmark = pytest.mark.skipif(
    not kernels.native_routing_available(), reason="no C compiler: the native routing path is off"
)


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 300])
@pytest.mark.parametrize("num_experts,top_k", [(1, 1), (4, 1), (8, 2), (8, 4), (64, 6)])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_sorted_equals_reference(num_tokens, num_experts, top_k, scoring, renormalize):
    gen = torch.Generator().manual_seed(num_tokens * 1000 + num_experts * 10 + top_k)
    logits_TE = torch.randn(num_tokens, num_experts, generator=gen) * 2
    for bias_E, scale in ((None, 1.0), (torch.randn(num_experts, generator=gen) * 0.3, 2.5)):
        route = kernels.route_sorted_cpu(
            logits_TE, top_k, scoring=scoring, renormalize=renormalize, bias_E=bias_E, scale=scale
        )
        weights_TK, experts_TK = topk_routing_reference(
            logits_TE, top_k, scoring=scoring, renormalize=renormalize, bias_E=bias_E
        )
        assert torch.equal(route.experts_TK, experts_TK)
        torch.testing.assert_close(route.weights_TK, weights_TK * scale, rtol=2e-6, atol=1e-7)
        sorted_slots_M, group_sizes_E, offsets_E1 = sort_by_expert_reference(experts_TK, num_experts)
        assert torch.equal(route.sorted_slots_M, sorted_slots_M)
        assert torch.equal(route.group_sizes_E, group_sizes_E)
        assert torch.equal(route.expert_offsets_E, offsets_E1[:-1])
        assert torch.equal(route.token_of_row_M, sorted_slots_M // top_k)
        rows = torch.arange(sorted_slots_M.numel())
        assert torch.equal(route.row_of_slot_S[sorted_slots_M], rows)


def test_route_sorted_ties_go_to_the_lower_expert():
    route = kernels.route_sorted_cpu(torch.zeros(3, 6), 2, renormalize=True)  # a zero-initialised router
    assert route.experts_TK.tolist() == [[0, 1]] * 3
    assert torch.equal(route.weights_TK, torch.full((3, 2), 0.5))


@pytest.mark.parametrize("num_tokens,top_k,dim", [(1, 1, 5), (9, 2, 33), (200, 3, 130)])
def test_gather_and_combine_blocks_equal_permute_and_unpermute(num_tokens, top_k, dim):
    gen = torch.Generator().manual_seed(dim)
    num_experts = 5
    route = kernels.route_sorted_cpu(
        torch.randn(num_tokens, num_experts, generator=gen), top_k, renormalize=True
    )
    x_TD = torch.randn(num_tokens, dim, generator=gen)
    x_MD = kernels.gather_rows_cpu(x_TD, route)
    assert torch.equal(x_MD, permute_reference(x_TD, route.sorted_slots_M, top_k))
    y_MD = torch.randn(num_tokens * top_k, dim, generator=gen)
    blocks = [
        y_MD[start : start + size].clone() if size else None
        for start, size in zip(route.expert_offsets_E.tolist(), route.group_sizes_E.tolist(), strict=True)
    ]
    out_TD = kernels.combine_blocks_cpu(blocks, route, dim)
    expected = unpermute_reference(y_MD, route.sorted_slots_M, route.weights_TK, num_tokens, top_k)
    torch.testing.assert_close(out_TD, expected, rtol=1e-6, atol=1e-6)


def test_native_ops_reject_bad_input():
    logits = torch.randn(4, 3)
    with pytest.raises(ValueError, match="top_k"):
        kernels.route_sorted_cpu(logits, 4)
    with pytest.raises(ValueError, match="logits_TE"):
        kernels.route_sorted_cpu(logits.double(), 2)
    with pytest.raises(ValueError, match="scoring"):
        kernels.route_sorted_cpu(logits, 2, scoring="relu")
    with pytest.raises(ValueError, match="bias_E"):
        kernels.route_sorted_cpu(logits, 2, bias_E=torch.zeros(4))
    route = kernels.route_sorted_cpu(logits, 2)
    with pytest.raises(ValueError, match="x_TD"):
        kernels.gather_rows_cpu(torch.randn(5, 8), route)
    blocks = [torch.zeros(int(n), 8) if n else None for n in route.group_sizes_E.tolist()]
    with pytest.raises(ValueError, match="blocks_E"):
        kernels.combine_blocks_cpu(blocks[:-1], route, 8)
    nonempty = next(e for e, n in enumerate(route.group_sizes_E.tolist()) if n)
    blocks[nonempty] = torch.zeros(int(route.group_sizes_E[nonempty]) + 1, 8)
    with pytest.raises(ValueError, match=rf"blocks_E\[{nonempty}\]"):
        kernels.combine_blocks_cpu(blocks, route, 8)


LAYER_OPTIONS = [
    {"router": "softmax_topk", "top_k": 2},
    {"router": moe.SoftmaxTopKRouter.Config(renormalize=False, routed_scaling_factor=1.5), "top_k": 3},
    {"router": "switch", "top_k": 1},
    {"router": "sigmoid_bias", "top_k": 2},
    {"router": "softmax_topk", "top_k": 2, "num_shared_experts": 1, "shared_expert_gate": True},
]


def _spy_native(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = kernels.route_sorted_cpu

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels, "route_sorted_cpu", spy)
    return calls


@pytest.mark.parametrize("options", LAYER_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("shape", [(1, 24), (3, 5, 24), (130, 24)])
def test_layer_native_path_equals_general_path(monkeypatch, options, shape):
    torch.manual_seed(0)
    layer = moe.MoE(24, 40, 6, **options).eval()
    with torch.no_grad():
        layer.router.weight.normal_(std=0.5)
        if options["router"] == "sigmoid_bias":
            layer.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 6))
    x = torch.randn(*shape)
    calls = _spy_native(monkeypatch)
    with torch.inference_mode():
        native = layer(x)
        native_stats, native_last = layer.stats(), layer.last_tokens_per_expert.clone()
    assert calls, "CPU float32 inference should take the native path"
    layer.reset_stats()
    calls.clear()
    monkeypatch.setenv("SPECDEC_ROUTING_BACKEND", "torch")
    with torch.inference_mode():
        general = layer(x)
    assert not calls, "a forced routing backend must take the general path"
    torch.testing.assert_close(native, general, rtol=1e-6, atol=1e-6)
    assert native_stats == layer.stats()
    assert torch.equal(native_last, layer.last_tokens_per_expert)
    assert layer.last_aux_loss is None and layer.last_drop_fraction == 0.0


@pytest.mark.parametrize(
    "case",
    ["grad", "training", "capacity", "expert_choice", "float64", "backend", "experts_backend", "hook"],
)
def test_layer_takes_the_general_path_where_native_does_not_apply(monkeypatch, case):
    options = {"capacity": {"capacity_factor": 1.0}, "expert_choice": {"router": "expert_choice"}}
    options["backend"] = {"backend": "torch"}
    layer = moe.MoE(16, 24, 4, 2, **options.get(case, {})).eval()
    x = torch.randn(10, 16)
    if case == "float64":
        layer, x = layer.double(), x.double()
    if case == "experts_backend":
        layer.experts.backend = "torch"
    if case == "training":
        layer.train()
    seen = []
    if case == "hook":  # a router hook must keep seeing every routing decision
        layer.router.register_forward_hook(lambda _m, _i, out: seen.append(out.experts_TK))
    calls = _spy_native(monkeypatch)
    if case == "grad":
        layer(x.requires_grad_()).sum().backward()
        assert x.grad is not None
    else:
        with torch.no_grad():
            layer(x)
    assert not calls
    assert len(seen) == (case == "hook")


def test_a_router_config_gives_the_native_path_its_rule(monkeypatch):
    """A plugin top-k router (a Config naming its rule) takes the native path, with the general path's
    numbers; a subclass that inherits its parent's Config (it may route otherwise) does not."""

    @moe.register_router("test_sigmoid_topk")
    class SigmoidTopK(moe.TopKRouter):
        @dataclass(frozen=True, kw_only=True)
        class Config(moe.RouterConfig):
            name: str = "test_sigmoid_topk"

            def topk_options(self, router):
                return {"scoring": "sigmoid", "renormalize": False}

    @moe.register_router("test_subclass")
    class Subclass(moe.SoftmaxTopKRouter):
        pass

    try:
        x = torch.randn(9, 16)
        for name, native in (("test_sigmoid_topk", True), ("test_subclass", False)):
            torch.manual_seed(0)
            config = moe.SoftmaxTopKRouter.Config if name == "test_subclass" else SigmoidTopK.Config
            layer = moe.MoE(16, 24, 4, 2, router=name).eval()
            assert type(layer.config.router) is config and layer.config.router.name == name
            calls = _spy_native(monkeypatch)
            with torch.no_grad():
                out = layer(x)
            assert bool(calls) == native, name
            layer.native_cpu = False
            with torch.no_grad():
                torch.testing.assert_close(out, layer(x), rtol=1e-6, atol=1e-6)
            monkeypatch.undo()
    finally:
        moe.ROUTERS.unregister("test_sigmoid_topk")
        moe.ROUTERS.unregister("test_subclass")


def test_without_a_compiler_the_layer_takes_the_general_path(monkeypatch, tmp_path):
    from kernels.routing import native

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # nothing cached there
    native._library.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="no-such-cc"):
            kernels.native.build_library(native._SOURCE)
        assert not kernels.native_routing_available()
        layer = moe.MoE(16, 24, 4, 2).eval()
        x = torch.randn(5, 16)
        calls = _spy_native(monkeypatch)
        with torch.no_grad():
            out = layer(x)
        assert not calls
        layer.dispatcher = ReferenceDispatcher()  # the plain-PyTorch oracle
        with torch.no_grad():
            torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-6)
    finally:
        native._library.cache_clear()
