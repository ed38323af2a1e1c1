"""Expert capacity and token dropping for token-choice routing.

Switch Transformer (arXiv:2101.03961) and GShard (arXiv:2006.16668).

Legend: T tokens, E experts, K slots per token (top_k), M kept slots in expert order.

With a capacity factor c, each expert processes at most C = ceil(c * T * K / E) slots per forward; the
overflow is dropped (its token gets nothing from that expert; the residual connection around the layer
carries it through, as in Switch Transformer).

Priority rule (deterministic, GShard's): all first choices (k = 0) outrank all second choices (k = 1), and
so on; within the same choice rank the earlier token (lower flat index t in the [..., dim] input) wins. So
an expert keeps the C slots with the smallest (k, t).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import kernels


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor * T * K / E), at least 1."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def keep_mask(experts_TK: Tensor, num_experts: int, capacity: int) -> Tensor:
    """bool keep_TK: whether each slot fits in its expert's capacity under the (k, t) priority rule."""
    num_tokens, top_k = experts_TK.shape
    # Rank every slot within its expert in priority order: a stable sort of the k-major flattening.
    experts_S = experts_TK.T.reshape(-1)  # index k*T + t
    order_S = torch.sort(experts_S, stable=True).indices
    counts_E = torch.bincount(experts_S, minlength=num_experts)
    starts_E = torch.cumsum(counts_E, dim=0) - counts_E
    rank_sorted_S = torch.arange(experts_S.numel(), device=experts_S.device) - starts_E[experts_S[order_S]]
    rank_S = torch.empty_like(rank_sorted_S).index_copy_(0, order_S, rank_sorted_S)
    return (rank_S < capacity).view(top_k, num_tokens).T


def drop_overflow(
    experts_TK: Tensor, plan: kernels.ExpertSort, num_experts: int, capacity: int
) -> tuple[kernels.ExpertSort, int]:
    """Remove the slots beyond each expert's capacity from an expert-sorted plan.

    Args:
        experts_TK: int64 chosen expert of every slot.
        plan: kernels.sort_by_expert(experts_TK, num_experts), all slots.
        num_experts: E.
        capacity: C, slots each expert may keep.

    Returns:
        (kept plan, number of dropped slots). The kept plan lists the surviving slots in the same
        expert-grouped, ascending-slot order, with group sizes min(size, C).
    """
    sorted_slots_M, group_sizes_E, _ = plan
    if int(group_sizes_E.max()) <= capacity:
        return plan, 0
    keep_S = keep_mask(experts_TK, num_experts, capacity).reshape(-1)
    kept_slots_M = sorted_slots_M[keep_S[sorted_slots_M]]
    kept_sizes_E = group_sizes_E.clamp(max=capacity)
    offsets_E1 = torch.zeros(num_experts + 1, dtype=torch.int64, device=group_sizes_E.device)
    torch.cumsum(kept_sizes_E, dim=0, out=offsets_E1[1:])
    dropped = sorted_slots_M.numel() - kept_slots_M.numel()
    return kernels.ExpertSort(kept_slots_M, kept_sizes_E, offsets_E1), dropped
