"""Routing ops: public entry points, torch.library custom ops with autograd, and the backend registry.

Legend: T tokens, E experts, K experts per token (top_k), D model dim, M token slots in expert order
(M = T*K, or fewer when slots were dropped). See reference.py for the definition of every op.

Custom ops (namespace specdec_kernels), each opaque to torch.compile with a fake (meta) implementation:
  topk_routing, topk_routing_backward, sort_by_expert, permute, unpermute, unpermute_backward.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .._backends import BackendRegistry, can_check_values, eager_direct_call
from . import reference as ref
from .torch_backend import unpermute_torch

ENV_VAR = "SPECDEC_ROUTING_BACKEND"
_INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True, kw_only=True)
class RoutingBackend:
    """One implementation of the routing ops; signatures as the functions in reference.py."""

    topk: Callable[..., tuple[Tensor, Tensor]]
    topk_backward: Callable[..., Tensor]
    sort: Callable[[Tensor, int], tuple[Tensor, Tensor, Tensor]]
    permute: Callable[[Tensor, Tensor, int], Tensor]
    unpermute: Callable[[Tensor, Tensor, Tensor | None, int, int], Tensor]
    unpermute_backward: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


ROUTING_BACKENDS: BackendRegistry[RoutingBackend] = BackendRegistry("routing", ENV_VAR)
ROUTING_BACKENDS.register(
    "torch",
    RoutingBackend(
        topk=ref.topk_routing_reference,
        topk_backward=ref.topk_routing_backward_reference,
        sort=ref.sort_by_expert_reference,
        permute=ref.permute_reference,
        unpermute=unpermute_torch,
        unpermute_backward=ref.unpermute_backward_reference,
    ),
)


def _lazy_triton(module: str, name: str) -> Callable:
    """A function that imports kernels.routing.<module> (and so triton) only when first called."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)(*args, **kwargs)

    call.__name__ = name
    return call


ROUTING_BACKENDS.register(
    "triton",
    RoutingBackend(
        topk=_lazy_triton("topk_triton", "topk_routing_triton"),
        topk_backward=_lazy_triton("topk_triton", "topk_routing_backward_triton"),
        sort=_lazy_triton("sort_triton", "sort_by_expert_triton"),
        permute=_lazy_triton("permute_triton", "permute_triton"),
        unpermute=_lazy_triton("permute_triton", "unpermute_triton"),
        unpermute_backward=_lazy_triton("permute_triton", "unpermute_backward_triton"),
    ),
)


class ExpertSort(NamedTuple):
    """Token slots sorted by expert (see reference.py): unpack as `sorted_slots_M, sizes, offsets`."""

    sorted_slots_M: Tensor  # [M] int64: slot t*K+k at each expert-ordered row
    group_sizes_E: Tensor  # [E] int64: rows per expert
    expert_offsets_E1: Tensor  # [E+1] int64: expert e owns rows expert_offsets_E1[e]:expert_offsets_E1[e+1]


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("specdec_kernels::topk_routing", mutates_args=())
def _topk_op(
    logits_TE: Tensor, bias_E: Tensor | None, top_k: int, scoring: str, renormalize: bool, backend: str
) -> tuple[Tensor, Tensor]:
    return ROUTING_BACKENDS.get(backend).topk(
        logits_TE, top_k, scoring=scoring, renormalize=renormalize, bias_E=bias_E
    )


@_topk_op.register_fake
def _(logits_TE, bias_E, top_k, scoring, renormalize, backend):
    num_tokens = logits_TE.shape[0]
    return (
        logits_TE.new_empty(num_tokens, top_k, dtype=torch.float32),
        logits_TE.new_empty(num_tokens, top_k, dtype=torch.int64),
    )


@torch.library.custom_op("specdec_kernels::topk_routing_backward", mutates_args=())
def _topk_backward_op(
    grad_weights_TK: Tensor,
    logits_TE: Tensor,
    experts_TK: Tensor,
    scoring: str,
    renormalize: bool,
    backend: str,
) -> Tensor:
    return ROUTING_BACKENDS.get(backend).topk_backward(
        grad_weights_TK, logits_TE, experts_TK, scoring=scoring, renormalize=renormalize
    )


@_topk_backward_op.register_fake
def _(grad_weights_TK, logits_TE, experts_TK, scoring, renormalize, backend):
    return torch.empty_like(logits_TE)


def _topk_setup(ctx, inputs, output) -> None:
    logits_TE, _, _, scoring, renormalize, backend = inputs
    ctx.save_for_backward(logits_TE, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.scoring, ctx.renormalize, ctx.backend = scoring, renormalize, backend


def _topk_backward(ctx, grad_weights_TK: Tensor, _grad_experts):
    logits_TE, experts_TK = ctx.saved_tensors
    grad_logits_TE = _topk_backward_op(
        grad_weights_TK.contiguous(), logits_TE, experts_TK, ctx.scoring, ctx.renormalize, ctx.backend
    )
    return grad_logits_TE, None, None, None, None, None


_topk_op.register_autograd(_topk_backward, setup_context=_topk_setup)


@torch.library.custom_op("specdec_kernels::sort_by_expert", mutates_args=())
def _sort_op(experts_TK: Tensor, num_experts: int, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return ROUTING_BACKENDS.get(backend).sort(experts_TK, num_experts)


@_sort_op.register_fake
def _(experts_TK, num_experts, backend):
    new = lambda n: experts_TK.new_empty(n, dtype=torch.int64)
    return new(experts_TK.numel()), new(num_experts), new(num_experts + 1)


@torch.library.custom_op("specdec_kernels::permute", mutates_args=())
def _permute_op(x_TD: Tensor, sorted_slots_M: Tensor, top_k: int, backend: str) -> Tensor:
    return ROUTING_BACKENDS.get(backend).permute(x_TD, sorted_slots_M, top_k)


@_permute_op.register_fake
def _(x_TD, sorted_slots_M, top_k, backend):
    return x_TD.new_empty(sorted_slots_M.shape[0], x_TD.shape[1])


@torch.library.custom_op("specdec_kernels::unpermute", mutates_args=())
def _unpermute_op(
    y_MD: Tensor, sorted_slots_M: Tensor, weights_TK: Tensor | None, num_tokens: int, top_k: int, backend: str
) -> Tensor:
    return ROUTING_BACKENDS.get(backend).unpermute(y_MD, sorted_slots_M, weights_TK, num_tokens, top_k)


@_unpermute_op.register_fake
def _(y_MD, sorted_slots_M, weights_TK, num_tokens, top_k, backend):
    return y_MD.new_empty(num_tokens, y_MD.shape[1])


@torch.library.custom_op("specdec_kernels::unpermute_backward", mutates_args=())
def _unpermute_backward_op(
    grad_out_TD: Tensor, y_MD: Tensor, sorted_slots_M: Tensor, weights_TK: Tensor, backend: str
) -> tuple[Tensor, Tensor]:
    return ROUTING_BACKENDS.get(backend).unpermute_backward(grad_out_TD, y_MD, sorted_slots_M, weights_TK)


@_unpermute_backward_op.register_fake
def _(grad_out_TD, y_MD, sorted_slots_M, weights_TK, backend):
    return torch.empty_like(y_MD), torch.empty_like(weights_TK)


def _permute_setup(ctx, inputs, output) -> None:
    x_TD, sorted_slots_M, top_k, backend = inputs
    ctx.save_for_backward(sorted_slots_M)
    ctx.num_tokens, ctx.top_k, ctx.backend = x_TD.shape[0], top_k, backend


def _permute_backward(ctx, grad_x_MD: Tensor):
    # permute copies token t into each of its kept slots, so its gradient is the unweighted slot sum.
    (sorted_slots_M,) = ctx.saved_tensors
    grad_x_TD = _unpermute_op(
        grad_x_MD.contiguous(), sorted_slots_M, None, ctx.num_tokens, ctx.top_k, ctx.backend
    )
    return grad_x_TD, None, None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


def _unpermute_setup(ctx, inputs, output) -> None:
    y_MD, sorted_slots_M, weights_TK, num_tokens, top_k, backend = inputs
    ctx.save_for_backward(y_MD, sorted_slots_M, weights_TK)
    ctx.top_k, ctx.backend = top_k, backend


def _unpermute_backward(ctx, grad_out_TD: Tensor):
    y_MD, sorted_slots_M, weights_TK = ctx.saved_tensors
    grad_out_TD = grad_out_TD.contiguous()
    if weights_TK is None:  # unweighted sum: the gradient of each row is its token's gradient
        return _permute_op(grad_out_TD, sorted_slots_M, ctx.top_k, ctx.backend), None, None, None, None, None
    grad_y_MD, grad_weights_TK = _unpermute_backward_op(
        grad_out_TD, y_MD, sorted_slots_M, weights_TK, ctx.backend
    )
    return grad_y_MD, None, grad_weights_TK, None, None, None


_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


# --------------------------------------------------------------------------- public entry points
def topk_routing(
    logits_TE: Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    bias_E: Tensor | None = None,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused top-k routing: scores, expert selection and routing weights in one pass.

    scores = softmax(logits) (Switch/Mixtral, arXiv:2101.03961, 2401.04088) or sigmoid(logits)
    (DeepSeek-V3, arXiv:2412.19437). The top_k experts with the highest `scores + bias_E` are chosen;
    `bias_E` (aux-loss-free load balancing) only affects that choice: the weights are the unbiased
    scores of the chosen experts, divided by their sum when `renormalize`. Ties go to the lower expert
    index. Differentiable in `logits_TE` (through the weights).

    Args:
        logits_TE: [T, E] router logits, floating, contiguous.
        top_k: experts per token, 1 <= top_k <= E.
        scoring: "softmax" or "sigmoid".
        renormalize: divide the chosen weights by their sum.
        bias_E: optional [E] selection bias (no gradient flows into it).
        backend: "triton", "torch" or None (automatic); SPECDEC_ROUTING_BACKEND overrides it.

    Returns:
        weights_TK: [T, top_k] float32 routing weights, in descending order of selection score.
        experts_TK: [T, top_k] int64 expert ids.
    """
    if not isinstance(logits_TE, Tensor) or logits_TE.dim() != 2:
        raise ValueError(f"logits_TE must be a 2-D [T, E] tensor, got {_describe(logits_TE)}")
    if not logits_TE.is_floating_point():
        raise ValueError(f"logits_TE must be floating, got {logits_TE.dtype}")
    if not logits_TE.is_contiguous():
        raise ValueError("logits_TE must be contiguous (call .contiguous())")
    num_experts = logits_TE.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, E={num_experts}], got {top_k!r}")
    if scoring not in ref.SCORING_FUNCTIONS:
        raise ValueError(f"scoring must be one of {sorted(ref.SCORING_FUNCTIONS)}, got {scoring!r}")
    if bias_E is not None:
        if not isinstance(bias_E, Tensor) or bias_E.shape != (num_experts,) or not bias_E.is_floating_point():
            raise ValueError(f"bias_E must be a floating [E={num_experts}] tensor, got {_describe(bias_E)}")
        if bias_E.device != logits_TE.device:
            raise ValueError(f"bias_E is on {bias_E.device} but logits_TE is on {logits_TE.device}")
        bias_E = bias_E.detach().contiguous()
    name = ROUTING_BACKENDS.select(backend, logits_TE.device)
    if eager_direct_call(logits_TE, bias_E):
        impl = ROUTING_BACKENDS.get(name).topk
        return impl(logits_TE, top_k, scoring=scoring, renormalize=bool(renormalize), bias_E=bias_E)
    return _topk_op(logits_TE, bias_E, top_k, scoring, bool(renormalize), name)


def sort_by_expert(experts_TK: Tensor, num_experts: int, *, backend: str | None = None) -> ExpertSort:
    """Sort the T*K token slots by expert, stably (counting sort): the order grouped_gemm expects.

    Args:
        experts_TK: [T, K] int32/int64 expert ids in [0, num_experts).
        num_experts: E.
        backend: "triton", "torch" or None (automatic); SPECDEC_ROUTING_BACKEND overrides it.

    Returns:
        ExpertSort(sorted_slots_M, group_sizes_E, expert_offsets_E1), all int64; M = T*K. Within an
        expert, slots keep ascending order, so the result is deterministic.
    """
    if not isinstance(experts_TK, Tensor) or experts_TK.dim() != 2 or experts_TK.dtype not in _INT_DTYPES:
        raise ValueError(f"experts_TK must be a 2-D int32/int64 [T, K] tensor, got {_describe(experts_TK)}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if experts_TK.numel() and can_check_values():
        low, high = int(experts_TK.min()), int(experts_TK.max())
        if low < 0 or high >= num_experts:
            raise ValueError(f"experts_TK values must lie in [0, {num_experts}), got range [{low}, {high}]")
    name = ROUTING_BACKENDS.select(backend, experts_TK.device)
    experts_TK = experts_TK.contiguous()
    if eager_direct_call(experts_TK):
        return ExpertSort(*ROUTING_BACKENDS.get(name).sort(experts_TK, num_experts))
    return ExpertSort(*_sort_op(experts_TK, num_experts, name))


def permute(x_TD: Tensor, sorted_slots_M: Tensor, top_k: int, *, backend: str | None = None) -> Tensor:
    """Gather token rows into expert order: x_MD[i] = x_TD[sorted_slots_M[i] // top_k].

    Args:
        x_TD: [T, D] contiguous floating tokens.
        sorted_slots_M: [M] int64 distinct slot ids in [0, T*top_k) (from sort_by_expert; a subset
            when slots were dropped).
        top_k: K, the number of slots per token.
        backend: "triton", "torch" or None (automatic); SPECDEC_ROUTING_BACKEND overrides it.

    Returns:
        x_MD: [M, D], differentiable in x_TD.
    """
    _check_rows("x_TD", x_TD)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    _check_slots(sorted_slots_M, x_TD, x_TD.shape[0] * top_k)
    name = ROUTING_BACKENDS.select(backend, x_TD.device)
    if eager_direct_call(x_TD, sorted_slots_M):
        return ROUTING_BACKENDS.get(name).permute(x_TD, sorted_slots_M, top_k)
    return _permute_op(x_TD, sorted_slots_M, top_k, name)


def unpermute(
    y_MD: Tensor, sorted_slots_M: Tensor, weights_TK: Tensor, *, backend: str | None = None
) -> Tensor:
    """Scatter expert outputs back to tokens with the weighted combine.

    out_TD[t] = sum_k weights_TK[t, k] * y_MD[row of slot t*K + k], accumulated in float32; slots missing
    from sorted_slots_M (dropped) contribute zero. T and K are read from weights_TK's shape.

    Args:
        y_MD: [M, D] contiguous floating rows in expert order.
        sorted_slots_M: [M] int64 distinct slot ids in [0, T*K), as given to permute.
        weights_TK: [T, K] floating routing weights (any floating dtype; differentiable).
        backend: "triton", "torch" or None (automatic); SPECDEC_ROUTING_BACKEND overrides it.

    Returns:
        out_TD: [T, D] in y_MD's dtype, differentiable in y_MD and weights_TK.
    """
    _check_rows("y_MD", y_MD)
    if not isinstance(weights_TK, Tensor) or weights_TK.dim() != 2 or not weights_TK.is_floating_point():
        raise ValueError(f"weights_TK must be a floating 2-D [T, K] tensor, got {_describe(weights_TK)}")
    if weights_TK.device != y_MD.device:
        raise ValueError(f"weights_TK is on {weights_TK.device} but y_MD is on {y_MD.device}")
    _check_slots(sorted_slots_M, y_MD, weights_TK.numel())
    if sorted_slots_M.shape[0] != y_MD.shape[0]:
        raise ValueError(
            f"sorted_slots_M has {sorted_slots_M.shape[0]} entries but y_MD has {y_MD.shape[0]} rows"
        )
    name = ROUTING_BACKENDS.select(backend, y_MD.device)
    num_tokens, top_k = weights_TK.shape
    weights_TK = weights_TK.contiguous()
    if eager_direct_call(y_MD, sorted_slots_M, weights_TK):
        return ROUTING_BACKENDS.get(name).unpermute(y_MD, sorted_slots_M, weights_TK, num_tokens, top_k)
    return _unpermute_op(y_MD, sorted_slots_M, weights_TK, num_tokens, top_k, name)


def _describe(t: object) -> str:
    if isinstance(t, Tensor):
        return f"shape {tuple(t.shape)} {t.dtype}"
    return type(t).__name__


def _check_rows(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor) or t.dim() != 2 or not t.is_floating_point():
        raise ValueError(f"{name} must be a floating 2-D tensor, got {_describe(t)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")


def _check_slots(sorted_slots_M: Tensor, like: Tensor, num_slots: int) -> None:
    if (
        not isinstance(sorted_slots_M, Tensor)
        or sorted_slots_M.dim() != 1
        or sorted_slots_M.dtype != torch.int64
    ):
        raise ValueError(f"sorted_slots_M must be a 1-D int64 tensor, got {_describe(sorted_slots_M)}")
    if sorted_slots_M.device != like.device:
        raise ValueError(f"sorted_slots_M is on {sorted_slots_M.device}, expected {like.device}")
    if sorted_slots_M.shape[0] > num_slots:
        raise ValueError(
            f"sorted_slots_M has {sorted_slots_M.shape[0]} entries, more than T*K={num_slots} slots"
        )
    if sorted_slots_M.numel() and can_check_values():
        low, high = int(sorted_slots_M.min()), int(sorted_slots_M.max())
        if low < 0 or high >= num_slots:
            raise ValueError(f"sorted_slots_M values must lie in [0, {num_slots}), got range [{low}, {high}]")
