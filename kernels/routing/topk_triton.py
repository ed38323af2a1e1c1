"""Triton fused top-k routing: scores, top-k selection and routing weights in one pass (and its backward).

Legend: T tokens, E experts, K experts per token (TOP_K); BT tokens per program; E_PAD/K_PAD are E/K
rounded up to powers of two. See reference.py for the definition (softmax or sigmoid scores, optional
selection bias, optional renormalisation, ties to the lower expert index).

One program holds BT rows of logits in registers, so the whole routing step reads the logits once and
writes [T, K] weights and ids, instead of the softmax -> topk -> gather -> divide chain of separate
kernels. The top-k is K rounds of row-wise argmax (tl.argmax breaks ties towards the lower index) with
the winner masked out after each round: K is small (1-8), so this beats a sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

SCORING_IDS = {"softmax": 0, "sigmoid": 1}  # compile-time switch of the kernels below


@triton.jit
def _scores(logits_ptr, rows, cols, T, E, stride_lt, SCORING: tl.constexpr):
    """[BT, E_PAD] float32 scores of the given rows; padded columns score 0."""
    valid = (rows[:, None] < T) & (cols[None, :] < E)
    logits = tl.load(logits_ptr + rows[:, None] * stride_lt + cols[None, :], mask=valid, other=0.0)
    logits = tl.where(cols[None, :] < E, logits.to(tl.float32), float("-inf"))
    if SCORING == 0:  # softmax over the experts
        shifted = logits - tl.max(logits, axis=1)[:, None]
        numerator = tl.exp(shifted)
        scores = numerator / tl.sum(numerator, axis=1)[:, None]
    else:  # sigmoid: exp(-inf) = inf gives exactly 0 for the padded columns
        scores = 1.0 / (1.0 + tl.exp(-logits))
    return scores


@triton.jit
def topk_routing_kernel(
    # tensors: logits [T, E]; bias [E] (unused unless HAS_BIAS); outputs weights [T, K] fp32, experts [T, K]
    logits_ptr,
    bias_ptr,
    weights_ptr,
    experts_ptr,
    # sizes and strides
    T,
    E,
    stride_lt,
    # compile-time switches
    SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    BT: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.arange(0, E_PAD)
    k_cols = tl.arange(0, K_PAD)
    scores = _scores(logits_ptr, rows, cols, T, E, stride_lt, SCORING)

    # ---- selection score: the bias steers the choice only (DeepSeek-V3 aux-loss-free balancing);
    # without one, the logits (same order as the scores, independent of how exp rounds; see reference.py)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)
        select = scores + bias[None, :]
    else:
        valid = (rows[:, None] < T) & (cols[None, :] < E)
        select = tl.load(logits_ptr + rows[:, None] * stride_lt + cols[None, :], mask=valid, other=0.0)
        select = select.to(tl.float32)
    select = tl.where(cols[None, :] < E, select, float("-inf"))

    # ---- K rounds of argmax, each winner masked out for the next round
    weights = tl.zeros((BT, K_PAD), dtype=tl.float32)
    experts = tl.zeros((BT, K_PAD), dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        winner = tl.argmax(select, axis=1)
        hit = cols[None, :] == winner[:, None]
        weight = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        weights = tl.where(k_cols[None, :] == k, weight[:, None], weights)
        experts = tl.where(k_cols[None, :] == k, winner[:, None].to(tl.int64), experts)
        select = tl.where(hit, float("-inf"), select)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]

    out_offsets = rows[:, None] * TOP_K + k_cols[None, :]
    out_mask = (rows[:, None] < T) & (k_cols[None, :] < TOP_K)
    tl.store(weights_ptr + out_offsets, weights, mask=out_mask)
    tl.store(experts_ptr + out_offsets, experts, mask=out_mask)


@triton.jit
def topk_routing_backward_kernel(
    # tensors: grad of weights [T, K]; logits [T, E]; experts [T, K]; output grad of logits [T, E]
    grad_weights_ptr,
    logits_ptr,
    experts_ptr,
    grad_logits_ptr,
    # sizes and strides
    T,
    E,
    stride_lt,
    # compile-time switches
    SCORING: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TOP_K: tl.constexpr,
    E_PAD: tl.constexpr,
    BT: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.arange(0, E_PAD)
    row_mask = rows < T
    scores = _scores(logits_ptr, rows, cols, T, E, stride_lt, SCORING)

    # ---- renormalised weights w_k = p_k / S: dp_k = (g_k - sum_m g_m w_m) / S
    total = tl.zeros((BT,), dtype=tl.float32)
    grad_dot_scores = tl.zeros((BT,), dtype=tl.float32)
    if RENORMALIZE:
        for k in tl.static_range(TOP_K):
            expert = tl.load(experts_ptr + rows * TOP_K + k, mask=row_mask, other=0)
            grad = tl.load(grad_weights_ptr + rows * TOP_K + k, mask=row_mask, other=0.0).to(tl.float32)
            picked = tl.sum(tl.where(cols[None, :] == expert[:, None], scores, 0.0), axis=1)
            total += picked
            grad_dot_scores += grad * picked
        total = tl.where(row_mask, total, 1.0)

    # ---- scatter d loss / d score onto the chosen experts
    grad_scores = tl.zeros((BT, E_PAD), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        expert = tl.load(experts_ptr + rows * TOP_K + k, mask=row_mask, other=0)
        grad = tl.load(grad_weights_ptr + rows * TOP_K + k, mask=row_mask, other=0.0).to(tl.float32)
        if RENORMALIZE:
            grad = (grad - grad_dot_scores / total) / total
        grad_scores += tl.where(cols[None, :] == expert[:, None], grad[:, None], 0.0)

    # ---- through the scoring function
    if SCORING == 0:  # softmax: dl = p * (dp - <p, dp>)
        inner = tl.sum(grad_scores * scores, axis=1)
        grad_logits = scores * (grad_scores - inner[:, None])
    else:  # sigmoid: dl = dp * p * (1 - p)
        grad_logits = grad_scores * scores * (1.0 - scores)

    out_mask = row_mask[:, None] & (cols[None, :] < E)
    out_ptrs = grad_logits_ptr + rows[:, None] * E + cols[None, :]
    tl.store(out_ptrs, grad_logits.to(grad_logits_ptr.dtype.element_ty), mask=out_mask)


def _block_rows(num_experts: int) -> int:
    """Rows per program: keep about 4K scores in registers per program."""
    return max(1, min(64, 4096 // triton.next_power_of_2(num_experts)))


def topk_routing_triton(
    logits_TE: Tensor, top_k: int, *, scoring: str, renormalize: bool, bias_E: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Launch the fused top-k routing kernel; returns (weights_TK float32, experts_TK int64)."""
    num_tokens, num_experts = logits_TE.shape
    weights_TK = logits_TE.new_empty(num_tokens, top_k, dtype=torch.float32)
    experts_TK = logits_TE.new_empty(num_tokens, top_k, dtype=torch.int64)
    if num_tokens == 0:
        return weights_TK, experts_TK
    block_rows = _block_rows(num_experts)
    topk_routing_kernel[(triton.cdiv(num_tokens, block_rows),)](
        logits_TE,
        bias_E,
        weights_TK,
        experts_TK,
        num_tokens,
        num_experts,
        logits_TE.stride(0),
        SCORING=SCORING_IDS[scoring],
        HAS_BIAS=bias_E is not None,
        RENORMALIZE=renormalize,
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        E_PAD=triton.next_power_of_2(num_experts),
        BT=block_rows,
    )
    return weights_TK, experts_TK


def topk_routing_backward_triton(
    grad_weights_TK: Tensor, logits_TE: Tensor, experts_TK: Tensor, *, scoring: str, renormalize: bool
) -> Tensor:
    """Launch the backward kernel: d loss / d logits_TE, in the logits' dtype."""
    num_tokens, num_experts = logits_TE.shape
    grad_logits_TE = logits_TE.new_empty(num_tokens, num_experts)
    if num_tokens == 0:
        return grad_logits_TE
    block_rows = _block_rows(num_experts)
    topk_routing_backward_kernel[(triton.cdiv(num_tokens, block_rows),)](
        grad_weights_TK,
        logits_TE,
        experts_TK,
        grad_logits_TE,
        num_tokens,
        num_experts,
        logits_TE.stride(0),
        SCORING=SCORING_IDS[scoring],
        RENORMALIZE=renormalize,
        TOP_K=experts_TK.shape[1],
        E_PAD=triton.next_power_of_2(num_experts),
        BT=block_rows,
    )
    return grad_logits_TE
