"""The "torch" grouped-GEMM backend: one torch.mm per non-empty group, written into a preallocated output.

Legend: M rows in expert order, K input features, N output features, E experts (groups).

This is the CPU fast path (and the fallback on GPUs without Triton). A loop of BLAS calls on contiguous
row slices was measured faster on CPU than torch._grouped_mm for the MoE shapes we care about (see
docs/kernels.md and `python -m experiments.bench_grouped_gemm`). Writing each product straight into its
slice of the output (`out=`) avoids the torch.cat copy of the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _bounds(group_sizes_E: Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) for every non-empty group."""
    bounds, start = [], 0
    for e, m in enumerate(group_sizes_E.tolist()):
        if m:
            bounds.append((e, start, start + m))
        start += m
    return bounds


def grouped_gemm_torch(x_MK: Tensor, w: Tensor, group_sizes_E: Tensor, trans_w: bool) -> Tensor:
    """y_MN = x_g @ w[e] per group (w is [E, K, N]), or x_g @ w[e]^T when trans_w (w is [E, N, K])."""
    n = w.shape[1] if trans_w else w.shape[2]
    y_MN = x_MK.new_empty(x_MK.shape[0], n)
    for e, start, end in _bounds(group_sizes_E):
        w_e = w[e].T if trans_w else w[e]
        torch.mm(x_MK[start:end], w_e, out=y_MN[start:end])
    return y_MN


def grouped_gemm_weight_grad_torch(x_MK: Tensor, dy_MN: Tensor, group_sizes_E: Tensor) -> Tensor:
    """dw_EKN[e] = x_g^T @ dy_g per group; zeros for empty groups."""
    num_experts = group_sizes_E.shape[0]
    dw_EKN = x_MK.new_zeros(num_experts, x_MK.shape[1], dy_MN.shape[1])
    for e, start, end in _bounds(group_sizes_E):
        torch.mm(x_MK[start:end].T, dy_MN[start:end], out=dw_EKN[e])
    return dw_EKN
