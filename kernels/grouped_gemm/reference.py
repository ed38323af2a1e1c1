"""Plain-PyTorch grouped GEMM: the oracle every other backend is tested against.

Legend: M rows (token slots in expert order), K input features, N output features, E experts (groups).
Rows of x_MK are grouped by expert in order: the first group_sizes_E[0] rows use w_EKN[0], the next
group_sizes_E[1] rows use w_EKN[1], and so on (the "grouped GEMM" of MegaBlocks, arXiv:2211.15841).
"""

from __future__ import annotations

import torch
from torch import Tensor


def grouped_gemm_reference(x_MK: Tensor, w_EKN: Tensor, group_sizes_E: Tensor) -> Tensor:
    """y_MN with y[rows of group e] = x[rows of group e] @ w_EKN[e]; differentiable by plain autograd."""
    sizes = [int(s) for s in group_sizes_E.tolist()]
    pieces = [x_g @ w_EKN[e] for e, x_g in enumerate(torch.split(x_MK, sizes, dim=0))]
    return torch.cat(pieces, dim=0) if pieces else x_MK.new_empty(0, w_EKN.shape[2])


def grouped_gemm_weight_grad_reference(x_MK: Tensor, dy_MN: Tensor, group_sizes_E: Tensor) -> Tensor:
    """dw_EKN with dw[e] = x[rows of group e]^T @ dy[rows of group e] (zeros for an empty group)."""
    sizes = [int(s) for s in group_sizes_E.tolist()]
    x_pieces = torch.split(x_MK, sizes, dim=0)
    dy_pieces = torch.split(dy_MN, sizes, dim=0)
    return torch.stack([x_g.T @ dy_g for x_g, dy_g in zip(x_pieces, dy_pieces, strict=True)], dim=0)
