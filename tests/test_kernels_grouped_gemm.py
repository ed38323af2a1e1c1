"""Grouped GEMM: Triton (under TRITON_INTERPRET=1 on CPU), torch and oneDNN backends against the reference.

Legend: M rows in expert order, K input features, N output features, E experts (groups).
Forward and backward (dX, dW) are compared with plain autograd through the float64 reference, by
relative Frobenius error: fp32 far below 1e-5, bf16 operands below 1e-2 (bf16 output rounding ~4e-3).
"""

from __future__ import annotations

import pytest
import torch
from _numerics import rel_err

import kernels
from kernels.grouped_gemm.reference import grouped_gemm_reference, grouped_gemm_weight_grad_reference

# (M, K, N, group sizes): odd sizes, empty groups (first, middle, last), a single group, no rows at all,
# shapes that are not multiples of the 16-wide interpreter tiles, and a TMA-aligned shape.
CASES = [
    pytest.param(37, 19, 23, [5, 0, 20, 12], id="odd-empty-middle"),
    pytest.param(64, 32, 48, [16, 0, 40, 8], id="tma-aligned"),
    pytest.param(45, 24, 40, [0, 0, 45], id="empty-first"),
    pytest.param(33, 17, 9, [33, 0, 0, 0, 0], id="one-group-empty-tail"),
    pytest.param(0, 16, 16, [0, 0], id="no-rows"),
    pytest.param(19, 40, 35, [1, 2, 0, 3, 5, 0, 7, 1, 0], id="nine-experts"),
]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _make(m, k, n, sizes, dtype, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x_MK = torch.randn(m, k, generator=gen).to(dtype)
    if layout == "EKN":
        w_EKN = torch.randn(len(sizes), k, n, generator=gen).to(dtype)
    else:  # nn.Linear-style [E, N, K] storage, passed as a transposed view
        w_EKN = torch.randn(len(sizes), n, k, generator=gen).to(dtype).transpose(1, 2)
    return x_MK, w_EKN, torch.tensor(sizes, dtype=torch.int64)


@pytest.mark.parametrize("backend", ["triton", "torch", "onednn"])
@pytest.mark.parametrize("layout", ["EKN", "ENK"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("m", "k", "n", "sizes"), CASES)
def test_forward_and_backward_match_reference(m, k, n, sizes, dtype, layout, backend, monkeypatch):
    monkeypatch.delenv("SPECDEC_GROUPED_GEMM_BACKEND", raising=False)
    x_MK, w_EKN, group_sizes_E = _make(m, k, n, sizes, dtype, layout)
    x = x_MK.clone().requires_grad_()
    w = w_EKN.detach().clone() if layout == "EKN" else w_EKN.detach().transpose(1, 2).clone().transpose(1, 2)
    w.requires_grad_()
    if backend == "onednn" and dtype != torch.float32:  # float32 only: a clear error, not a silent cast
        with pytest.raises(ValueError, match="not supported by the 'onednn'"):
            kernels.grouped_gemm(x, w, group_sizes_E, backend=backend)
        return
    y_MN = kernels.grouped_gemm(x, w, group_sizes_E, backend=backend)
    assert y_MN.shape == (m, n) and y_MN.dtype == dtype

    x_ref = x_MK.double().requires_grad_()
    w_ref = w_EKN.double().requires_grad_()
    y_ref = grouped_gemm_reference(x_ref, w_ref, group_sizes_E)
    tol = TOLERANCE[dtype]
    assert rel_err(y_MN, y_ref) < tol

    dy_MN = torch.randn(m, n, generator=torch.Generator().manual_seed(1)).to(dtype)
    dx, dw = torch.autograd.grad(y_MN, (x, w), dy_MN)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x_ref, w_ref), dy_MN.double())
    assert dx.shape == x.shape and dw.shape == w.shape
    assert rel_err(dx, dx_ref) < tol
    assert rel_err(dw, dw_ref) < tol
    for e, size in enumerate(sizes):  # an empty group's weight gradient is exactly zero
        if size == 0:
            assert torch.count_nonzero(dw[e]) == 0


@pytest.mark.parametrize("tma", ["1", "0"])
def test_tma_and_pointer_paths_agree(tma, monkeypatch):
    """The TMA-descriptor path and the masked-pointer path of the forward kernel compute the same thing."""
    from kernels.grouped_gemm import triton_kernel

    monkeypatch.setenv(triton_kernel.TMA_ENV_VAR, tma)
    x_MK, w_EKN, group_sizes_E = _make(64, 32, 48, [16, 0, 40, 8], torch.float32, "EKN", seed=3)
    assert triton_kernel._tma_ok(x_MK, w_EKN) == (tma == "1")
    y_MN = kernels.grouped_gemm(x_MK, w_EKN, group_sizes_E, backend="triton")
    y_ref = grouped_gemm_reference(x_MK.double(), w_EKN.double(), group_sizes_E)
    assert rel_err(y_MN, y_ref) < 1e-5


@pytest.mark.parametrize("trans_w", [False, True], ids=["EKN", "ENK"])
def test_every_autotune_candidate_is_correct(trans_w, monkeypatch):
    """Each config the autotuner may pick (TMA or pointer loads, flattened loop or not) computes the same
    function, writing every output element: the GPU run checks its own, larger list the same way."""
    from kernels.grouped_gemm import triton_kernel

    monkeypatch.setattr(triton_kernel, "_empty", lambda like, *shape: like.new_full(shape, float("nan")))
    m, k, n, sizes = 64, 32, 48, [16, 0, 40, 8]
    x_MK, w_EKN, group_sizes_E = _make(m, k, n, sizes, torch.float32, "EKN", seed=7)
    w = w_EKN.transpose(1, 2).contiguous() if trans_w else w_EKN
    y_ref = grouped_gemm_reference(x_MK.double(), w_EKN.double(), group_sizes_E)
    configs = triton_kernel._forward_configs()
    assert {(c.kwargs["USE_TMA"], c.kwargs["FLATTEN"]) for c in configs} == {
        (True, True),
        (True, False),
        (False, True),
        (False, False),
    }
    for config in configs:
        y_MN = triton_kernel.grouped_gemm_triton_config(x_MK, w, group_sizes_E, trans_w, config)
        assert torch.isfinite(y_MN).all(), config
        assert rel_err(y_MN, y_ref) < 1e-5, config


def test_tma_config_without_descriptors_is_refused(monkeypatch):
    from kernels.grouped_gemm import triton_kernel

    monkeypatch.setenv(triton_kernel.TMA_ENV_VAR, "0")
    x_MK, w_EKN, group_sizes_E = _make(64, 32, 48, [16, 0, 40, 8], torch.float32, "EKN", seed=8)
    tma_config = next(c for c in triton_kernel._forward_configs() if c.kwargs["USE_TMA"])
    with pytest.raises(ValueError, match="TMA"):
        triton_kernel.grouped_gemm_triton_config(x_MK, w_EKN, group_sizes_E, False, tma_config)


def test_prune_keeps_only_runnable_configs(monkeypatch):
    """Without descriptors no TMA config survives; SPECDEC_TRITON_FLATTEN=0 drops the flattened loops."""
    from kernels.grouped_gemm import triton_kernel

    configs = [
        triton_kernel._config(*tile, use_tma=tma, flatten=flat)
        for tile in triton_kernel.FORWARD_TILES
        for tma in (True, False)
        for flat in (True, False)
    ]
    x16 = torch.empty(4, 4, dtype=torch.bfloat16)
    monkeypatch.setattr(triton_kernel, "triton_interpreting", lambda: False)
    kept = triton_kernel._prune_configs(configs, {"x_ptr": x16, "TMA_OK": 0})
    assert kept and not any(c.kwargs["USE_TMA"] for c in kept)
    assert any(c.kwargs["FLATTEN"] for c in kept)
    monkeypatch.setenv(triton_kernel.FLATTEN_ENV_VAR, "0")
    kept = triton_kernel._prune_configs(configs, {"x_ptr": x16, "TMA_OK": 1})
    assert kept and not any(c.kwargs["FLATTEN"] for c in kept)
    assert any(c.kwargs["USE_TMA"] for c in kept)
    x32 = torch.empty(4, 4, dtype=torch.float32)  # fp32: the 128x256x64 three-stage tile (288 KiB) is out
    kept = triton_kernel._prune_configs(configs, {"x_ptr": x32, "TMA_OK": 1})
    assert all(
        c.num_stages * (c.kwargs["BM"] + c.kwargs["BN"]) * c.kwargs["BK"] * 4 <= 200 * 1024 for c in kept
    )
    monkeypatch.setenv(triton_kernel.AUTOTUNE_ENV_VAR, "0")
    assert len(triton_kernel._prune_configs(configs, {"x_ptr": x16, "TMA_OK": 1})) == 1


def test_every_output_element_is_written(monkeypatch):
    """Outputs start as NaN: a tile the schedule skipped would leave NaN behind."""
    from kernels.grouped_gemm import triton_kernel

    monkeypatch.setattr(triton_kernel, "_empty", lambda like, *shape: like.new_full(shape, float("nan")))
    x_MK, w_EKN, group_sizes_E = _make(37, 19, 23, [5, 0, 20, 12], torch.float32, "EKN", seed=4)
    y_MN = triton_kernel.grouped_gemm_triton(x_MK, w_EKN, group_sizes_E, False)
    dw_EKN = triton_kernel.grouped_gemm_weight_grad_triton(x_MK, y_MN, group_sizes_E)
    assert torch.isfinite(y_MN).all() and torch.isfinite(dw_EKN).all()
    expected = grouped_gemm_weight_grad_reference(x_MK.double(), y_MN.double(), group_sizes_E)
    assert rel_err(dw_EKN, expected) < 1e-5
    assert torch.count_nonzero(dw_EKN[1]) == 0  # the empty group


def test_group_sizes_may_be_int32_and_results_are_deterministic():
    x_MK, w_EKN, _ = _make(37, 19, 23, [5, 0, 20, 12], torch.float32, "EKN", seed=5)
    sizes32 = torch.tensor([5, 0, 20, 12], dtype=torch.int32)
    first = kernels.grouped_gemm(x_MK, w_EKN, sizes32, backend="triton")
    second = kernels.grouped_gemm(x_MK, w_EKN, sizes32, backend="triton")
    assert torch.equal(first, second)
    assert torch.allclose(first, kernels.grouped_gemm(x_MK, w_EKN, sizes32, backend="torch"), atol=1e-5)


def test_tma_failure_falls_back_to_pointer_loads(monkeypatch):
    """A Triton build that cannot lower the TMA kernel must not break grouped_gemm: warn, then go on."""
    from kernels.grouped_gemm import triton_kernel

    def broken(*args, **kwargs):
        raise RuntimeError("simulated TMA lowering failure")

    monkeypatch.setattr(triton_kernel.TensorDescriptor, "from_tensor", broken)
    monkeypatch.setattr(triton_kernel, "_TMA_FAILURE", None)
    x_MK, w_EKN, group_sizes_E = _make(64, 32, 48, [16, 0, 40, 8], torch.float32, "EKN", seed=6)
    with pytest.warns(UserWarning, match="TMA path failed"):
        y_MN = kernels.grouped_gemm(x_MK, w_EKN, group_sizes_E, backend="triton")
    assert triton_kernel._TMA_FAILURE is not None and not triton_kernel._tma_ok(x_MK, w_EKN)
    y_ref = grouped_gemm_reference(x_MK.double(), w_EKN.double(), group_sizes_E)
    assert rel_err(y_MN, y_ref) < 1e-5
