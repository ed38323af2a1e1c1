"""Mixture-of-Experts layers on the `kernels` grouped GEMM and routing ops.

    layer = moe.MoE(dim=576, hidden_dim=1536, num_experts=8, top_k=2)  # dropless softmax top-2
    y = layer(x)                                       # [..., 576] -> [..., 576]
    loss = lm_loss + moe.collect_aux_losses(model)     # Switch + z-loss, if enabled
    moe.swap_moe_blocks(hf_model)                      # Mixtral / Qwen2-MoE / Qwen3-MoE

See docs/moe.md. Importing this package registers the built-in routers and nothing else.
"""

from .capacity import drop_overflow, expert_capacity, keep_mask
from .config import MoEConfig, RouterConfig
from .dispatch import Dispatcher, DispatchPlan, LocalDispatcher, ReferenceDispatcher
from .experts import SharedExperts, SwiGLUExperts
from .hf import HF_CONVERTERS, from_hf, swap_moe_blocks
from .layer import MoE, collect_aux_losses, moe_layers, update_router_biases
from .losses import load_balancing_loss, router_z_loss
from .routers import (
    ROUTERS,
    ExpertChoiceRouter,
    Router,
    Routing,
    SigmoidBiasRouter,
    SoftmaxTopKRouter,
    SwitchRouter,
    TopKRouter,
    build_router,
    get_router,
    register_router,
    router_names,
)

__all__ = [
    "HF_CONVERTERS",
    "ROUTERS",
    "Dispatcher",
    "DispatchPlan",
    "ExpertChoiceRouter",
    "LocalDispatcher",
    "MoE",
    "MoEConfig",
    "ReferenceDispatcher",
    "Router",
    "RouterConfig",
    "Routing",
    "SharedExperts",
    "SigmoidBiasRouter",
    "SoftmaxTopKRouter",
    "SwiGLUExperts",
    "SwitchRouter",
    "TopKRouter",
    "build_router",
    "collect_aux_losses",
    "drop_overflow",
    "expert_capacity",
    "from_hf",
    "get_router",
    "keep_mask",
    "load_balancing_loss",
    "moe_layers",
    "register_router",
    "router_names",
    "router_z_loss",
    "swap_moe_blocks",
    "update_router_biases",
]
