"""Collectives for expert parallelism: an autograd-aware uneven all-to-all and the per-expert count exchange.

Legend: N rows, R ranks in the expert-parallel group, L local experts per rank (E = R*L), K slots per token,
E experts.

Only `torch.distributed` is used (NCCL on GPUs, gloo on CPUs), so whatever launcher and backend a user
already has works. `all_to_all` is our own `torch.autograd.Function` rather than
`torch.distributed.nn.functional.all_to_all_single` (deprecated in torch 2.x, and it wants a preallocated
output) or `torch.distributed._functional_collectives.all_to_all_single_autograd` (private); its backward is
the reverse all-to-all: the gradient of row i that went to rank j comes back from rank j.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_to_all", "exchange_counts", "gather_from_ranks", "group_rank", "group_size"]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in `group` (None: the default group)."""
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank within `group` (None: the default group)."""
    return dist.get_rank(group)


def _all_to_all_rows(
    x_ND: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup | None
) -> Tensor:
    out = x_ND.new_empty((sum(output_splits), *x_ND.shape[1:]))
    dist.all_to_all_single(out, x_ND.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all along dim 0; backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x_ND, output_splits, input_splits, group):  # noqa: D102
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return _all_to_all_rows(x_ND, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad_ND):  # noqa: D102
        grad_x = _AllToAll.apply(grad_ND.contiguous(), ctx.input_splits, ctx.output_splits, ctx.group)
        return grad_x, None, None, None


def all_to_all(
    x_ND: Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Send rows input_splits[j] of x_ND (in order) to rank j; receive output_splits[j] rows from rank j.

    Differentiable in x_ND (and twice differentiable: the backward is itself an all-to-all). Every rank
    of `group` must call it, with splits that agree pairwise: my input_splits[j] == rank j's
    output_splits[me]. Zero-row splits, and zero rows in total, are fine.

    Returns:
        [sum(output_splits), *x_ND.shape[1:]], rows ordered by source rank.
    """
    world = group_size(group)
    if len(output_splits) != world or len(input_splits) != world:
        raise ValueError(
            f"output_splits and input_splits need one entry per rank ({world}), "
            f"got {len(output_splits)} and {len(input_splits)}"
        )
    if sum(input_splits) != x_ND.shape[0]:
        raise ValueError(f"input_splits must sum to x_ND.shape[0]={x_ND.shape[0]}, got {sum(input_splits)}")
    if min(*output_splits, *input_splits) < 0:
        raise ValueError("split sizes must be >= 0")
    return _AllToAll.apply(x_ND, [int(s) for s in output_splits], [int(s) for s in input_splits], group)


@torch.no_grad()
def exchange_counts(send_counts_RL: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """recv_counts_RL[r, l]: rows rank r sends to my local expert l, given my send_counts_RL[j, l].

    send_counts_RL[j, l] is how many rows I send to local expert l of rank j (rank j owns global experts
    j*L .. j*L+L-1). One all_to_all_single of R*L integers.
    """
    send = send_counts_RL.to(torch.int64).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


@torch.no_grad()
def gather_from_ranks(counts: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """[R, *counts.shape]: every rank's `counts`, in group-rank order (all_gather)."""
    counts = counts.contiguous()
    out = counts.new_empty((group_size(group), *counts.shape))
    dist.all_gather(list(out.unbind(0)), counts, group=group)
    return out
