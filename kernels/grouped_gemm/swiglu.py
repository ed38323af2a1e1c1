"""`grouped_swiglu`: SwiGLU experts over expert-sorted rows, on the fastest path the inputs allow.

Legend: M rows in expert order, D model dim, H expert hidden dim, E experts.

    y_g = (silu(x_g @ w_gate_up[e][:, :H]) * (x_g @ w_gate_up[e][:, H:])) @ w_down[e]   per group g = e

Without autograd, on CPU in float32 with oneDNN (the automatic grouped-GEMM backend there), it runs
expert by expert on packed weights (:func:`~kernels.grouped_gemm.onednn_backend.grouped_swiglu_onednn`).
Otherwise it is two differentiable :func:`~kernels.grouped_gemm.op.grouped_gemm` calls around the
SwiGLU, on the backend ``backend`` resolves to. The per-expert reference is ``moe.SwiGLUExperts.expert``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._backends import eager_direct_call
from .onednn_backend import grouped_swiglu_onednn
from .op import _check_inputs, grouped_gemm, select_backend


def grouped_swiglu(
    x_MD: Tensor, w_gate_up_EDN: Tensor, w_down_EHD: Tensor, group_sizes_E: Tensor, backend: str | None = None
) -> Tensor:
    """y_MD of SwiGLU experts: w_gate_up_EDN is [E, D, 2H] (gate in the first H columns), w_down_EHD
    [E, H, D]; either may be the transpose of a contiguous nn.Linear-style tensor, as in grouped_gemm.

    Raises ValueError (naming the argument) as grouped_gemm does, and when the shapes do not chain.
    """
    if w_gate_up_EDN.dim() != 3 or w_down_EHD.dim() != 3:
        raise ValueError(
            f"w_gate_up_EDN and w_down_EHD must be 3-D, got shapes {tuple(w_gate_up_EDN.shape)} "
            f"and {tuple(w_down_EHD.shape)}"
        )
    hidden = w_down_EHD.shape[1]
    if w_gate_up_EDN.shape[2] != 2 * hidden:
        raise ValueError(
            f"w_gate_up_EDN must have 2H = {2 * hidden} columns for w_down_EHD's H = {hidden}, "
            f"got {w_gate_up_EDN.shape[2]}"
        )
    if (
        isinstance(x_MD, Tensor)
        and x_MD.dim() == 2
        and select_backend(backend, x_MD) == "onednn"
        and eager_direct_call(x_MD, w_gate_up_EDN, w_down_EHD)
    ):
        # grouped_gemm validates everything on the general path; check the same here.
        _check_inputs(x_MD, w_gate_up_EDN, group_sizes_E)
        if w_down_EHD.dtype != x_MD.dtype or w_down_EHD.shape[0] != w_gate_up_EDN.shape[0]:
            raise ValueError(
                f"w_down_EHD must be {x_MD.dtype} with E={w_gate_up_EDN.shape[0]} experts, got "
                f"{w_down_EHD.dtype} with {w_down_EHD.shape[0]}"
            )
        return grouped_swiglu_onednn(x_MD, w_gate_up_EDN, w_down_EHD, group_sizes_E, hidden)
    h_MN = grouped_gemm(x_MD, w_gate_up_EDN, group_sizes_E, backend=backend)
    gate, up = h_MN[:, :hidden], h_MN[:, hidden:]
    a_MH = F.silu(gate) * up if torch.is_grad_enabled() and h_MN.requires_grad else F.silu(gate).mul_(up)
    return grouped_gemm(a_MH, w_down_EHD, group_sizes_E, backend=backend)
