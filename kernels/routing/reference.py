"""Plain-PyTorch routing ops: the oracle for the Triton kernels, and the "torch" backend itself.

Legend: T tokens, E experts, K experts per token (top_k), D model dim, M = T*K token slots (fewer when
slots are dropped). A *slot* is the flat index t*K + k of token t's k-th choice; the expert-sorted order
lists slots grouped by expert, ascending slot index within an expert (a stable sort), so every result is
deterministic.

  topk_routing    scores = softmax or sigmoid of the router logits; pick the top-k experts per token by
                  logit (the scores' order), or by score + a selection bias (DeepSeek-V3 aux-loss-free
                  balancing, arXiv:2412.19437); the weights are the unbiased scores, optionally
                  renormalised to sum 1. Ties go to the lower expert index.
  sort_by_expert  counting sort of the slots by expert: sorted_slots_M, group_sizes_E, expert_offsets_E1.
  permute         x_MD[i] = x_TD[sorted_slots_M[i] // K]   (gather rows into expert order)
  unpermute       out_TD[t] = sum_k weights_TK[t, k] * y_MD[row of slot t*K+k]   (dropped slots add 0)
"""

from __future__ import annotations

import torch
from torch import Tensor

SCORING_FUNCTIONS = {
    "softmax": lambda logits_TE: torch.softmax(logits_TE, dim=-1),
    "sigmoid": torch.sigmoid,
}


def topk_routing_reference(
    logits_TE: Tensor, top_k: int, *, scoring: str, renormalize: bool, bias_E: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(weights_TK float32, experts_TK int64); differentiable in logits_TE by plain autograd."""
    scores_TE = SCORING_FUNCTIONS[scoring](logits_TE.float())
    # Without a bias the choice is made on the logits: softmax and sigmoid are strictly increasing, so
    # this is the same top-k, but it does not depend on how the scores were rounded (two
    # implementations of exp can order near-equal scores differently; a saturated sigmoid ties at 1).
    select_TE = logits_TE.float() if bias_E is None else scores_TE + bias_E.float()
    # A stable descending sort keeps the lower expert first among equal values (a zero-initialised router).
    order_TE = torch.sort(select_TE.detach(), dim=-1, descending=True, stable=True).indices
    experts_TK = order_TE[:, :top_k].contiguous()
    weights_TK = scores_TE.gather(1, experts_TK)
    if renormalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK, experts_TK


def topk_routing_backward_reference(
    grad_weights_TK: Tensor, logits_TE: Tensor, experts_TK: Tensor, *, scoring: str, renormalize: bool
) -> Tensor:
    """d loss / d logits_TE in closed form (what the Triton backward kernel computes)."""
    scores_TE = SCORING_FUNCTIONS[scoring](logits_TE.float())
    grad_TK = grad_weights_TK.float()
    if renormalize:
        # w_k = p_k / S with S = sum_k p_k  =>  dp_k = (g_k - sum_m g_m w_m) / S
        picked_TK = scores_TE.gather(1, experts_TK)
        total_T1 = picked_TK.sum(dim=-1, keepdim=True)
        weights_TK = picked_TK / total_T1
        grad_TK = (grad_TK - (grad_TK * weights_TK).sum(dim=-1, keepdim=True)) / total_T1
    grad_scores_TE = torch.zeros_like(scores_TE).scatter_add_(1, experts_TK, grad_TK)
    if scoring == "softmax":
        inner_T1 = (grad_scores_TE * scores_TE).sum(dim=-1, keepdim=True)
        grad_logits_TE = scores_TE * (grad_scores_TE - inner_T1)
    else:  # sigmoid
        grad_logits_TE = grad_scores_TE * scores_TE * (1.0 - scores_TE)
    return grad_logits_TE.to(logits_TE.dtype)


def sort_by_expert_reference(experts_TK: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(sorted_slots_M int64, group_sizes_E int64, expert_offsets_E1 int64) by a stable sort."""
    flat_M = experts_TK.reshape(-1)
    sorted_slots_M = torch.sort(flat_M, stable=True).indices
    group_sizes_E = torch.bincount(flat_M, minlength=num_experts)
    expert_offsets_E1 = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat_M.device)
    torch.cumsum(group_sizes_E, dim=0, out=expert_offsets_E1[1:])
    return sorted_slots_M, group_sizes_E, expert_offsets_E1


def permute_reference(x_TD: Tensor, sorted_slots_M: Tensor, top_k: int) -> Tensor:
    """x_MD[i] = x_TD[sorted_slots_M[i] // top_k]."""
    return x_TD.index_select(0, torch.div(sorted_slots_M, top_k, rounding_mode="floor"))


def unpermute_reference(
    y_MD: Tensor, sorted_slots_M: Tensor, weights_TK: Tensor | None, num_tokens: int, top_k: int
) -> Tensor:
    """out_TD[t] = sum_k weights_TK[t, k] * y_MD[row of slot t*K+k], accumulated in float32.

    weights_TK=None sums the slots unweighted (the backward of permute). Slots absent from
    sorted_slots_M (dropped) contribute nothing.
    """
    y_slots_SD = y_MD.new_zeros(num_tokens * top_k, y_MD.shape[1], dtype=torch.float32)
    y_slots_SD = y_slots_SD.index_copy(0, sorted_slots_M, y_MD.float())
    y_TKD = y_slots_SD.view(num_tokens, top_k, y_MD.shape[1])  # explicit D: T may be 0
    if weights_TK is not None:
        y_TKD = y_TKD * weights_TK.float().unsqueeze(-1)
    return y_TKD.sum(dim=1).to(y_MD.dtype)


def unpermute_backward_reference(
    grad_out_TD: Tensor, y_MD: Tensor, sorted_slots_M: Tensor, weights_TK: Tensor
) -> tuple[Tensor, Tensor]:
    """(grad_y_MD, grad_weights_TK) of unpermute; dropped slots get zero weight gradient."""
    top_k = weights_TK.shape[1]
    g_MD = grad_out_TD.float().index_select(0, torch.div(sorted_slots_M, top_k, rounding_mode="floor"))
    w_M = weights_TK.reshape(-1).float().index_select(0, sorted_slots_M)
    grad_y_MD = (g_MD * w_M.unsqueeze(-1)).to(y_MD.dtype)
    grad_w_S = torch.zeros(weights_TK.numel(), dtype=torch.float32, device=weights_TK.device)
    grad_w_S = grad_w_S.index_copy(0, sorted_slots_M, (g_MD * y_MD.float()).sum(dim=-1))
    return grad_y_MD, grad_w_S.view_as(weights_TK).to(weights_TK.dtype)
