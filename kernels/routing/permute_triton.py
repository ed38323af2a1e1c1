"""Triton permute (gather into expert order) and unpermute (weighted combine back to tokens), with backward.

Legend: T tokens, K experts per token (TOP_K), D model dim, M expert-ordered rows (<= T*K; dropped slots
are simply absent), BM/BT/BD tile sizes. A slot is t*K + k; sorted_slots[i] is the slot of row i.

  permute            x_MD[i] = x_TD[sorted_slots[i] // K]
  unpermute          out_TD[t] = sum_k w[t, k] * y_MD[slot_rows[t*K + k]]   (float32 accumulation)
  unpermute backward grad_y_MD[i] = w[s] * g_TD[s // K],  grad_w[s] = <g_TD[s // K], y_MD[i]>
                     (s = sorted_slots[i])

unpermute gathers per token through slot_rows (the inverse of sorted_slots, -1 for dropped slots, built
by a small scatter kernel) instead of scatter-adding rows into tokens with atomics: the K products are
summed in a fixed order, so the result is deterministic and matches the reference bit for bit in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def permute_kernel(
    # tensors: x [T, D]; sorted slots [M]; output x_MD [M, D]
    x_ptr,
    sorted_slots_ptr,
    out_ptr,
    # sizes and strides
    M,
    D,
    top_k,
    stride_x,
    stride_out,
    # tile shape
    BM: tl.constexpr,
    BD: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols[None, :] < D)
    tokens = tl.load(sorted_slots_ptr + rows, mask=row_mask, other=0) // top_k
    values = tl.load(x_ptr + tokens[:, None] * stride_x + cols[None, :], mask=mask)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], values, mask=mask)


@triton.jit
def invert_slots_kernel(
    # tensors: sorted slots [M]; output slot_rows [T*K] (pre-filled with -1)
    sorted_slots_ptr,
    slot_rows_ptr,
    # sizes
    M,
    # tile shape
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < M
    slots = tl.load(sorted_slots_ptr + rows, mask=mask, other=0)
    tl.store(slot_rows_ptr + slots, rows.to(tl.int64), mask=mask)


@triton.jit
def unpermute_kernel(
    # tensors: y [M, D]; slot_rows [T*K]; weights [T, K] (unused unless HAS_WEIGHTS); output [T, D]
    y_ptr,
    slot_rows_ptr,
    weights_ptr,
    out_ptr,
    # sizes and strides
    T,
    D,
    stride_y,
    stride_out,
    # compile-time switches
    TOP_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    # tile shape
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    token_mask = tokens < T
    col_mask = cols < D
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # fixed summation order: deterministic
        rows = tl.load(slot_rows_ptr + tokens * TOP_K + k, mask=token_mask, other=-1)
        kept = rows >= 0
        values = tl.load(
            y_ptr + rows[:, None] * stride_y + cols[None, :],
            mask=kept[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_WEIGHTS:
            weight = tl.load(weights_ptr + tokens * TOP_K + k, mask=token_mask, other=0.0).to(tl.float32)
            values = values * weight[:, None]
        acc += values
    out_ptrs = out_ptr + tokens.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=token_mask[:, None] & col_mask[None, :])


@triton.jit
def unpermute_backward_kernel(
    # tensors: grad of out [T, D]; y [M, D]; sorted slots [M]; weights [T, K];
    # outputs grad_y [M, D] and grad_weights [T, K] (pre-filled with zeros for dropped slots)
    grad_out_ptr,
    y_ptr,
    sorted_slots_ptr,
    weights_ptr,
    grad_y_ptr,
    grad_weights_ptr,
    # sizes and strides
    M,
    D,
    top_k,
    stride_g,
    stride_y,
    stride_gy,
    # tile shape: BM rows, D swept in BD-wide chunks
    BM: tl.constexpr,
    BD: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_mask = rows < M
    slots = tl.load(sorted_slots_ptr + rows, mask=row_mask, other=0)
    tokens = slots // top_k
    weight = tl.load(weights_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
    rows64 = rows.to(tl.int64)
    dot = tl.zeros((BM,), dtype=tl.float32)
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        mask = row_mask[:, None] & (cols[None, :] < D)
        grad = tl.load(grad_out_ptr + tokens[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
        grad = grad.to(tl.float32)
        y = tl.load(y_ptr + rows64[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        grad_y = grad * weight[:, None]
        tl.store(
            grad_y_ptr + rows64[:, None] * stride_gy + cols[None, :],
            grad_y.to(grad_y_ptr.dtype.element_ty),
            mask=mask,
        )
        dot += tl.sum(grad * y, axis=1)
    tl.store(grad_weights_ptr + slots, dot.to(grad_weights_ptr.dtype.element_ty), mask=row_mask)


def _tile_d(dim: int) -> int:
    return min(128, triton.next_power_of_2(max(dim, 1)))


def permute_triton(x_TD: Tensor, sorted_slots_M: Tensor, top_k: int) -> Tensor:
    """Launch the gather: x_MD[i] = x_TD[sorted_slots_M[i] // top_k]."""
    num_rows, dim = sorted_slots_M.shape[0], x_TD.shape[1]
    x_MD = x_TD.new_empty(num_rows, dim)
    if num_rows == 0 or dim == 0:
        return x_MD
    bm, bd = 16, _tile_d(dim)
    permute_kernel[(triton.cdiv(num_rows, bm), triton.cdiv(dim, bd))](
        x_TD, sorted_slots_M, x_MD, num_rows, dim, top_k, x_TD.stride(0), x_MD.stride(0), BM=bm, BD=bd
    )
    return x_MD


def unpermute_triton(
    y_MD: Tensor, sorted_slots_M: Tensor, weights_TK: Tensor | None, num_tokens: int, top_k: int
) -> Tensor:
    """Launch inverse + combine: out_TD[t] = sum_k w[t, k] * y_MD[row of slot t*K+k]."""
    num_rows, dim = y_MD.shape
    out_TD = y_MD.new_empty(num_tokens, dim)
    if num_tokens == 0 or dim == 0:
        return out_TD
    slot_rows = torch.full((num_tokens * top_k,), -1, dtype=torch.int64, device=y_MD.device)
    if num_rows:
        block = 256
        invert_slots_kernel[(triton.cdiv(num_rows, block),)](sorted_slots_M, slot_rows, num_rows, BLOCK=block)
    bt, bd = 16, _tile_d(dim)
    unpermute_kernel[(triton.cdiv(num_tokens, bt), triton.cdiv(dim, bd))](
        y_MD,
        slot_rows,
        weights_TK,
        out_TD,
        num_tokens,
        dim,
        y_MD.stride(0),
        out_TD.stride(0),
        TOP_K=top_k,
        HAS_WEIGHTS=weights_TK is not None,
        BT=bt,
        BD=bd,
    )
    return out_TD


def unpermute_backward_triton(
    grad_out_TD: Tensor, y_MD: Tensor, sorted_slots_M: Tensor, weights_TK: Tensor
) -> tuple[Tensor, Tensor]:
    """Launch the backward: (grad_y_MD, grad_weights_TK); dropped slots get zero weight gradient."""
    num_rows, dim = y_MD.shape
    grad_y_MD = torch.empty_like(y_MD)
    grad_weights_TK = torch.zeros_like(weights_TK)
    if num_rows == 0:
        return grad_y_MD, grad_weights_TK
    bm, bd = 16, _tile_d(dim)
    unpermute_backward_kernel[(triton.cdiv(num_rows, bm),)](
        grad_out_TD,
        y_MD,
        sorted_slots_M,
        weights_TK,
        grad_y_MD,
        grad_weights_TK,
        num_rows,
        dim,
        weights_TK.shape[1],
        grad_out_TD.stride(0),
        y_MD.stride(0),
        grad_y_MD.stride(0),
        BM=bm,
        BD=bd,
    )
    return grad_y_MD, grad_weights_TK
