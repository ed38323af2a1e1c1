"""Routers: which experts see which tokens, with what weight. Registered by name in ROUTERS.

Legend: T tokens, D model dim, E experts, K slots per token (top_k; E for expert choice), M kept slots.

A *slot* is token t's k-th choice, flat index t*K + k (as in `kernels`). A router maps x_TD to a
`Routing`: the router logits, the chosen expert of every slot and its combine weight. Token-choice routers
leave the expert-ordered plan to the layer (which may still drop slots for capacity); expert-choice decides
which slots are kept itself and returns them as `kept`.

Built-in routers:
    softmax_topk   softmax scores, top-k, optional renormalisation (GShard arXiv:2006.16668, Mixtral
                   arXiv:2401.04088, Qwen-MoE).
    switch         Switch Transformer top-1: the argmax expert, weighted by its probability
                   (arXiv:2101.03961).
    sigmoid_bias   DeepSeek-V3 sigmoid scores with auxiliary-loss-free bias balancing (arXiv:2412.19437).
    expert_choice  each expert picks its top-capacity tokens (Zhou et al., arXiv:2202.09368).

A router's knobs are its nested `Config` (a `moe.RouterConfig` subclass: `MoEConfig(router=
moe.SigmoidBiasRouter.Config(bias_update_rate=0.01))`), which also tells the CPU fast path
(moe/native_cpu.py) how to compute its rule. A new router is one file: its `Config` (if it has knobs)
and its `Router` subclass, registered with `register_router("name")` or through the `moe.routers`
entry-point group (`name = "package.module:RouterClass"`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kernels
from kernels import Registry

from .config import MoEConfig, RouterConfig, _positive_float

ENTRY_POINT_GROUP = "moe.routers"


@dataclass
class Routing:
    """One routing decision for T tokens.

    logits_TE: router logits x_TD @ weight_ED^T (in x's dtype; the z-loss reads them).
    experts_TK: int64 expert of every slot.
    weights_TK: float32 combine weight of every slot (already scaled by routed_scaling_factor).
    kept: for routers that choose the kept slots themselves (expert choice), the expert-sorted kept
        slots; None for token-choice routers, whose every slot is kept unless capacity drops it.
    """

    logits_TE: Tensor
    experts_TK: Tensor
    weights_TK: Tensor
    kept: kernels.ExpertSort | None = None


class Router(nn.Module):
    """Base class: a linear gate weight [E, D] (nn.Linear layout) and a `route` rule on its logits.

    `config` is the router's own `Config` (`MoEConfig.router`); the layer's sizes come from the MoEConfig.
    """

    #: set by register_router
    name: ClassVar[str] = ""
    #: the router's knobs; a router with knobs of its own nests a RouterConfig subclass here
    Config: ClassVar[type[RouterConfig]] = RouterConfig

    def __init__(
        self, config: MoEConfig, *, device: torch.device | None = None, dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.config = config.router
        self.num_experts = config.num_experts
        self.top_k = config.top_k
        self.routed_scaling_factor = config.router.routed_scaling_factor
        self.backend = config.backend
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Small normal init (std 0.02): near-uniform routing at the start, as Switch recommends."""
        nn.init.normal_(self.weight, std=0.02)

    @property
    def slots_per_token(self) -> int:
        """K, the second dim of experts_TK / weights_TK."""
        return self.top_k

    def forward(self, x_TD: Tensor) -> Routing:
        """Route T tokens (x_TD contiguous, validated by the layer)."""
        return self.route(F.linear(x_TD, self.weight))

    def route(self, logits_TE: Tensor) -> Routing:
        """The routing rule on router logits."""
        raise NotImplementedError

    def balance_probs(self, logits_TE: Tensor) -> Tensor:
        """P_TE, the router probabilities the load-balancing loss averages (float32, rows sum to 1)."""
        return torch.softmax(logits_TE.float(), dim=-1)

    def observe(self, routed_counts_E: Tensor) -> None:
        """Called by the layer with the router's per-expert slot counts (before capacity); no-op here."""

    def _scaled(self, weights_TK: Tensor) -> Tensor:
        return weights_TK if self.routed_scaling_factor == 1.0 else weights_TK * self.routed_scaling_factor


# --------------------------------------------------------------------------- registry
ROUTERS = Registry("router", ENTRY_POINT_GROUP)
"""Router classes by name (:class:`kernels.registry.Registry`); ``moe.routers`` entry points too."""


def register_router(name: str) -> Callable[[type[Router]], type[Router]]:
    """Class decorator: make a Router subclass available as MoEConfig(router=name) (or its Config)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"router name must be a non-empty string, got {name!r}")

    def add(cls: type[Router]) -> type[Router]:
        if not (isinstance(cls, type) and issubclass(cls, Router)):
            raise ValueError(f"router {name!r} must be a subclass of moe.Router, got {cls!r}")
        cls.name = name
        ROUTERS.register(name, cls)
        return cls

    return add


def router_names() -> list[str]:
    """Known router names: registered ones and the `moe.routers` entry points, sorted."""
    return ROUTERS.names()


def get_router(name: str) -> type[Router]:
    """The Router class registered as `name` (ValueError listing the known names if there is none)."""
    cls = ROUTERS.get(name)
    if not (isinstance(cls, type) and issubclass(cls, Router)):
        raise ValueError(f"router {name!r} must be a subclass of moe.Router, got {cls!r}")
    cls.name = name
    return cls


def build_router(
    config: MoEConfig, *, device: torch.device | None = None, dtype: torch.dtype | None = None
) -> Router:
    """Instantiate config.router's router for config."""
    return get_router(config.router.name)(config, device=device, dtype=dtype)


# --------------------------------------------------------------------------- built-in routers
class TopKRouter(Router):
    """Token choice by one top-k rule: its `Config.topk_options`, run by `kernels.topk_routing` here
    and in one C call on the CPU fast path (moe/native_cpu.py). A new rule of this kind is a Config."""

    def route(self, logits_TE: Tensor) -> Routing:
        options = self.config.topk_options(self)
        weights_TK, experts_TK = kernels.topk_routing(logits_TE, self.top_k, backend=self.backend, **options)
        return Routing(logits_TE, experts_TK, self._scaled(weights_TK))


@register_router("softmax_topk")
class SoftmaxTopKRouter(TopKRouter):
    """p = softmax(logits); the top-k experts by p; weights p_k, divided by their sum when `renormalize`.

    GShard top-2 (arXiv:2006.16668) and Mixtral (arXiv:2401.04088) renormalise; Qwen-MoE leaves it to
    `norm_topk_prob`. Ties go to the lower expert index.
    """

    @dataclass(frozen=True, kw_only=True)
    class Config(RouterConfig):
        """renormalize: rescale each token's top-k weights to sum to 1 (Mixtral; Qwen's `norm_topk_prob`)."""

        name: str = "softmax_topk"
        renormalize: bool = True

        def topk_options(self, router: Router) -> dict[str, Any]:
            return {"scoring": "softmax", "renormalize": self.renormalize}


@register_router("switch")
class SwitchRouter(TopKRouter):
    """Switch Transformer top-1 routing (Fedus et al., arXiv:2101.03961, eq. 1-2).

    p = softmax(logits); each token goes to argmax_i p_i, and the expert output is scaled by that p_i (not
    renormalised, so the gate stays differentiable). Combine with a capacity factor for the paper's setup.
    """

    @dataclass(frozen=True, kw_only=True)
    class Config(RouterConfig):
        """No knob but the scaling factor."""

        name: str = "switch"

        def topk_options(self, router: Router) -> dict[str, Any]:
            return {"scoring": "softmax", "renormalize": False}

    def __init__(self, config: MoEConfig, **kwargs) -> None:
        if config.top_k != 1:
            raise ValueError(f"top_k must be 1 for the 'switch' router (Switch is top-1), got {config.top_k}")
        super().__init__(config, **kwargs)


@register_router("sigmoid_bias")
class SigmoidBiasRouter(TopKRouter):
    """DeepSeek-V3 routing with auxiliary-loss-free load balancing (arXiv:2412.19437, section 2.1.2).

    s = sigmoid(logits). The top-k experts are chosen by s + b, where the bias b (buffer `expert_bias`) is
    used for the *selection only*; the weights are the unbiased s of the chosen experts, normalised to sum
    to 1 when `renormalize` (as in the paper), times routed_scaling_factor.

    b is trained outside autograd: while the layer is in training mode the router accumulates how many
    slots each expert received (`pending_load`); the training loop calls `update_bias()` once per step,
    which moves b_i by gamma * sign(mean load - load_i) (raise underloaded experts, lower overloaded ones)
    and clears the accumulator. Under expert parallelism, all-reduce `pending_load` first (or pass load_E).
    """

    @dataclass(frozen=True, kw_only=True)
    class Config(RouterConfig):
        """renormalize: the chosen experts' weights sum to 1 (as in the paper).
        bias_update_rate: gamma of the bias update (arXiv:2412.19437 uses 1e-3)."""

        name: str = "sigmoid_bias"
        renormalize: bool = True
        bias_update_rate: float = 1e-3

        def __post_init__(self) -> None:
            super().__post_init__()
            if not _positive_float(self.bias_update_rate, allow_zero=True):
                raise ValueError(
                    f"bias_update_rate must be a finite number >= 0, got {self.bias_update_rate!r}"
                )

        def topk_options(self, router: Router) -> dict[str, Any]:
            return {"scoring": "sigmoid", "renormalize": self.renormalize, "bias_E": router.expert_bias}

    def __init__(self, config: MoEConfig, *, device=None, dtype=None) -> None:
        super().__init__(config, device=device, dtype=dtype)
        self.register_buffer(
            "expert_bias", torch.zeros(config.num_experts, device=device, dtype=torch.float32)
        )
        self.register_buffer(
            "pending_load",
            torch.zeros(config.num_experts, device=device, dtype=torch.int64),
            persistent=False,
        )

    def balance_probs(self, logits_TE: Tensor) -> Tensor:
        """Normalised sigmoid scores s_i / sum_j s_j (DeepSeek-V3's sequence-wise balance loss, eq. 19)."""
        scores_TE = torch.sigmoid(logits_TE.float())
        return scores_TE / scores_TE.sum(dim=-1, keepdim=True)

    def observe(self, routed_counts_E: Tensor) -> None:
        if self.training:
            self.pending_load += routed_counts_E.to(self.pending_load.device, torch.int64)

    @torch.no_grad()
    def update_bias(self, load_E: Tensor | None = None) -> Tensor:
        """b_i += gamma * sign(mean(load) - load_i); returns the load used. Clears `pending_load`.

        Args:
            load_E: per-expert slot counts to balance; None uses the accumulated `pending_load`.
        """
        load = (self.pending_load if load_E is None else load_E).to(self.expert_bias.device).float()
        if load.shape != (self.num_experts,):
            raise ValueError(f"load_E must have shape [E={self.num_experts}], got {tuple(load.shape)}")
        if load.sum() > 0:
            self.expert_bias += self.config.bias_update_rate * torch.sign(load.mean() - load)
        self.pending_load.zero_()
        return load


@register_router("expert_choice")
class ExpertChoiceRouter(Router):
    """Expert-choice routing (Zhou et al., arXiv:2202.09368): experts pick tokens, not the reverse.

    S = softmax(logits) over experts; expert e takes the C tokens with the highest S[:, e] (ties: the earlier
    token), with C = ceil(capacity_factor * T * top_k / E) clipped to [1, T], so on average every token gets
    top_k experts and no expert overflows (capacity_factor None means 1). A token may get anywhere from 0 to E
    experts; its output is sum_e S[t, e] * expert_e(x_t) over the experts that picked it.

    The slots are one per (token, expert) pair (K = E): slot t*E + e belongs to expert e. Note the choice
    looks at every token in the call, so it is not causal; with T=1 every expert picks the single token.
    """

    def __init__(self, config: MoEConfig, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.capacity_factor = 1.0 if config.capacity_factor is None else config.capacity_factor

    @property
    def slots_per_token(self) -> int:
        return self.num_experts

    def capacity(self, num_tokens: int) -> int:
        """C, the tokens each expert takes out of num_tokens."""
        wanted = math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)
        return max(1, min(num_tokens, wanted))

    def route(self, logits_TE: Tensor) -> Routing:
        num_tokens, num_experts = logits_TE.shape
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        capacity = self.capacity(num_tokens)
        # Each expert ranks all tokens; a stable sort makes ties go to the earlier token.
        picked_EC = torch.sort(probs_TE.detach().T, dim=1, descending=True, stable=True).indices[:, :capacity]
        picked_EC = picked_EC.sort(dim=1).values  # token order within an expert, as sort_by_expert gives
        experts_E1 = torch.arange(num_experts, device=logits_TE.device).unsqueeze(1)
        sorted_slots_M = (picked_EC * num_experts + experts_E1).reshape(-1)
        group_sizes_E = torch.full((num_experts,), capacity, dtype=torch.int64, device=logits_TE.device)
        offsets_E1 = torch.arange(num_experts + 1, device=logits_TE.device) * capacity
        chosen_ET = torch.zeros(num_experts, num_tokens, dtype=torch.bool, device=logits_TE.device)
        chosen_ET.scatter_(1, picked_EC, True)
        weights_TE = self._scaled(probs_TE * chosen_ET.T)
        experts_TE = experts_E1.T.expand(num_tokens, -1).contiguous()
        kept = kernels.ExpertSort(sorted_slots_M, group_sizes_E, offsets_E1)
        return Routing(logits_TE, experts_TE, weights_TE, kept)
