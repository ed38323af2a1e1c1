"""The oneDNN CPU path: automatic backend choice, the packed-weight cache, and the fused SwiGLU experts.

Legend: M rows in expert order, K/D input features, N output features, E experts, H SwiGLU hidden.
Every result is compared with the plain-PyTorch reference (float64 where it matters).
"""

from __future__ import annotations

import pytest
import torch
from _numerics import rel_err

import kernels
import moe
from kernels.grouped_gemm import onednn_backend, select_backend
from kernels.grouped_gemm.reference import grouped_gemm_reference

pytestmark = pytest.mark.skipif(not kernels.onednn_available(), reason="this PyTorch has no oneDNN")


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv("SPECDEC_GROUPED_GEMM_BACKEND", raising=False)
    kernels.clear_packed_weights()


def test_automatic_choice_is_onednn_for_float32_on_cpu_only(monkeypatch):
    x32 = torch.zeros(2, 3)
    assert select_backend(None, x32) == "onednn"
    assert select_backend(None, x32.double()) == "torch"
    assert select_backend(None, x32.bfloat16()) == "torch"
    assert select_backend("torch", x32) == "torch"  # an explicit choice is kept
    monkeypatch.setenv("SPECDEC_GROUPED_GEMM_BACKEND", "torch")
    assert select_backend(None, x32) == "torch"  # the environment variable wins


def test_packed_weights_follow_in_place_updates_and_data_swaps():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, generator=gen)
    w = torch.randn(2, 5, 4, generator=gen)
    sizes = torch.tensor([3, 4])
    first = kernels.grouped_gemm(x, w, sizes, backend="onednn")
    torch.testing.assert_close(first, grouped_gemm_reference(x, w, sizes))
    assert kernels.grouped_gemm(x, w, sizes, backend="onednn") is not first  # cache hit: same values
    with torch.no_grad():
        w.mul_(-2.0)  # in place: the version counter moves
    torch.testing.assert_close(kernels.grouped_gemm(x, w, sizes, backend="onednn"), -2.0 * first)
    w.data = torch.randn(2, 5, 4, generator=gen)  # new storage under the same tensor object
    torch.testing.assert_close(
        kernels.grouped_gemm(x, w, sizes, backend="onednn"), grouped_gemm_reference(x, w, sizes)
    )


def test_cache_entry_goes_away_with_its_tensor():
    w = torch.randn(2, 5, 4)
    kernels.grouped_gemm(torch.randn(3, 5), w, torch.tensor([1, 2]), backend="onednn")
    assert id(w) in onednn_backend._CACHE
    key = id(w)
    del w
    assert key not in onednn_backend._CACHE


def test_inference_tensors_are_packed_per_call():
    with torch.inference_mode():
        w = torch.randn(2, 5, 4)
        x = torch.randn(6, 5)
        sizes = torch.tensor([4, 2])
        y = kernels.grouped_gemm(x, w, sizes, backend="onednn")
        w.mul_(3.0)  # allowed on inference tensors, and invisible to a version check
        torch.testing.assert_close(
            kernels.grouped_gemm(x, w, sizes, backend="onednn"), 3.0 * y, rtol=1e-5, atol=1e-5
        )


def test_onednn_rejects_other_devices_and_dtypes():
    x, w, sizes = torch.randn(3, 4).double(), torch.randn(1, 4, 2).double(), torch.tensor([3])
    with pytest.raises(ValueError, match="not supported by the 'onednn'"):
        kernels.grouped_gemm(x, w, sizes, backend="onednn")


@pytest.mark.parametrize("layout", ["EKN", "ENK"])
@pytest.mark.parametrize(
    "sizes",
    [[5, 0, 20, 12], [0, 0, 37], [0, 0, 0], [1, 33, 200, 0]],
    ids=["mixed", "one", "none", "both-gate-up-kernels"],  # C gate/up up to 192 rows, oneDNN above
)
def test_grouped_swiglu_matches_the_per_expert_reference(sizes, layout):
    gen = torch.Generator().manual_seed(3)
    dim, hidden = 24, 10
    experts = moe.SwiGLUExperts(len(sizes), dim, hidden)
    x_MD = torch.randn(sum(sizes), dim, generator=gen)
    w_gu, w_d = experts.w_gate_up.detach(), experts.w_down.detach()
    if layout == "ENK":  # nn.Linear-style storage read through transposed views
        w_gu, w_d = (
            w_gu.transpose(1, 2).contiguous().transpose(1, 2),
            w_d.transpose(1, 2).contiguous().transpose(1, 2),
        )
    got = kernels.grouped_swiglu_onednn(x_MD, w_gu, w_d, torch.tensor(sizes), hidden)
    assert got.shape == (sum(sizes), dim)
    start = 0
    for e, m in enumerate(sizes):
        if m:
            expected = experts.expert(e, x_MD[start : start + m].double().float())
            assert rel_err(got[start : start + m], expected) < 1e-5
        start += m


def test_moe_layer_uses_onednn_without_grad_and_autograd_with_it():
    torch.manual_seed(0)
    layer = moe.MoE(32, 48, 4, 2).eval()
    x = torch.randn(2, 9, 32)
    calls = []
    from kernels.grouped_gemm import onednn_backend

    original = onednn_backend._SwigluWeights._gate_up

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(onednn_backend._SwigluWeights, "_gate_up", spy)
        with torch.no_grad():
            fast = layer(x)
        assert calls, "the no-grad CPU float32 forward should take the oneDNN expert path"
        calls.clear()
        slow = layer(x.clone().requires_grad_())
        assert not calls, "with autograd the layer must go through the differentiable grouped GEMM"
    with torch.no_grad():
        layer.experts.backend = "torch"
        reference = layer(x)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(slow.detach(), reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gated", [False, True])
def test_shared_experts_onednn_path_equals_plain_swiglu(gated):
    torch.manual_seed(1)
    shared = moe.SharedExperts(16, 40, gated=gated)
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        fast = shared(x)
    plain = moe.experts.swiglu(x @ shared.w_gate_up, 40) @ shared.w_down
    if gated:
        plain = plain * torch.sigmoid(x @ shared.output_gate.T)
    torch.testing.assert_close(fast, plain.detach(), rtol=1e-5, atol=1e-6)
