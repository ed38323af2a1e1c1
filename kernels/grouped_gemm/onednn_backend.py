"""The "onednn" grouped-GEMM backend: CPU, float32, one oneDNN matmul per group on pre-packed weights.

Legend: M rows in expert order, K input features, N output features, E experts (groups), H SwiGLU hidden.

Why: PyTorch's CPU `torch.mm` goes to MKL, which on non-Intel x86 CPUs (the AMD EPYC machines we
develop on) runs a slower code path; oneDNN (which PyTorch ships as `mkldnn`) JIT-compiles for the
CPU it finds. Measured on the 2-core AMD EPYC development VM, fp32, per expert GEMM (GFLOP/s,
`python -m kernels.grouped_gemm.bench_cpu`): MKL ~205 at M = 128, oneDNN on weights packed once
~500 (and ~65 vs ~38 at M = 1). Results agree with `torch.mm` to fp32 rounding (both accumulate
in fp32; different summation order).

Packed weights: oneDNN reorders each expert's [N, K] matrix into its blocked layout once
(`torch.ops.mkldnn._reorder_linear_weight`); :func:`packed_weights` caches the packed copies per
weight tensor and repacks when the tensor changes (its version counter or data pointer moves, e.g.
after an optimizer step). The cache holds a second copy of the weights while the tensor lives;
:func:`clear_packed_weights` drops it. Tensors created under `torch.inference_mode` have no version
counter, so they are packed on every call (correct, a little slower).

The dW of the backward runs through the torch backend (MKL), dX through this forward.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import Tensor

from .torch_backend import _bounds

__all__ = [
    "onednn_available",
    "packed_weights",
    "clear_packed_weights",
    "grouped_gemm_onednn",
    "linear_onednn",
    "grouped_swiglu_onednn",
    "swiglu_blocks_onednn",
]


@functools.cache
def onednn_available() -> bool:
    """True when this PyTorch build has oneDNN's packed linear ops and oneDNN is enabled."""
    return (
        torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


# id(base tensor) -> (weakref to it, {view key: (version, data_ptr, packed list)})
_CACHE: dict[int, tuple[weakref.ref, dict]] = {}


def clear_packed_weights() -> None:
    """Drop every cached packed weight (they are rebuilt on next use)."""
    _CACHE.clear()


def _version(t: Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


def packed_weights(w: Tensor, trans_w: bool) -> list[Tensor]:
    """oneDNN-packed [N, K] weights of every group: w is [E, K, N], or [E, N, K] when trans_w."""
    version = _version(w)
    if version is None:
        return _pack(w, trans_w)
    base = w._base if w._base is not None else w
    key = (w.storage_offset(), tuple(w.shape), tuple(w.stride()), w.dtype, trans_w)
    entry = _CACHE.get(id(base))
    if entry is None or entry[0]() is not base:
        entry = (weakref.ref(base), {})
        _CACHE[id(base)] = entry
        weakref.finalize(base, _CACHE.pop, id(base), None)
    views = entry[1]
    hit = views.get(key)
    if hit is not None and hit[0] == version and hit[1] == w.data_ptr():
        return hit[2]
    packed = _pack(w, trans_w)
    views[key] = (version, w.data_ptr(), packed)
    return packed


def _pack(w: Tensor, trans_w: bool) -> list[Tensor]:
    with torch.no_grad():
        return [
            torch.ops.mkldnn._reorder_linear_weight((w[e] if trans_w else w[e].t()).contiguous(), None)
            for e in range(w.shape[0])
        ]


def linear_onednn(x_MK: Tensor, packed_NK: Tensor, post_op: str = "none") -> Tensor:
    """y = post_op(x_MK @ W^T) for one packed weight (post_op: oneDNN's "none", "swish", ...)."""
    return torch.ops.mkldnn._linear_pointwise(x_MK, packed_NK, None, post_op, [], "")


def grouped_gemm_onednn(x_MK: Tensor, w: Tensor, group_sizes_E: Tensor, trans_w: bool) -> Tensor:
    """y_MN = x_g @ w[e] per group (w is [E, K, N]), or x_g @ w[e]^T when trans_w (w is [E, N, K])."""
    n = w.shape[1] if trans_w else w.shape[2]
    y_MN = x_MK.new_empty(x_MK.shape[0], n)
    bounds = _bounds(group_sizes_E)
    if not bounds:
        return y_MN
    packed = packed_weights(w, trans_w)
    for e, start, end in bounds:
        y_MN[start:end] = linear_onednn(x_MK[start:end], packed[e])
    return y_MN


def _packed_swiglu(w_gate_up_EDN: Tensor, w_down_EHD: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    trans_gu, trans_d = not w_gate_up_EDN.is_contiguous(), not w_down_EHD.is_contiguous()
    gate_up = packed_weights(w_gate_up_EDN.transpose(1, 2) if trans_gu else w_gate_up_EDN, trans_gu)
    down = packed_weights(w_down_EHD.transpose(1, 2) if trans_d else w_down_EHD, trans_d)
    return gate_up, down


def _swiglu_expert(x_gD: Tensor, gate_up: Tensor, down: Tensor, hidden_dim: int) -> Tensor:
    h = linear_onednn(x_gD, gate_up)
    a = torch.nn.functional.silu(h[:, :hidden_dim]).mul_(h[:, hidden_dim:])
    return linear_onednn(a, down)


def grouped_swiglu_onednn(
    x_MD: Tensor, w_gate_up_EDN: Tensor, w_down_EHD: Tensor, group_sizes_E: Tensor, hidden_dim: int
) -> Tensor:
    """SwiGLU experts over expert-sorted rows, one expert at a time (inference only, no autograd):

        h = x_g @ w_gate_up[e];  a = silu(h[:, :H]) * h[:, H:];  y_g = a @ w_down[e]

    w_gate_up_EDN is [E, D, 2H] (or the transpose of a contiguous [E, 2H, D]); w_down_EHD is [E, H, D]
    (or the transpose of a contiguous [E, D, H]). Going expert by expert keeps each expert's [M_e, 2H]
    intermediate in cache instead of writing a [M, 2H] buffer (measured ~2x faster than two grouped
    GEMMs at T = 2048). The reference is ``moe.SwiGLUExperts.expert``.
    """
    y_MD = x_MD.new_empty(x_MD.shape[0], w_down_EHD.shape[2])
    bounds = _bounds(group_sizes_E)
    if not bounds:
        return y_MD
    gate_up, down = _packed_swiglu(w_gate_up_EDN, w_down_EHD)
    for e, start, end in bounds:
        y_MD[start:end] = _swiglu_expert(x_MD[start:end], gate_up[e], down[e], hidden_dim)
    return y_MD


def swiglu_blocks_onednn(
    x_MD: Tensor, w_gate_up_EDN: Tensor, w_down_EHD: Tensor, group_sizes: list[int], hidden_dim: int
) -> list[Tensor | None]:
    """:func:`grouped_swiglu_onednn`, returning each expert's output block [M_e, D] (None when M_e = 0)
    instead of copying them into one [M, D] tensor: for a combine that reads the blocks in place
    (``kernels.routing.native.combine_blocks_cpu``). ``group_sizes`` is a list of E ints.
    """
    gate_up, down = _packed_swiglu(w_gate_up_EDN, w_down_EHD)
    blocks: list[Tensor | None] = []
    start = 0
    for e, rows in enumerate(group_sizes):
        blocks.append(
            _swiglu_expert(x_MD[start : start + rows], gate_up[e], down[e], hidden_dim) if rows else None
        )
        start += rows
    return blocks
