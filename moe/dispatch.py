"""Token dispatch: send routed slots to their experts and combine the results, on one process.

Legend: T tokens, D model dim, E experts, K slots per token, M kept slots in expert order.

The layer's forward is route -> plan -> dispatch -> experts -> combine. A `Dispatcher` owns the last three:
given the tokens, the expert-sorted plan and the routing weights, it returns the weighted sum of expert
outputs per token. `LocalDispatcher` runs every expert here:

    x_MD  = kernels.permute(x_TD, sorted_slots_M, K)          # gather rows into expert order
    y_MD  = experts(x_MD, group_sizes_E)                      # grouped GEMM over the experts
    y_TD  = kernels.unpermute(y_MD, sorted_slots_M, weights_TK)  # weighted combine (dropped slots add 0)

Expert parallelism (moe/parallel.py) replaces the dispatcher with one that exchanges rows between ranks
(all-to-all) around the same grouped GEMM over each rank's slice of the stacked expert weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

import kernels


@dataclass
class DispatchPlan:
    """Where every kept slot goes.

    sorted_slots_M: int64 slot ids t*K + k of the kept slots, grouped by expert, ascending within one.
    group_sizes_E: int64 kept slots per expert.
    weights_TK: combine weight of every slot (slots absent from sorted_slots_M are ignored).
    """

    sorted_slots_M: Tensor
    group_sizes_E: Tensor
    weights_TK: Tensor

    @property
    def slots_per_token(self) -> int:
        """K."""
        return self.weights_TK.shape[1]


class Dispatcher(Protocol):
    """dispatch -> experts -> combine for one layer call."""

    def __call__(self, x_TD: Tensor, plan: DispatchPlan, experts: nn.Module) -> Tensor: ...


class LocalDispatcher:
    """All experts on this process: permute, grouped GEMM, weighted unpermute (all `kernels` ops)."""

    def __init__(self, backend: str | None = None) -> None:
        self.backend = backend

    def __call__(self, x_TD: Tensor, plan: DispatchPlan, experts: nn.Module) -> Tensor:
        x_MD = kernels.permute(x_TD, plan.sorted_slots_M, plan.slots_per_token, backend=self.backend)
        y_MD = experts(x_MD, plan.group_sizes_E)
        return kernels.unpermute(y_MD, plan.sorted_slots_M, plan.weights_TK, backend=self.backend)

    def __repr__(self) -> str:
        return f"LocalDispatcher(backend={self.backend!r})"


class ReferenceDispatcher:
    """Plain-PyTorch oracle for LocalDispatcher: one expert at a time, index_add combine; no `kernels` ops.

    Usable as a drop-in (`layer.dispatcher = ReferenceDispatcher()`) to rule out a kernel bug.
    """

    def __call__(self, x_TD: Tensor, plan: DispatchPlan, experts: nn.Module) -> Tensor:
        top_k = plan.slots_per_token
        weights_S = plan.weights_TK.reshape(-1)
        out_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
        start = 0
        for e, size in enumerate(plan.group_sizes_E.tolist()):
            slots = plan.sorted_slots_M[start : start + size]
            start += size
            if size == 0:
                continue
            tokens = torch.div(slots, top_k, rounding_mode="floor")
            y = experts.expert(e, x_TD[tokens]).float() * weights_S[slots].float().unsqueeze(-1)
            out_TD = out_TD.index_add(0, tokens, y)
        return out_TD.to(x_TD.dtype)

    def __repr__(self) -> str:
        return "ReferenceDispatcher()"
