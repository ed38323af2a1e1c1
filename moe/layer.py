"""moe.MoE: a Mixture-of-Experts SwiGLU layer mapping [..., dim] to [..., dim].

Legend: T tokens (all leading dims flattened), D model dim, E experts, K slots per token, M kept slots.

forward(x) = route -> plan -> dispatch -> experts -> combine (+ shared experts):

    routing = router(x_TD)                         # experts_TK, weights_TK, logits_TE    (routers.py)
    plan    = sort slots by expert, drop overflow  # kernels.sort_by_expert, capacity.py
    y_TD    = dispatcher(x_TD, plan, experts)      # permute, grouped GEMM, weighted unpermute (dispatch.py)
    y_TD   += shared_experts(x_TD)                 # optional, optionally sigmoid-gated     (experts.py)

Every piece is a swappable attribute: expert parallelism (moe/parallel.py) replaces `dispatcher` and slices
the stacked expert weights; a new routing rule is a registered Router.

Training-loop hooks: after forward in training mode, `last_aux_loss` (Switch load balancing) and
`last_z_loss` (ST-MoE) hold this call's losses; `moe.collect_aux_losses(model)` sums them over a model, and
`moe.update_router_biases(model)` performs DeepSeek-V3's bias update for "sigmoid_bias" routers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

import kernels

from .capacity import drop_overflow, expert_capacity
from .config import MoEConfig
from .dispatch import Dispatcher, DispatchPlan, LocalDispatcher
from .experts import SharedExperts, SwiGLUExperts
from .losses import load_balancing_loss, router_z_loss
from .native_cpu import native_forward
from .routers import Router, Routing, build_router


class MoE(nn.Module):
    """Mixture-of-Experts layer with SwiGLU experts (dropless by default); see the module docstring.

    Build it as `MoE(dim, hidden_dim, num_experts, top_k, **options)` (options are MoEConfig fields),
    `MoE(config=MoEConfig(...))`, `MoE.from_config(config)`, or `MoE.from_hf(transformers_block)`.

    Statistics, accumulated on every forward when config.track_stats (`stats()` reads them,
    `reset_stats()` clears them; the buffers are not saved in state_dict):
        expert_counts [E] buffer: slots each expert processed (after capacity dropping).
        routed_counts [E] buffer: slots the router sent to each expert (before dropping).
        dropped_slots, total_slots: slots dropped / routed so far (ints).
    Per call (read-only): last_tokens_per_expert [E] (kept), last_drop_fraction, last_aux_loss, last_z_loss.

    native_cpu (default True): float32 CPU inference runs the fused C routing path of moe/native_cpu.py
    where it applies (same outputs, 1.05-1.5x faster); set False to always run the general path.
    """

    def __init__(
        self,
        dim: int | None = None,
        hidden_dim: int | None = None,
        num_experts: int | None = None,
        top_k: int | None = None,
        *,
        config: MoEConfig | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **options,
    ) -> None:
        super().__init__()
        if config is None:
            missing = [
                n
                for n, v in (("dim", dim), ("hidden_dim", hidden_dim), ("num_experts", num_experts))
                if v is None
            ]
            if missing:
                raise ValueError(f"MoE needs {', '.join(missing)} (or config=MoEConfig(...))")
            if top_k is not None:
                options["top_k"] = top_k
            config = MoEConfig(dim=dim, hidden_dim=hidden_dim, num_experts=num_experts, **options)
        elif not isinstance(config, MoEConfig):
            raise ValueError(f"config must be a MoEConfig, got {type(config).__name__}")
        elif any(v is not None for v in (dim, hidden_dim, num_experts, top_k)) or options:
            raise ValueError("pass either config=... or the layer sizes and options, not both")
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        self.config = config
        self.router: Router = build_router(config, device=device, dtype=dtype)
        self.experts = SwiGLUExperts(
            config.num_experts,
            config.dim,
            config.hidden_dim,
            backend=config.backend,
            device=device,
            dtype=dtype,
        )
        self.shared_experts: SharedExperts | None = None
        if config.num_shared_experts:
            self.shared_experts = SharedExperts(
                config.dim, config.shared_hidden, gated=config.shared_expert_gate, device=device, dtype=dtype
            )
        self.dispatcher: Dispatcher = LocalDispatcher(config.backend)

        num_experts = config.num_experts
        counts = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=device)
        self.register_buffer("expert_counts", counts(num_experts), persistent=False)
        self.register_buffer("routed_counts", counts(num_experts), persistent=False)
        # Plain (non-Module) holders: nn.Module.__setattr__ is slow enough to show up at T=1.
        self.dropped_slots = 0
        self.total_slots = 0
        self._last = _LastCall()
        # CPU float32 inference takes the fused native path when it applies (moe/native_cpu.py);
        # False always runs the general route -> plan -> dispatch path (same outputs).
        self.native_cpu = True

    @classmethod
    def from_config(
        cls, config: MoEConfig, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> MoE:
        """A freshly initialised layer for `config`."""
        return cls(config=config, device=device, dtype=dtype)

    @classmethod
    def from_hf(cls, block: nn.Module) -> MoE:
        """The equivalent layer for a transformers Mixtral / Qwen2-MoE / Qwen3-MoE block (moe/hf.py)."""
        from .hf import from_hf

        return from_hf(block)

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor) -> Tensor:
        """y = sum over the chosen experts e of weight_e * SwiGLU_e(x) (+ shared experts), shape of x."""
        x_TD = self._tokens(x)
        if x_TD.shape[0] == 0:
            return x.new_zeros(x.shape)
        y_TD = native_forward(self, x_TD)  # CPU inference: fused C routing (moe/native_cpu.py), or None
        if y_TD is None:
            routing = self.router(x_TD)
            plan, routed_counts_E = self.plan(routing)
            y_TD = self.dispatcher(x_TD, plan, self.experts)
            self._losses(routing, routed_counts_E)
        else:
            self._last.aux_loss = self._last.z_loss = None  # eval mode: no losses
        if self.shared_experts is not None:
            y_TD = y_TD + self.shared_experts(x_TD)
        return y_TD.view(x.shape)

    def plan(self, routing: Routing) -> tuple[DispatchPlan, Tensor]:
        """Expert-sorted kept slots for a routing (capacity applied), and the router's per-expert counts.

        Also records the drop fraction and the statistics.
        """
        config = self.config
        num_tokens, slots_per_token = routing.weights_TK.shape
        if routing.kept is not None:  # the router chose the kept slots itself (expert choice)
            kept = routed = routing.kept
            picked_T = torch.zeros(num_tokens, dtype=torch.bool, device=routing.weights_TK.device)
            picked_T[torch.div(kept.sorted_slots_M, slots_per_token, rounding_mode="floor")] = True
            drop_fraction = 1.0 - int(picked_T.sum()) / num_tokens  # tokens no expert picked
            dropped = 0
        else:
            routed = kernels.sort_by_expert(routing.experts_TK, config.num_experts, backend=config.backend)
            kept, dropped = routed, 0
            if config.capacity_factor is not None:
                kept, dropped = self.drop_slots(routing.experts_TK, routed)
            drop_fraction = dropped / (num_tokens * slots_per_token)
        self.record_plan(
            routed.group_sizes_E,
            kept.group_sizes_E,
            dropped=dropped,
            routed_slots=routed.sorted_slots_M.numel(),
            drop_fraction=drop_fraction,
        )
        return DispatchPlan(kept.sorted_slots_M, kept.group_sizes_E, routing.weights_TK), routed.group_sizes_E

    def record_plan(
        self,
        routed_counts_E: Tensor,
        kept_counts_E: Tensor,
        *,
        dropped: int,
        routed_slots: int,
        drop_fraction: float,
    ) -> None:
        """Book one call's plan: the router's observe hook, last_* values and the statistics."""
        self.router.observe(routed_counts_E)
        self._last.drop_fraction = drop_fraction
        self._last.tokens_per_expert = kept_counts_E
        if self.config.track_stats:
            self.expert_counts.add_(kept_counts_E)
            self.routed_counts.add_(routed_counts_E)
            self.__dict__["dropped_slots"] += dropped
            self.__dict__["total_slots"] += routed_slots

    def drop_slots(self, experts_TK: Tensor, routed: kernels.ExpertSort) -> tuple[kernels.ExpertSort, int]:
        """Capacity dropping of one call's routed slots: (kept plan, dropped slots); see capacity.py.

        A hook: expert parallelism (moe/parallel.py) overrides it to count capacity over all ranks.
        """
        num_tokens, slots_per_token = experts_TK.shape
        num_experts = self.config.num_experts
        capacity = expert_capacity(num_tokens, slots_per_token, num_experts, self.config.capacity_factor)
        return drop_overflow(experts_TK, routed, num_experts, capacity)

    def _losses(self, routing: Routing, routed_counts_E: Tensor) -> None:
        last = self._last
        last.aux_loss = last.z_loss = None
        if not self.training:
            return
        if self.config.aux_loss_coef > 0:
            probs_TE = self.router.balance_probs(routing.logits_TE)
            last.aux_loss = load_balancing_loss(probs_TE, routed_counts_E, self.config.aux_loss_coef)
        if self.config.z_loss_coef > 0:
            last.z_loss = router_z_loss(routing.logits_TE, self.config.z_loss_coef)

    def _tokens(self, x: Tensor) -> Tensor:
        """Validate x ([..., D], the layer's dtype and device) and flatten it to contiguous x_TD."""
        if not isinstance(x, Tensor):
            raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
        dim = self.config.dim
        if x.dim() < 1 or x.shape[-1] != dim:
            raise ValueError(f"x must have shape [..., dim={dim}], got {tuple(x.shape)}")
        weight = self.experts.w_gate_up
        if x.dtype != weight.dtype:
            raise ValueError(f"x has dtype {x.dtype} but the layer's weights are {weight.dtype}")
        if x.device != weight.device:
            raise ValueError(f"x is on {x.device} but the layer's weights are on {weight.device}")
        return x.reshape(-1, dim).contiguous()

    # ------------------------------------------------------------------ training-loop hooks and statistics
    @property
    def last_drop_fraction(self) -> float:
        """Fraction of this call's routed slots dropped (expert choice: of tokens no expert took)."""
        return self._last.drop_fraction

    @property
    def last_tokens_per_expert(self) -> Tensor | None:
        """[E] int64 slots each expert processed in the latest call."""
        return self._last.tokens_per_expert

    @property
    def last_aux_loss(self) -> Tensor | None:
        """Load-balancing loss (coefficient applied) of the latest training-mode forward, else None."""
        return self._last.aux_loss

    @property
    def last_z_loss(self) -> Tensor | None:
        """Router z-loss (coefficient applied) of the latest training-mode forward, else None."""
        return self._last.z_loss

    @property
    def aux_loss(self) -> Tensor:
        """last_aux_loss + last_z_loss of the latest training-mode forward (0 when neither was computed)."""
        total = self.experts.w_gate_up.new_zeros((), dtype=torch.float32)
        for loss in (self.last_aux_loss, self.last_z_loss):
            if loss is not None:
                total = total + loss
        return total

    def update_router_bias(self, load_E: Tensor | None = None) -> Tensor:
        """DeepSeek-V3 bias update of a "sigmoid_bias" router (see SigmoidBiasRouter.update_bias)."""
        update = getattr(self.router, "update_bias", None)
        if update is None:
            raise ValueError(f"router {self.config.router.name!r} has no bias to update (use 'sigmoid_bias')")
        return update(load_E)

    def stats(self) -> dict[str, object]:
        """Accumulated statistics as plain Python values."""
        total = self.total_slots
        return {
            "expert_counts": self.expert_counts.tolist(),
            "routed_counts": self.routed_counts.tolist(),
            "dropped_slots": self.dropped_slots,
            "total_slots": total,
            "drop_fraction": self.dropped_slots / total if total else 0.0,
            "last_drop_fraction": self.last_drop_fraction,
        }

    def reset_stats(self) -> None:
        """Zero the accumulated statistics."""
        self.expert_counts.zero_()
        self.routed_counts.zero_()
        self.dropped_slots = self.total_slots = 0
        self._last = _LastCall()

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"dim={c.dim}, hidden_dim={c.hidden_dim}, num_experts={c.num_experts}, top_k={c.top_k}, "
            f"router={c.router}, capacity_factor={c.capacity_factor}, shared={c.shared_hidden}"
        )


@dataclass
class _LastCall:
    """What the latest forward measured (see the MoE.last_* properties)."""

    drop_fraction: float = 0.0
    tokens_per_expert: Tensor | None = None
    aux_loss: Tensor | None = None
    z_loss: Tensor | None = None


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every MoE layer inside model, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def collect_aux_losses(model: nn.Module) -> Tensor:
    """Sum of the router losses (load balancing + z-loss) of every MoE layer's latest training forward."""
    losses = [layer.aux_loss for layer in moe_layers(model)]
    if not losses:
        return torch.zeros(())
    return torch.stack(losses).sum()


def update_router_biases(model: nn.Module) -> int:
    """Run the DeepSeek-V3 bias update on every MoE layer with a "sigmoid_bias" router; returns how many."""
    updated = 0
    for layer in moe_layers(model):
        if hasattr(layer.router, "update_bias"):
            layer.router.update_bias()
            updated += 1
    return updated
