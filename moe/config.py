"""MoEConfig: the frozen, keyword-only description of one Mixture-of-Experts layer, and RouterConfig,
the base of each router's own knobs (each router's ``Config``, beside it in moe/routers.py).

Legend: T tokens, D model dim (`dim`), H expert hidden dim (`hidden_dim`), E experts, K experts per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """A router's own knobs; the base of every router's ``Config`` (``moe.SigmoidBiasRouter.Config``).

    A router with knobs of its own subclasses this as its nested ``Config`` (a frozen, keyword-only
    dataclass whose ``name`` defaults to its registered name); a router without uses this one.

    Attributes:
        name: the router's name in `moe.ROUTERS`.
        routed_scaling_factor: multiplies the routed weights (DeepSeek-V3 uses 2.5); 1.0 leaves them as is.
    """

    name: str
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not _positive_float(self.routed_scaling_factor):
            raise ValueError(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor!r}")

    def topk_options(self, router: Any) -> dict[str, Any] | None:
        """The router's top-k rule as `kernels.topk_routing` options (``scoring``, ``renormalize``,
        ``bias_E``): a `moe.TopKRouter` routes with them, and the CPU fast path (moe/native_cpu.py) runs
        them in one C call. None (here): the router routes otherwise; the fast path does not apply."""
        return None


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Everything `moe.MoE` needs; validated on construction (ValueError naming the field).

    Attributes:
        dim: D, the model dimension (input and output features).
        hidden_dim: H, each routed SwiGLU expert's hidden size.
        num_experts: E, the number of routed experts.
        top_k: K, experts per token for token-choice routers; for "expert_choice" the average number of
            experts per token (capacity per expert = ceil(capacity_factor * T * K / E)).
        router: the router and its knobs: a name in `moe.ROUTERS` ("softmax_topk", "switch",
            "sigmoid_bias", "expert_choice", ...) for its defaults, or its config, e.g.
            `moe.SoftmaxTopKRouter.Config(renormalize=False)`; stored as the config.
        capacity_factor: None for dropless routing (the default); otherwise each expert takes at most
            ceil(capacity_factor * T * K / E) token slots per forward and drops the rest (see capacity.py).
            For "expert_choice" it sets the capacity (None means 1.0).
        aux_loss_coef: coefficient of the Switch/GShard load-balancing loss (arXiv:2101.03961 uses 1e-2).
        z_loss_coef: coefficient of the ST-MoE router z-loss (arXiv:2202.08906 uses 1e-3); 0 disables it.
        num_shared_experts: always-active experts added to every token (DeepSeek-MoE, Qwen2-MoE); 0 for none.
        shared_hidden_dim: total hidden size of the shared experts, stored fused as one SwiGLU;
            None means num_shared_experts * hidden_dim.
        shared_expert_gate: scale the shared output by sigmoid(x . w_gate), one scalar per token (Qwen2-MoE).
        track_stats: accumulate per-expert token counts and dropped slots in buffers (see MoE.stats()).
        backend: kernels backend for grouped_gemm and the routing ops ("torch", "triton" or None = auto).
    """

    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int = 2
    router: str | RouterConfig = "softmax_topk"
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    num_shared_experts: int = 0
    shared_hidden_dim: int | None = None
    shared_expert_gate: bool = False
    track_stats: bool = True
    backend: str | None = None

    def __post_init__(self) -> None:
        for name in ("dim", "hidden_dim", "num_experts", "top_k"):
            _check_int(name, getattr(self, name), low=1)
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k must be <= num_experts={self.num_experts}, got top_k={self.top_k}")
        object.__setattr__(self, "router", _router_config(self.router))
        if self.capacity_factor is not None and not _positive_float(self.capacity_factor):
            raise ValueError(f"capacity_factor must be None (dropless) or > 0, got {self.capacity_factor!r}")
        for name in ("aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if not _positive_float(value, allow_zero=True):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        _check_int("num_shared_experts", self.num_shared_experts, low=0)
        if self.shared_hidden_dim is not None:
            _check_int("shared_hidden_dim", self.shared_hidden_dim, low=1)
            if self.num_shared_experts == 0:
                raise ValueError("shared_hidden_dim is set but num_shared_experts is 0")
        if self.shared_expert_gate and self.num_shared_experts == 0:
            raise ValueError("shared_expert_gate=True needs num_shared_experts >= 1")
        if self.backend is not None and not isinstance(self.backend, str):
            raise ValueError(f"backend must be None or a backend name, got {self.backend!r}")

    @property
    def shared_hidden(self) -> int:
        """Hidden size of the fused shared-expert SwiGLU (0 when there are no shared experts)."""
        if self.num_shared_experts == 0:
            return 0
        return self.shared_hidden_dim or self.num_shared_experts * self.hidden_dim


def _router_config(router: object) -> RouterConfig:
    """The config of ``router`` (a name: its router's defaults), checked against its router's ``Config``."""
    from .routers import get_router  # the registry imports this module

    if isinstance(router, str):
        return get_router(router).Config(name=router)
    if not isinstance(router, RouterConfig):
        raise ValueError(f"router must be a router name or a moe.RouterConfig, got {router!r}")
    expected = get_router(router.name).Config
    if not isinstance(router, expected):
        raise ValueError(
            f"router {router.name!r} takes a {expected.__qualname__}, got a {type(router).__qualname__}"
        )
    return router


def _check_int(name: str, value: object, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _positive_float(value: object, *, allow_zero: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value >= 0 if allow_zero else value > 0
