"""`grouped_gemm`: the public entry point, its torch.library custom ops, autograd and backend registry.

Legend: M rows (token slots in expert order), K input features, N output features, E experts (groups).

Two custom ops carry the work so that torch.compile can trace through them (they are opaque to it):
  specdec_kernels::grouped_gemm        y_MN = x_MK @ w[e]  per group  (or @ w[e]^T when trans_w)
  specdec_kernels::grouped_gemm_wgrad  dw[e] = x_g^T @ dy_g per group
The backward of the first is one call of each: dX is a grouped GEMM with the weights transposed, dW the
per-group x^T dY.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .._backends import BackendRegistry, can_check_values, eager_direct_call
from .onednn_backend import grouped_gemm_onednn, onednn_available
from .torch_backend import grouped_gemm_torch, grouped_gemm_weight_grad_torch

ENV_VAR = "SPECDEC_GROUPED_GEMM_BACKEND"
_ONEDNN = onednn_available()  # a constant, so torch.compile does not trace into torch.backends
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True, kw_only=True)
class GroupedGemmBackend:
    """One grouped-GEMM implementation.

    forward(x_MK, w, group_sizes_E, trans_w) -> y_MN: w is [E, K, N], or [E, N, K] read transposed when
        trans_w; all tensors contiguous, group_sizes_E on the device of x_MK.
    weight_grad(x_MK, dy_MN, group_sizes_E) -> dw_EKN: zeros for empty groups.
    dtypes: the floating dtypes it accepts.
    """

    forward: Callable[[Tensor, Tensor, Tensor, bool], Tensor]
    weight_grad: Callable[[Tensor, Tensor, Tensor], Tensor]
    dtypes: tuple[torch.dtype, ...]


GROUPED_GEMM_BACKENDS: BackendRegistry[GroupedGemmBackend] = BackendRegistry("grouped GEMM", ENV_VAR)


def _triton_forward(x_MK: Tensor, w: Tensor, group_sizes_E: Tensor, trans_w: bool) -> Tensor:
    from . import triton_kernel  # lazy: triton is optional and imported only when this backend runs

    return triton_kernel.grouped_gemm_triton(x_MK, w, group_sizes_E, trans_w)


def _triton_weight_grad(x_MK: Tensor, dy_MN: Tensor, group_sizes_E: Tensor) -> Tensor:
    from . import triton_kernel

    return triton_kernel.grouped_gemm_weight_grad_triton(x_MK, dy_MN, group_sizes_E)


GROUPED_GEMM_BACKENDS.register(
    "torch",
    GroupedGemmBackend(
        forward=grouped_gemm_torch, weight_grad=grouped_gemm_weight_grad_torch, dtypes=_FLOAT_DTYPES
    ),
)
GROUPED_GEMM_BACKENDS.register(
    "onednn",
    GroupedGemmBackend(
        forward=grouped_gemm_onednn, weight_grad=grouped_gemm_weight_grad_torch, dtypes=(torch.float32,)
    ),
)
GROUPED_GEMM_BACKENDS.register(
    "triton",
    GroupedGemmBackend(
        forward=_triton_forward,
        weight_grad=_triton_weight_grad,
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
    ),
)


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("specdec_kernels::grouped_gemm", mutates_args=())
def _grouped_gemm_op(x_MK: Tensor, w: Tensor, group_sizes_E: Tensor, trans_w: bool, backend: str) -> Tensor:
    return GROUPED_GEMM_BACKENDS.get(backend).forward(x_MK, w, group_sizes_E, trans_w)


@_grouped_gemm_op.register_fake
def _(x_MK: Tensor, w: Tensor, group_sizes_E: Tensor, trans_w: bool, backend: str) -> Tensor:
    return x_MK.new_empty(x_MK.shape[0], w.shape[1] if trans_w else w.shape[2])


@torch.library.custom_op("specdec_kernels::grouped_gemm_wgrad", mutates_args=())
def _grouped_gemm_wgrad_op(x_MK: Tensor, dy_MN: Tensor, group_sizes_E: Tensor, backend: str) -> Tensor:
    return GROUPED_GEMM_BACKENDS.get(backend).weight_grad(x_MK, dy_MN, group_sizes_E)


@_grouped_gemm_wgrad_op.register_fake
def _(x_MK: Tensor, dy_MN: Tensor, group_sizes_E: Tensor, backend: str) -> Tensor:
    return x_MK.new_empty(group_sizes_E.shape[0], x_MK.shape[1], dy_MN.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    x_MK, w, group_sizes_E, trans_w, backend = inputs
    ctx.save_for_backward(x_MK, w, group_sizes_E)
    ctx.trans_w, ctx.backend = trans_w, backend


def _backward(ctx, dy_MN: Tensor):
    x_MK, w, group_sizes_E = ctx.saved_tensors
    dy_MN = dy_MN.contiguous()
    dx_MK = dw = None
    if ctx.needs_input_grad[0]:
        # y = x @ w[e] (or w[e]^T)  =>  dx = dy @ w[e]^T (or dy @ w[e]): the same op, transposition flipped.
        dx_MK = _grouped_gemm_op(dy_MN, w, group_sizes_E, not ctx.trans_w, ctx.backend)
    if ctx.needs_input_grad[1]:
        # dw[e] = x_g^T dy_g, or (dy_g^T x_g) for the [E, N, K] layout.
        if ctx.trans_w:
            dw = _grouped_gemm_wgrad_op(dy_MN, x_MK, group_sizes_E, ctx.backend)
        else:
            dw = _grouped_gemm_wgrad_op(x_MK, dy_MN, group_sizes_E, ctx.backend)
    return dx_MK, dw, None, None, None


_grouped_gemm_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- public entry point
def grouped_gemm(x_MK: Tensor, w_EKN: Tensor, group_sizes_E: Tensor, backend: str | None = None) -> Tensor:
    """Grouped matrix product: y[rows of group e] = x[rows of group e] @ w_EKN[e].

    Rows of `x_MK` are grouped by expert in order: the first `group_sizes_E[0]` rows use `w_EKN[0]`, the
    next `group_sizes_E[1]` rows use `w_EKN[1]`, and so on (MegaBlocks' grouped GEMM, arXiv:2211.15841).
    Empty groups are allowed. Differentiable with respect to `x_MK` and `w_EKN`.

    Args:
        x_MK: [M, K] contiguous floating tensor.
        w_EKN: [E, K, N] weights of x's dtype and device. Either contiguous, or the transpose of a
            contiguous [E, N, K] tensor (e.g. `w_ENK.transpose(1, 2)` of nn.Linear-style weights), which is
            read in place without a copy.
        group_sizes_E: [E] int32/int64 row counts, non-negative, summing to M; on x's device or the CPU.
        backend: "triton", "torch", "onednn" (CPU, float32), or None for automatic: Triton on CUDA when
            available, oneDNN for float32 on CPU when this PyTorch has it, torch otherwise. The
            environment variable SPECDEC_GROUPED_GEMM_BACKEND, when set, overrides it.

    Returns:
        y_MN: [M, N] in x's dtype (products accumulate in float32 or wider).

    Raises:
        ValueError: naming the argument, for wrong dims, dtype/device mismatches, unsupported strides,
            negative group sizes or group sizes that do not sum to M, or an unknown/unusable backend.
    """
    _check_inputs(x_MK, w_EKN, group_sizes_E)
    name = select_backend(backend, x_MK)
    if x_MK.dtype not in GROUPED_GEMM_BACKENDS.get(name).dtypes:
        raise ValueError(f"x_MK.dtype {x_MK.dtype} is not supported by the {name!r} grouped GEMM backend")
    trans_w = not w_EKN.is_contiguous()
    w = w_EKN.transpose(1, 2) if trans_w else w_EKN  # contiguous either way
    if group_sizes_E.device != x_MK.device and name != "torch":
        group_sizes_E = group_sizes_E.to(x_MK.device)
    if eager_direct_call(x_MK, w):
        return GROUPED_GEMM_BACKENDS.get(name).forward(x_MK, w, group_sizes_E, trans_w)
    return _grouped_gemm_op(x_MK, w, group_sizes_E, trans_w, name)


def select_backend(backend: str | None, x_MK: Tensor) -> str:
    """The backend a call with ``backend`` runs on for inputs like ``x_MK``: the environment variable,
    else ``backend``, else automatic: Triton on CUDA, oneDNN for float32 on CPUs with oneDNN, torch
    otherwise."""
    name = GROUPED_GEMM_BACKENDS.select(backend, x_MK.device)
    if (
        backend is None
        and name == "torch"
        and not GROUPED_GEMM_BACKENDS.env_override()
        and x_MK.device.type == "cpu"
        and x_MK.dtype == torch.float32
        and _ONEDNN
    ):
        return "onednn"
    if name == "onednn" and x_MK.device.type != "cpu":
        raise ValueError(f"backend 'onednn' runs on CPU tensors only, got {x_MK.device}")
    if name == "onednn" and not _ONEDNN:
        raise ValueError("backend 'onednn' cannot run here: this PyTorch build has no usable oneDNN")
    return name


def triton_autotune_choices() -> dict[str, str]:
    """The tile configs the Triton forward kernel's autotuner picked so far, by tuning key (for reports).

    Empty until the Triton backend has run (the Triton module is never imported just for this).
    """
    module = sys.modules.get(f"{__package__}.triton_kernel")
    if module is None:
        return {}
    return {str(key): str(config) for key, config in module.grouped_gemm_forward_kernel.cache.items()}


def _check_inputs(x_MK: Tensor, w_EKN: Tensor, group_sizes_E: Tensor) -> None:
    for name, t in (("x_MK", x_MK), ("w_EKN", w_EKN), ("group_sizes_E", group_sizes_E)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x_MK.dim() != 2:
        raise ValueError(f"x_MK must be 2-D [M, K], got shape {tuple(x_MK.shape)}")
    if w_EKN.dim() != 3:
        raise ValueError(f"w_EKN must be 3-D [E, K, N], got shape {tuple(w_EKN.shape)}")
    if group_sizes_E.dim() != 1:
        raise ValueError(f"group_sizes_E must be 1-D [E], got shape {tuple(group_sizes_E.shape)}")
    num_experts, k, _ = w_EKN.shape
    if num_experts == 0:
        raise ValueError("w_EKN must hold at least one expert (E >= 1)")
    if x_MK.shape[1] != k:
        raise ValueError(f"x_MK has K={x_MK.shape[1]} columns but w_EKN has K={k} rows per expert")
    if group_sizes_E.shape[0] != num_experts:
        raise ValueError(f"group_sizes_E has {group_sizes_E.shape[0]} entries, expected E={num_experts}")
    if x_MK.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x_MK must be a floating tensor, got {x_MK.dtype}")
    if w_EKN.dtype != x_MK.dtype:
        raise ValueError(f"w_EKN.dtype {w_EKN.dtype} must equal x_MK.dtype {x_MK.dtype}")
    if group_sizes_E.dtype not in _INT_DTYPES:
        raise ValueError(f"group_sizes_E must be int32 or int64, got {group_sizes_E.dtype}")
    if w_EKN.device != x_MK.device:
        raise ValueError(f"w_EKN is on {w_EKN.device} but x_MK is on {x_MK.device}")
    if group_sizes_E.device not in (x_MK.device, torch.device("cpu")):
        raise ValueError(f"group_sizes_E must be on {x_MK.device} or the CPU, got {group_sizes_E.device}")
    if not x_MK.is_contiguous():
        raise ValueError("x_MK must be contiguous (call .contiguous())")
    if not (w_EKN.is_contiguous() or w_EKN.transpose(1, 2).is_contiguous()):
        raise ValueError(
            "w_EKN must be contiguous, or the transpose(1, 2) of a contiguous [E, N, K] tensor; "
            f"got strides {w_EKN.stride()}"
        )
    if can_check_values():
        sizes = group_sizes_E.tolist()  # one device-to-host copy on CUDA
        if min(sizes) < 0:
            raise ValueError(f"group_sizes_E must be non-negative, got {sizes}")
        if sum(sizes) != x_MK.shape[0]:
            raise ValueError(f"group_sizes_E must sum to M={x_MK.shape[0]}, got sum {sum(sizes)}")
