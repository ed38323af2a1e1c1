"""The MoE layer's CPU inference path: route, sort, gather, experts and combine with no PyTorch glue.

Legend: T tokens, D model dim, E experts, K slots per token, M = T*K slots.

    logits_TE = x_TD @ router.weight^T                      (F.linear, as the general path)
    route     = kernels.route_sorted_cpu(logits_TE, K, ...) (top-k, weights, counting sort: one C call)
    x_MD      = kernels.gather_rows_cpu(x_TD, route)
    blocks    = kernels.swiglu_blocks_onednn(x_MD, ...)     (each expert's [M_e, D] output; oneDNN
                                                            and the packed C kernel, as the general path)
    y_TD      = kernels.combine_blocks_cpu(blocks, route)   (weighted sum read from the blocks in place)

The general path (router -> plan -> LocalDispatcher) computes the same numbers; this one skips the
~15 small PyTorch ops of routing and the copy of every expert's output into one [M, D] buffer (what
that saves: docs/kernels.md). Same routing and statistics; outputs equal up to the float rounding of
the combine's sum order.

:func:`native_forward` takes it only when nothing could tell the difference: float32 on a CPU, no
autograd and no tracing, eval mode, dropless, a router whose own ``Config`` gives its rule as
:func:`kernels.route_sorted_cpu` options (``topk_options``: softmax top-k, Switch, sigmoid with
bias; a router that inherits its ``Config`` may route otherwise and does not qualify), the stock
experts and local dispatcher, no forward hooks on the router or the experts (they would miss calls),
no backend forced (config.backend or the SPECDEC_ROUTING_BACKEND / SPECDEC_GROUPED_GEMM_BACKEND
variables), oneDNN present, the C library built, and ``layer.native_cpu`` True. Otherwise it returns
None and the layer runs the general path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

import kernels

from .dispatch import LocalDispatcher
from .experts import SwiGLUExperts

if TYPE_CHECKING:
    from .layer import MoE

__all__ = ["native_forward"]


def _hooked(module: torch.nn.Module) -> bool:
    """Forward hooks would see the router's / experts' calls, which the native path does not make."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or torch.nn.modules.module._global_forward_hooks
        or torch.nn.modules.module._global_forward_pre_hooks
    )


def _topk_options(layer: MoE) -> dict | None:
    """The router's top-k rule, from the Config its class declares itself (a subclass may route otherwise)."""
    router = layer.router
    if vars(type(router)).get("Config") is not type(layer.config.router):
        return None
    return layer.config.router.topk_options(router)


def _applies(layer: MoE, x_TD: Tensor) -> bool:
    config, router, experts = layer.config, layer.router, layer.experts
    return (
        layer.native_cpu
        and x_TD.device.type == "cpu"
        and x_TD.dtype == torch.float32
        and not layer.training
        and config.capacity_factor is None
        and config.num_experts <= kernels.routing.MAX_EXPERTS
        and config.backend is None
        and type(experts) is SwiGLUExperts
        and experts.backend is None
        and not _hooked(router)
        and not _hooked(experts)
        and type(layer.dispatcher) is LocalDispatcher
        and layer.dispatcher.backend is None
        and router.weight.dtype == torch.float32
        and not kernels.ROUTING_BACKENDS.env_override()
        and not kernels.GROUPED_GEMM_BACKENDS.env_override()
        and kernels.eager_direct_call(x_TD, router.weight, experts.w_gate_up, experts.w_down)
        and kernels.onednn_available()
        and kernels.native_routing_available()
    )


def native_forward(layer: MoE, x_TD: Tensor) -> Tensor | None:
    """The routed experts' output y_TD (no shared experts) on the native path, or None when it does not
    apply (see the module docstring). Records the same statistics as the general path."""
    if not _applies(layer, x_TD) or (options := _topk_options(layer)) is None:
        return None
    router, experts = layer.router, layer.experts
    route = kernels.route_sorted_cpu(
        F.linear(x_TD, router.weight), router.top_k, scale=router.routed_scaling_factor, **options
    )
    sizes_E = route.group_sizes_E
    layer.record_plan(
        sizes_E, sizes_E, dropped=0, routed_slots=route.sorted_slots_M.numel(), drop_fraction=0.0
    )
    x_MD = kernels.gather_rows_cpu(x_TD, route)
    blocks = kernels.swiglu_blocks_onednn(
        x_MD, experts.w_gate_up, experts.w_down, sizes_E.tolist(), experts.hidden_dim
    )
    return kernels.combine_blocks_cpu(blocks, route, x_TD.shape[1])
