"""Routing ops: Triton kernels (TRITON_INTERPRET=1 on CPU) and the torch backend against the references.

Legend: T tokens, E experts, K experts per token (top_k), D model dim, M expert-ordered rows.
Gradients are checked against plain autograd through the reference functions.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.routing import reference as ref

BACKENDS = ["triton", "torch"]


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv("SPECDEC_ROUTING_BACKEND", raising=False)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- top-k routing
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renorm"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_topk_routing_matches_reference(backend, top_k, scoring, renormalize, with_bias):
    num_tokens, num_experts = 29, 7
    logits_TE = (2.0 * torch.randn(num_tokens, num_experts, generator=_gen(top_k))).requires_grad_()
    bias_E = torch.randn(num_experts, generator=_gen(99)) if with_bias else None
    kwargs = dict(scoring=scoring, renormalize=renormalize, bias_E=bias_E)
    weights_TK, experts_TK = kernels.topk_routing(logits_TE, top_k, backend=backend, **kwargs)
    weights_ref, experts_ref = ref.topk_routing_reference(logits_TE, top_k, **kwargs)
    assert weights_TK.dtype == torch.float32 and experts_TK.dtype == torch.int64
    assert torch.equal(experts_TK, experts_ref)
    torch.testing.assert_close(weights_TK, weights_ref, atol=1e-6, rtol=1e-5)
    if renormalize:
        torch.testing.assert_close(weights_TK.sum(-1), torch.ones(num_tokens))

    grad_TK = torch.randn(num_tokens, top_k, generator=_gen(5))
    (grad_logits,) = torch.autograd.grad(weights_TK, logits_TE, grad_TK)
    (grad_ref,) = torch.autograd.grad(weights_ref, logits_TE, grad_TK)
    torch.testing.assert_close(grad_logits, grad_ref, atol=1e-6, rtol=1e-5)


def test_bias_changes_the_choice_but_not_the_weights():
    """DeepSeek-V3 aux-loss-free balancing: a large bias on expert 3 makes every token pick it."""
    logits_TE = torch.randn(16, 6, generator=_gen(1))
    bias_E = torch.zeros(6)
    bias_E[3] = 100.0
    for backend in BACKENDS:
        weights_TK, experts_TK = kernels.topk_routing(
            logits_TE, 2, scoring="sigmoid", bias_E=bias_E, backend=backend
        )
        assert (experts_TK[:, 0] == 3).all()
        torch.testing.assert_close(weights_TK[:, 0], torch.sigmoid(logits_TE[:, 3]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_go_to_the_lower_expert(backend):
    """A zero-initialised router scores every expert equally: experts 0..K-1, deterministically."""
    weights_TK, experts_TK = kernels.topk_routing(torch.zeros(5, 8), 3, backend=backend)
    assert torch.equal(experts_TK, torch.arange(3).expand(5, 3))
    torch.testing.assert_close(weights_TK, torch.full((5, 3), 1 / 8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_routing_bf16_logits(backend):
    logits_TE = torch.randn(21, 9, generator=_gen(2)).bfloat16().requires_grad_()
    weights_TK, experts_TK = kernels.topk_routing(logits_TE, 2, renormalize=True, backend=backend)
    weights_ref, experts_ref = ref.topk_routing_reference(
        logits_TE, 2, scoring="softmax", renormalize=True, bias_E=None
    )
    assert torch.equal(experts_TK, experts_ref)
    torch.testing.assert_close(weights_TK, weights_ref)
    grad_TK = torch.randn(21, 2, generator=_gen(3))
    (grad_logits,) = torch.autograd.grad(weights_TK, logits_TE, grad_TK)
    (grad_ref,) = torch.autograd.grad(weights_ref, logits_TE, grad_TK)
    assert grad_logits.dtype == torch.bfloat16
    torch.testing.assert_close(grad_logits, grad_ref)


@pytest.mark.parametrize("num_experts", [4, 130])
def test_topk_routing_many_experts(num_experts):
    """E above the row-block heuristics (E_PAD = 256) and E equal to a power of two."""
    logits_TE = torch.randn(40, num_experts, generator=_gen(num_experts))
    weights_TK, experts_TK = kernels.topk_routing(logits_TE, 4, scoring="sigmoid", backend="triton")
    weights_ref, experts_ref = ref.topk_routing_reference(
        logits_TE, 4, scoring="sigmoid", renormalize=False, bias_E=None
    )
    assert torch.equal(experts_TK, experts_ref)
    torch.testing.assert_close(weights_TK, weights_ref)


# --------------------------------------------------------------------------- sort by expert
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts"),
    [(23, 2, 8), (17, 4, 5), (1, 1, 1), (0, 2, 3), (200, 3, 130), (50, 1, 64)],
    ids=["mixtral-like", "top4", "single", "no-tokens", "multi-block-E130", "mostly-empty-E64"],
)
def test_sort_by_expert_matches_stable_sort(backend, num_tokens, top_k, num_experts):
    experts_TK = torch.randint(0, num_experts, (num_tokens, top_k), generator=_gen(num_tokens))
    if num_tokens > 4 and num_experts > 2:
        experts_TK[: num_tokens // 2, 0] = 1  # a crowded expert
        experts_TK[experts_TK == 2] = 0  # an empty expert in the middle
    result = kernels.sort_by_expert(experts_TK, num_experts, backend=backend)
    sorted_slots_M, group_sizes_E, offsets_E1 = result
    expected = ref.sort_by_expert_reference(experts_TK, num_experts)
    for got, want in zip(result, expected, strict=True):
        assert got.dtype == torch.int64
        assert torch.equal(got, want)
    # independent checks: a permutation, grouped by expert, ascending inside each group
    flat_M = experts_TK.reshape(-1)
    assert torch.equal(torch.sort(sorted_slots_M).values, torch.arange(flat_M.numel()))
    assert torch.equal(flat_M[sorted_slots_M], torch.sort(flat_M).values)
    assert int(group_sizes_E.sum()) == flat_M.numel() and offsets_E1[0] == 0
    for e in range(num_experts):
        group = sorted_slots_M[offsets_E1[e] : offsets_E1[e + 1]]
        assert (group[1:] > group[:-1]).all()


def test_sort_by_expert_accepts_int32_ids():
    experts_TK = torch.randint(0, 6, (19, 2), generator=_gen(4), dtype=torch.int32)
    got = kernels.sort_by_expert(experts_TK, 6, backend="triton")
    want = ref.sort_by_expert_reference(experts_TK, 6)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


# --------------------------------------------------------------------------- permute / unpermute
def _routing(num_tokens, top_k, num_experts, drop, seed):
    logits_TE = torch.randn(num_tokens, num_experts, generator=_gen(seed))
    weights_TK = torch.rand(num_tokens, top_k, generator=_gen(seed + 1)) + 0.1
    experts_TK = torch.sort(logits_TE, dim=-1, descending=True).indices[:, :top_k]
    sorted_slots_M = ref.sort_by_expert_reference(experts_TK, num_experts)[0]
    if drop:  # capacity dropping: keep a subset of the slots, still in expert order
        keep = torch.rand(sorted_slots_M.shape[0], generator=_gen(seed + 2)) > 0.3
        sorted_slots_M = sorted_slots_M[keep]
    return sorted_slots_M, weights_TK


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
@pytest.mark.parametrize("drop", [False, True], ids=["dropless", "dropped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_permute_unpermute_match_reference(backend, top_k, drop, dtype):
    num_tokens, num_experts, dim = 13, 5, 19
    sorted_slots_M, weights_TK = _routing(num_tokens, top_k, num_experts, drop, seed=top_k)
    num_rows = sorted_slots_M.shape[0]
    x_TD = torch.randn(num_tokens, dim, generator=_gen(7)).to(dtype).requires_grad_()
    x_MD = kernels.permute(x_TD, sorted_slots_M, top_k, backend=backend)
    assert torch.equal(x_MD, ref.permute_reference(x_TD, sorted_slots_M, top_k))
    grad_MD = torch.randn(num_rows, dim, generator=_gen(8)).to(dtype)
    (grad_x,) = torch.autograd.grad(x_MD, x_TD, grad_MD)
    x_ref = x_TD.detach().double().requires_grad_()
    (grad_x_ref,) = torch.autograd.grad(
        ref.permute_reference(x_ref, sorted_slots_M, top_k), x_ref, grad_MD.double()
    )
    torch.testing.assert_close(grad_x.double(), grad_x_ref, **_tol(dtype))

    y_MD = torch.randn(num_rows, dim, generator=_gen(9)).to(dtype).requires_grad_()
    weights = weights_TK.clone().requires_grad_()
    out_TD = kernels.unpermute(y_MD, sorted_slots_M, weights, backend=backend)
    y_ref = y_MD.detach().double().requires_grad_()
    w_ref = weights_TK.double().requires_grad_()
    out_ref = ref.unpermute_reference(y_ref, sorted_slots_M, w_ref, num_tokens, top_k)
    assert out_TD.dtype == dtype and out_TD.shape == (num_tokens, dim)
    torch.testing.assert_close(out_TD.double(), out_ref, **_tol(dtype))
    grad_TD = torch.randn(num_tokens, dim, generator=_gen(10)).to(dtype)
    grad_y, grad_w = torch.autograd.grad(out_TD, (y_MD, weights), grad_TD)
    grad_y_ref, grad_w_ref = torch.autograd.grad(out_ref, (y_ref, w_ref), grad_TD.double())
    torch.testing.assert_close(grad_y.double(), grad_y_ref, **_tol(dtype))
    torch.testing.assert_close(grad_w.double(), grad_w_ref, **_tol(dtype))


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def test_unpermute_wide_rows_span_several_tiles():
    """D = 200 needs two 128-wide column tiles in the combine and two passes in the backward."""
    sorted_slots_M, weights_TK = _routing(9, 2, 4, drop=False, seed=11)
    y_MD = torch.randn(18, 200, generator=_gen(12), requires_grad=True)
    weights = weights_TK.requires_grad_()
    out_TD = kernels.unpermute(y_MD, sorted_slots_M, weights, backend="triton")
    out_ref = ref.unpermute_reference(y_MD, sorted_slots_M, weights, 9, 2)
    torch.testing.assert_close(out_TD, out_ref)
    grad_TD = torch.randn(9, 200, generator=_gen(13))
    got = torch.autograd.grad(out_TD, (y_MD, weights), grad_TD)
    want = torch.autograd.grad(out_ref, (y_MD, weights), grad_TD)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------- the ops together
def test_moe_forward_backward_triton_equals_torch():
    """A whole dropless SwiGLU MoE through the public API: Triton backends against torch backends."""
    num_tokens, dim, hidden, num_experts, top_k = 11, 24, 20, 6, 2
    gen = _gen(20)
    params = {
        "x": torch.randn(num_tokens, dim, generator=gen),
        "router": torch.randn(dim, num_experts, generator=gen) * 0.5,
        "w1": torch.randn(num_experts, dim, hidden, generator=gen) * 0.2,
        "w3": torch.randn(num_experts, dim, hidden, generator=gen) * 0.2,
        "w2": torch.randn(num_experts, hidden, dim, generator=gen) * 0.2,
    }

    def run(backend):
        p = {name: t.clone().requires_grad_() for name, t in params.items()}
        weights_TK, experts_TK = kernels.topk_routing(
            p["x"] @ p["router"], top_k, renormalize=True, backend=backend
        )
        slots_M, sizes_E, _ = kernels.sort_by_expert(experts_TK, num_experts, backend=backend)
        x_MD = kernels.permute(p["x"], slots_M, top_k, backend=backend)
        gate = kernels.grouped_gemm(x_MD, p["w1"], sizes_E, backend=backend)
        up = kernels.grouped_gemm(x_MD, p["w3"], sizes_E, backend=backend)
        y_MD = kernels.grouped_gemm(torch.nn.functional.silu(gate) * up, p["w2"], sizes_E, backend=backend)
        out_TD = kernels.unpermute(y_MD, slots_M, weights_TK, backend=backend)
        out_TD.square().sum().backward()
        return out_TD.detach(), {name: t.grad for name, t in p.items()}

    out_triton, grads_triton = run("triton")
    out_torch, grads_torch = run("torch")
    torch.testing.assert_close(out_triton, out_torch, atol=1e-5, rtol=1e-5)
    for name in params:
        torch.testing.assert_close(grads_triton[name], grads_torch[name], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_routing_pipeline_with_no_tokens(backend):
    """A rank (or batch) with zero tokens: every op returns empty tensors, forward and backward."""
    x_TD = torch.randn(0, 8, requires_grad=True)
    weights_TK, experts_TK = kernels.topk_routing(torch.randn(0, 4), 2, backend=backend)
    weights_TK = weights_TK.detach().requires_grad_(True)
    plan = kernels.sort_by_expert(experts_TK, 4, backend=backend)
    assert plan.group_sizes_E.tolist() == [0, 0, 0, 0]
    x_MD = kernels.permute(x_TD, plan.sorted_slots_M, 2, backend=backend)
    y_MN = kernels.grouped_gemm(x_MD, torch.randn(4, 8, 8), plan.group_sizes_E, backend=backend)
    out_TD = kernels.unpermute(y_MN, plan.sorted_slots_M, weights_TK, backend=backend)
    assert out_TD.shape == (0, 8)
    out_TD.sum().backward()
    assert x_TD.grad.shape == (0, 8) and weights_TK.grad.shape == (0, 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_choice_follows_the_logits_when_scores_round_equal(backend, scoring):
    """sigmoid(20) and sigmoid(30) are both 1.0 in float32 (softmax likewise rounds tiny gaps away):
    without a bias the expert with the larger logit wins, whatever the scores round to. (Found on an
    H200: Triton's exp and torch's ordered near-equal sigmoid scores differently at E=128, k=8.)"""
    logits_TE = torch.tensor([[20.0, 30.0, -5.0, 25.0], [0.0, 1e-7, 0.0, -1.0]])
    _, experts_TK = kernels.topk_routing(logits_TE, 2, scoring=scoring, backend=backend)
    assert experts_TK.tolist() == [[1, 3], [1, 0]]
