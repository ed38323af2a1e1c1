"""Triton stable counting sort of token slots by expert: counts, offsets and the permutation.

Legend: T tokens, K experts per token, M = T*K slots, E experts (E_PAD rounded up to a power of two),
B blocks of BLOCK slots each.

Three launches, no host sync, deterministic (the order inside an expert is ascending slot index, the
same as a stable sort, so the torch reference and this kernel agree element for element):
  1. histogram: each block counts its slots per expert               -> counts_BE
  2. scan:      one program turns the counts into each block's first row per expert (exclusive prefix
                over blocks, plus the expert's start row), the group sizes and the expert offsets
  3. scatter:   each block ranks its slots within their expert with a cumulative sum over a one-hot
                [BLOCK, E_PAD] tile and writes sorted_slots[first row + rank] = slot
This is the counting sort that MegaBlocks and vLLM's moe_align_block_size use, without their padding of
each group to a block multiple (our grouped GEMM masks ragged groups instead).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def expert_histogram_kernel(
    # tensors: expert ids [M] (flattened [T, K]); output counts [B, E_PAD] int32
    experts_ptr,
    counts_ptr,
    # sizes
    M,
    E,
    # tile shape
    E_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    block = tl.program_id(0)
    slots = block * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, E_PAD)
    ids = tl.load(experts_ptr + slots, mask=slots < M, other=-1)
    one_hot = (ids[:, None] == cols[None, :]).to(tl.int32)
    tl.store(counts_ptr + block * E_PAD + cols, tl.sum(one_hot, axis=0))


@triton.jit
def expert_scan_kernel(
    # tensors: counts [B, E_PAD] int32 in; block starts [B, E_PAD] int32, group sizes [E], offsets [E+1] out
    counts_ptr,
    block_starts_ptr,
    group_sizes_ptr,
    expert_offsets_ptr,
    # sizes
    num_blocks,
    E,
    # tile shape
    E_PAD: tl.constexpr,
):
    cols = tl.arange(0, E_PAD)
    # ---- totals per expert, then each expert's first row (exclusive prefix over experts)
    totals = tl.zeros((E_PAD,), dtype=tl.int32)
    for b in range(num_blocks):
        totals += tl.load(counts_ptr + b * E_PAD + cols)
    expert_starts = tl.cumsum(totals, axis=0) - totals
    tl.store(group_sizes_ptr + cols, totals.to(tl.int64), mask=cols < E)
    tl.store(expert_offsets_ptr + cols, expert_starts.to(tl.int64), mask=cols < E)
    tl.store(expert_offsets_ptr + E, tl.sum(totals, axis=0).to(tl.int64))
    # ---- each block's first row per expert (exclusive prefix over blocks)
    running = expert_starts
    for b in range(num_blocks):
        tl.store(block_starts_ptr + b * E_PAD + cols, running)
        running += tl.load(counts_ptr + b * E_PAD + cols)


@triton.jit
def expert_scatter_kernel(
    # tensors: expert ids [M]; block starts [B, E_PAD] int32; output sorted slots [M] int64
    experts_ptr,
    block_starts_ptr,
    sorted_slots_ptr,
    # sizes
    M,
    # tile shape
    E_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    block = tl.program_id(0)
    slots = block * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, E_PAD)
    valid = slots < M
    ids = tl.load(experts_ptr + slots, mask=valid, other=-1)
    one_hot = ids[:, None] == cols[None, :]
    # rank of each slot among the earlier slots of the same expert in this block
    running = tl.cumsum(one_hot.to(tl.int32), axis=0)
    rank = tl.sum(tl.where(one_hot, running - 1, 0), axis=1)
    starts = tl.load(block_starts_ptr + block * E_PAD + cols)
    first_row = tl.sum(tl.where(one_hot, starts[None, :], 0), axis=1)
    tl.store(sorted_slots_ptr + first_row + rank, slots.to(tl.int64), mask=valid)


def _block_slots(num_experts: int) -> int:
    """Slots per block: the one-hot tile holds about 16K entries."""
    return max(16, min(1024, 16384 // triton.next_power_of_2(num_experts)))


def sort_by_expert_triton(experts_TK: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the three sort kernels; returns (sorted_slots_M, group_sizes_E, expert_offsets_E1), int64."""
    num_slots = experts_TK.numel()
    device = experts_TK.device
    e_pad = triton.next_power_of_2(num_experts)
    block = _block_slots(num_experts)
    num_blocks = max(1, triton.cdiv(num_slots, block))
    counts_BE = torch.empty(num_blocks, e_pad, dtype=torch.int32, device=device)
    block_starts_BE = torch.empty_like(counts_BE)
    sorted_slots_M = torch.empty(num_slots, dtype=torch.int64, device=device)
    group_sizes_E = torch.empty(num_experts, dtype=torch.int64, device=device)
    expert_offsets_E1 = torch.empty(num_experts + 1, dtype=torch.int64, device=device)

    expert_histogram_kernel[(num_blocks,)](
        experts_TK, counts_BE, num_slots, num_experts, E_PAD=e_pad, BLOCK=block
    )
    expert_scan_kernel[(1,)](
        counts_BE, block_starts_BE, group_sizes_E, expert_offsets_E1, num_blocks, num_experts, E_PAD=e_pad
    )
    expert_scatter_kernel[(num_blocks,)](
        experts_TK, block_starts_BE, sorted_slots_M, num_slots, E_PAD=e_pad, BLOCK=block
    )
    return sorted_slots_M, group_sizes_E, expert_offsets_E1
