"""Expert parallelism: shard a moe.MoE's routed experts over the ranks of a torch.distributed group.

Legend: T tokens on this rank, D model dim, E experts, R ranks in the group, L = E/R local experts,
K slots per token, M kept slots of this rank in expert order, N rows this rank's experts receive.

    torch.distributed.init_process_group()          # torchrun: NCCL on GPUs, gloo on CPUs
    layer = moe.MoE(dim=..., num_experts=E, ...)     # same seed (same weights) on every rank
    expert_parallel(layer, group)                    # in place: group rank r keeps experts r*L .. r*L+L-1
    y = layer(x_local)                               # == the unsharded layer on x_local
    loss.backward(); sync_gradients(model, group)    # replicated gradients all-reduced (see below)

One call is GShard's dispatch / combine (Lepikhin et al., arXiv:2006.16668) with dropless uneven splits as
in MegaBlocks (Gale et al., arXiv:2211.15841) and torchtitan's ExpertParallel:

    x_MD    = permute(x_TD, plan)              # expert order: rows are grouped by destination rank
    recv_RL = exchange_counts(send_RL)         # all_to_all_single of the per-expert counts
    x_ND    = all_to_all(x_MD, splits)         # uneven splits, autograd-aware (parallel_comm.py)
    x_ND    = x_ND[expert-major order]         # rows arrive (source rank, local expert)-major
    y_ND    = experts(x_ND, recv_RL.sum(0))    # kernels.grouped_gemm over the L local experts
    y_MD    = all_to_all(y_ND[back], reverse splits)
    y_TD    = unpermute(y_MD, plan, weights)   # weighted combine

Sharded vs replicated:
- Sharded: experts.w_gate_up [L, D, 2H] and experts.w_down [L, H, D], slices of the [E, ...] stacks. Their
  gradient on the owning rank is complete: the backward all-to-all returns every rank's contribution, so
  it is d(sum over ranks of each rank's loss)/dW, the same as the unsharded layer's on all tokens.
- Replicated: router.weight (and sigmoid_bias's expert_bias), the shared experts. After backward their
  gradients hold this rank's local contribution only. Nothing is all-reduced behind your back:
  `sync_gradients(model, group)` does it (or wrap the non-expert parameters in DDP), and
  `sync_router_load(model, group)` before `moe.update_router_biases` keeps sigmoid_bias biases equal.

Capacity (capacity_factor set) is global: C = ceil(cf * T_all * K / E) with T_all the tokens of all ranks,
and capacity.py's (k, t) priority over the ranks' tokens concatenated in group-rank order; the outputs equal
the unsharded layer's on that concatenation. It costs one all_gather of [K, E] counts per call;
`last_global_drop_fraction` reports the group's drop fraction, `last_drop_fraction` this rank's.

Every rank of the group must call forward (a rank without tokens passes a [0, D] input) and backward on the
output (its loss may be 0): the all-to-alls are collectives. Expert-choice routing, which ranks all tokens
of a call at once, is not supported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

import kernels

from .capacity import expert_capacity
from .dispatch import DispatchPlan
from .layer import MoE
from .parallel_comm import all_to_all, exchange_counts, gather_from_ranks, group_rank, group_size
from .routers import ExpertChoiceRouter

__all__ = [
    "AllToAllStats",
    "ExpertParallelDispatcher",
    "ExpertParallelMoE",
    "expert_parallel",
    "global_keep_mask",
    "sync_gradients",
    "sync_router_load",
]

SHARDED_PARAMETERS = ("w_gate_up", "w_down")


@dataclass(frozen=True)
class AllToAllStats:
    """What one dispatcher call moved, seen from this rank (rank `rank` of the group).

    send_rows[j]: rows sent to rank j in the dispatch (and received back from it in the combine).
    recv_rows[j]: rows received from rank j in the dispatch (and sent back to it in the combine).
    tokens_per_local_expert[l]: rows local expert l processed.
    row_bytes: bytes of one row (D * element size).
    """

    rank: int
    send_rows: tuple[int, ...]
    recv_rows: tuple[int, ...]
    tokens_per_local_expert: tuple[int, ...]
    row_bytes: int

    @property
    def dispatch_bytes(self) -> int:
        """Bytes this rank sent to other ranks in the dispatch (rows kept on this rank excluded)."""
        return (sum(self.send_rows) - self.send_rows[self.rank]) * self.row_bytes

    @property
    def combine_bytes(self) -> int:
        """Bytes this rank sent to other ranks in the combine."""
        return (sum(self.recv_rows) - self.recv_rows[self.rank]) * self.row_bytes


class ExpertParallelDispatcher:
    """dispatch -> local experts -> combine across the ranks of `group` (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, num_experts: int, backend: str | None = None):
        self.group = group
        self.world_size = group_size(group)
        self.rank = group_rank(group)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.world_size
        self.backend = backend
        self.last_stats: AllToAllStats | None = None

    def __call__(self, x_TD: Tensor, plan: DispatchPlan, experts: nn.Module) -> Tensor:
        world, local = self.world_size, self.num_local_experts
        no_tokens = x_TD.shape[0] == 0  # then M = 0 too; kernels.permute/unpermute want T >= 1
        x_MD = (
            x_TD
            if no_tokens
            else kernels.permute(x_TD, plan.sorted_slots_M, plan.slots_per_token, backend=self.backend)
        )
        send_RL = plan.group_sizes_E.to(x_TD.device).view(world, local)
        recv_RL = exchange_counts(send_RL, self.group)
        counts_2RL = torch.stack([send_RL, recv_RL]).cpu()  # the one host sync: all_to_all needs the splits
        send_splits, recv_splits = counts_2RL.sum(dim=2).tolist()
        x_ND = all_to_all(x_MD, recv_splits, send_splits, self.group)
        order_N = _expert_major_order(recv_RL, sum(recv_splits)) if local > 1 and world > 1 else None
        if order_N is not None:
            x_ND = x_ND.index_select(0, order_N)
        recv_L = recv_RL.sum(dim=0)
        y_ND = experts(x_ND, recv_L)
        if order_N is not None:
            y_ND = y_ND.index_select(0, _inverse_permutation(order_N))
        y_MD = all_to_all(y_ND, send_splits, recv_splits, self.group)
        self.last_stats = AllToAllStats(
            rank=self.rank,
            send_rows=tuple(send_splits),
            recv_rows=tuple(recv_splits),
            tokens_per_local_expert=tuple(counts_2RL[1].sum(dim=0).tolist()),
            row_bytes=x_TD.shape[1] * x_TD.element_size(),
        )
        if no_tokens:  # y_MD is [0, D] and still carries the backward all-to-all
            return y_MD
        return kernels.unpermute(y_MD, plan.sorted_slots_M, plan.weights_TK, backend=self.backend)

    def __repr__(self) -> str:
        return (
            f"ExpertParallelDispatcher(rank={self.rank}, world_size={self.world_size}, "
            f"local_experts={self.num_local_experts}, backend={self.backend!r})"
        )


def _expert_major_order(counts_RL: Tensor, total: int) -> Tensor:
    """Row indices that reorder rows laid out (source rank, local expert)-major into (expert, rank)-major."""
    world, local = counts_RL.shape
    sizes_S = counts_RL.reshape(-1)
    starts_RL = (torch.cumsum(sizes_S, dim=0) - sizes_S).view(world, local)
    sizes_LR, starts_LR = counts_RL.T.reshape(-1), starts_RL.T.reshape(-1)
    out_starts_LR = torch.cumsum(sizes_LR, dim=0) - sizes_LR
    block_N = torch.repeat_interleave(
        torch.arange(world * local, device=counts_RL.device), sizes_LR, output_size=total
    )
    return starts_LR[block_N] + torch.arange(total, device=counts_RL.device) - out_starts_LR[block_N]


def _inverse_permutation(order_N: Tensor) -> Tensor:
    inverse_N = torch.empty_like(order_N)
    inverse_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)
    return inverse_N


def global_keep_mask(experts_TK: Tensor, counts_RKE: Tensor, rank: int, capacity: int) -> Tensor:
    """bool keep_TK for this rank's slots under capacity.keep_mask's rule applied to all ranks' slots at once.

    The ranks' tokens are taken as one batch concatenated in rank order, so slot (t, k) of rank r is ahead
    of it, in its expert e, exactly: every rank's slots with choice k' < k, the slots with choice k of
    ranks r' < r, and this rank's slots with choice k and token t' < t. It is kept iff fewer than
    `capacity` slots are ahead.

    Args:
        experts_TK: int64 expert of every slot of this rank.
        counts_RKE: counts_RKE[r, k, e] = slots of rank r with choice k routed to expert e (all ranks).
        rank: this rank's index r.
        capacity: C, slots each expert keeps over all ranks.
    """
    num_tokens, top_k = experts_TK.shape
    num_experts = counts_RKE.shape[2]
    device = experts_TK.device
    total_KE = counts_RKE.sum(dim=0)
    ahead_KE = (torch.cumsum(total_KE, dim=0) - total_KE) + counts_RKE[:rank].sum(dim=0)
    # (k, e) key of every slot in k-major order (index k*T + t); a stable sort ranks the tokens within a key.
    choice_K1 = torch.arange(top_k, device=device).unsqueeze(1)
    key_S = (choice_K1 * num_experts + experts_TK.T).reshape(-1)
    order_S = torch.sort(key_S, stable=True).indices
    counts_G = torch.bincount(key_S, minlength=top_k * num_experts)
    starts_G = torch.cumsum(counts_G, dim=0) - counts_G
    position_sorted_S = torch.arange(key_S.numel(), device=device) - starts_G[key_S[order_S]]
    position_S = torch.empty_like(position_sorted_S).index_copy_(0, order_S, position_sorted_S)
    keep_S = ahead_KE.to(device).reshape(-1)[key_S] + position_S < capacity
    return keep_S.view(top_k, num_tokens).T


class ExpertParallelMoE(MoE):
    """A moe.MoE whose routed experts are sharded over a process group; made by `expert_parallel`.

    Extra attributes: ep_group, ep_rank, ep_size, expert_start (global index of local expert 0),
    last_global_drop_fraction, and `last_all_to_all` (AllToAllStats of the latest call).
    """

    ep_group: dist.ProcessGroup | None
    ep_rank: int
    ep_size: int
    expert_start: int
    last_global_drop_fraction: float

    def forward(self, x: Tensor) -> Tensor:
        """The unsharded layer's output on this rank's tokens; a [0, D] input still joins the collectives."""
        if isinstance(x, Tensor) and x.dim() >= 1 and x.shape[:-1].numel() == 0:
            return self._forward_no_tokens(x)
        return super().forward(x)

    def _forward_no_tokens(self, x: Tensor) -> Tensor:
        x_TD = self._tokens(x)
        slots = self.router.slots_per_token
        experts_TK = torch.empty(0, slots, dtype=torch.int64, device=x.device)
        routed = kernels.sort_by_expert(experts_TK, self.config.num_experts, backend=self.config.backend)
        if self.config.capacity_factor is not None:
            routed, _ = self.drop_slots(experts_TK, routed)  # joins the global count
        weights_TK = torch.empty(0, slots, dtype=torch.float32, device=x.device)
        plan = DispatchPlan(routed.sorted_slots_M, routed.group_sizes_E, weights_TK)
        y_TD = self.dispatcher(x_TD, plan, self.experts)
        if self.shared_experts is not None:
            y_TD = y_TD + self.shared_experts(x_TD)
        last = self._last
        last.drop_fraction, last.tokens_per_expert = 0.0, routed.group_sizes_E
        last.aux_loss = last.z_loss = None
        return y_TD.view(x.shape)

    def drop_slots(self, experts_TK: Tensor, routed: kernels.ExpertSort) -> tuple[kernels.ExpertSort, int]:
        """Global capacity dropping (module docstring); returns this rank's kept plan and dropped slots."""
        num_tokens, top_k = experts_TK.shape
        num_experts = self.config.num_experts
        key_S = (torch.arange(top_k, device=experts_TK.device) * num_experts + experts_TK).reshape(-1)
        counts_KE = torch.bincount(key_S, minlength=top_k * num_experts).view(top_k, num_experts)
        counts_RKE = gather_from_ranks(counts_KE, self.ep_group).cpu()
        total_E = counts_RKE.sum(dim=(0, 1))
        total_slots = int(total_E.sum())
        capacity = expert_capacity(total_slots // top_k, top_k, num_experts, self.config.capacity_factor)
        global_dropped = int((total_E - capacity).clamp(min=0).sum())
        self.last_global_drop_fraction = global_dropped / total_slots if total_slots else 0.0
        if global_dropped == 0:
            return routed, 0
        keep_S = global_keep_mask(experts_TK, counts_RKE, self.ep_rank, capacity).reshape(-1)
        kept_slots_M = routed.sorted_slots_M[keep_S[routed.sorted_slots_M]]
        kept_sizes_E = torch.bincount(experts_TK.reshape(-1)[kept_slots_M], minlength=num_experts)
        offsets_E1 = torch.zeros(num_experts + 1, dtype=torch.int64, device=kept_sizes_E.device)
        torch.cumsum(kept_sizes_E, dim=0, out=offsets_E1[1:])
        dropped = routed.sorted_slots_M.numel() - kept_slots_M.numel()
        return kernels.ExpertSort(kept_slots_M, kept_sizes_E, offsets_E1), dropped

    @property
    def last_all_to_all(self) -> AllToAllStats | None:
        """Rows and bytes the latest call exchanged (None before the first call)."""
        return self.dispatcher.last_stats

    @property
    def expert_range(self) -> range:
        """Global indices of the experts this rank holds."""
        return range(self.expert_start, self.expert_start + self.experts.num_experts)

    def extra_repr(self) -> str:
        r = self.expert_range
        return (
            f"{super().extra_repr()}, ep_rank={self.ep_rank}/{self.ep_size}, experts={r.start}..{r.stop - 1}"
        )


_EP_CLASSES: dict[type, type] = {MoE: ExpertParallelMoE}


def _expert_parallel_class(cls: type) -> type:
    """ExpertParallelMoE for MoE; for a MoE subclass, a cached class deriving from both (like fully_shard)."""
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelMoE, cls), {})
    return _EP_CLASSES[cls]


def expert_parallel(layer: MoE, group: dist.ProcessGroup | None = None) -> ExpertParallelMoE:
    """Shard `layer`'s routed experts over `group` IN PLACE, and return it (now an ExpertParallelMoE).

    Rank r of the group keeps experts r*L .. r*L+L-1 (L = num_experts / group size) as slices of the stacked
    expert weights; the router and shared experts stay replicated. Like torch's `fully_shard`, the layer
    object is converted (its class changes) so that it stays where it is in a model: call it on every MoE
    layer (`for m in moe.moe_layers(model): expert_parallel(m)`) before building the optimizer.

    Args:
        layer: a moe.MoE with identical weights on every rank of the group (same seed, or broadcast);
            checked with one all_gather of per-tensor checksums.
        group: the expert-parallel process group; None for the default group.

    Raises:
        ValueError: not a moe.MoE or already expert-parallel, torch.distributed not initialised or this
            process not in `group`, num_experts not divisible by the group size, an expert-choice router,
            or weights that differ across ranks.
    """
    if not isinstance(layer, MoE):
        raise ValueError(f"layer must be a moe.MoE, got {type(layer).__name__}")
    if isinstance(layer, ExpertParallelMoE):
        raise ValueError("layer is already expert-parallel")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "expert_parallel needs torch.distributed: call torch.distributed.init_process_group() first "
            "(torchrun sets the environment for it)"
        )
    world, rank = group_size(group), group_rank(group)
    if rank < 0:
        raise ValueError("group must contain this process (dist.get_rank(group) is -1)")
    num_experts = layer.config.num_experts
    if num_experts % world:
        raise ValueError(
            f"num_experts={num_experts} must be divisible by the expert-parallel group size {world} "
            "(uneven experts per rank are not supported)"
        )
    if isinstance(layer.router, ExpertChoiceRouter):
        raise ValueError(
            "router 'expert_choice' is not supported by expert_parallel: each expert ranks all tokens of "
            "a call, which would need every rank's router scores; use a token-choice router"
        )
    _check_replicated(layer, group)

    local = num_experts // world
    start = rank * local
    experts = layer.experts
    for name in SHARDED_PARAMETERS:
        full = getattr(experts, name)
        shard = full.detach()[start : start + local].clone()
        setattr(experts, name, nn.Parameter(shard, requires_grad=full.requires_grad))
    experts.num_experts = local
    layer.__class__ = _expert_parallel_class(type(layer))
    layer.ep_group, layer.ep_rank, layer.ep_size, layer.expert_start = group, rank, world, start
    layer.last_global_drop_fraction = 0.0
    layer.dispatcher = ExpertParallelDispatcher(group, num_experts, layer.config.backend)
    return layer


@torch.no_grad()
def _check_replicated(layer: MoE, group: dist.ProcessGroup | None) -> None:
    """ValueError unless every parameter and buffer of `layer` is equal on all ranks (two checksums each)."""
    named = [(n, t) for n, t in (*layer.named_parameters(), *layer.named_buffers()) if t.is_floating_point()]
    if not named:
        return
    sums = []
    for _, t in named:
        flat = t.detach().reshape(-1).double()
        ramp = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device)
        sums.append(torch.stack([flat.sum(), (flat * ramp).sum()]))
    checksums_RP2 = gather_from_ranks(torch.stack(sums), group).cpu()
    # Exact for equal weights; the tolerance only forgives a different summation order (thread counts).
    same_RP2 = torch.isclose(checksums_RP2, checksums_RP2[0], rtol=1e-9, atol=1e-12)
    differs = ~same_RP2.all(dim=2).all(dim=0)
    if bool(differs.any()):
        name = named[int(differs.nonzero()[0])][0]
        raise ValueError(
            f"the layer's weights differ across ranks (first: {name!r}); build it with the same seed on "
            "every rank, or broadcast the state from one rank, before expert_parallel"
        )


def _expert_parallel_layers(module: nn.Module) -> list[ExpertParallelMoE]:
    return [m for m in module.modules() if isinstance(m, ExpertParallelMoE)]


@torch.no_grad()
def sync_gradients(
    module: nn.Module, group: dist.ProcessGroup | None = None, *, average: bool = True
) -> None:
    """Turn every gradient of `module` into the gradient of the loss summed (or averaged) over the ranks.

    After backward, each rank's replicated parameters (router, shared experts, everything outside MoE
    layers) hold the gradient of its own loss, while the expert shards hold the gradient of the sum of all
    ranks' losses. This all-reduces (sums) the replicated gradients over `group` in one flat buffer per
    dtype; with average=True it then divides them by the group size, and the expert shards' gradients by
    their layer's expert-parallel size, so that everything is the gradient of the mean loss (what DDP does).
    A replicated parameter without a gradient on some rank (a router that saw no tokens) counts as zeros
    there, so every rank joins the same all-reduces; it must require grad on every rank alike.

    Assumes the data-parallel group is the expert-parallel group (each rank: its own tokens, one expert
    shard). With replicas of expert shards across several EP groups, all-reduce those over the replica group.
    """
    sharded = {
        id(p): layer.ep_size for layer in _expert_parallel_layers(module) for p in layer.experts.parameters()
    }
    world = group_size(group)
    buckets: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for p in module.parameters():
        if id(p) in sharded:
            if average and p.grad is not None:
                p.grad.div_(sharded[id(p)])
        elif p.requires_grad:
            if p.grad is None:  # e.g. the router of a rank without tokens: it contributes zeros
                p.grad = torch.zeros_like(p)
            buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        if average:
            flat.div_(world)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


@torch.no_grad()
def sync_router_load(module: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """All-reduce the accumulated per-expert load of every expert-parallel layer's sigmoid_bias router.

    Call it before `moe.update_router_biases(model)`, so that every rank applies DeepSeek-V3's bias update
    to the same (global) load and the replicated biases stay equal. Returns how many routers were synced.
    """
    synced = 0
    for layer in _expert_parallel_layers(module):
        load = getattr(layer.router, "pending_load", None)
        if isinstance(load, Tensor):
            dist.all_reduce(load, group=layer.ep_group if group is None else group)
            synced += 1
    return synced
