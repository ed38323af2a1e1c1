"""Router auxiliary losses for the training loop: Switch/GShard load balancing and the ST-MoE z-loss.

Legend: T tokens, E experts.
"""

from __future__ import annotations

import torch
from torch import Tensor


def load_balancing_loss(probs_TE: Tensor, routed_counts_E: Tensor, coef: float = 1.0) -> Tensor:
    """Switch Transformer load-balancing loss, coef * E * sum_i f_i * P_i (arXiv:2101.03961, eq. 4-6).

    f_i is the fraction of routed slots the router sent to expert i (counted before capacity dropping) and
    P_i the mean router probability of expert i over the T tokens. For top-k routing we count all T*K
    slots, so f sums to 1 and, as for top-1, perfectly uniform routing (f_i = P_i = 1/E) gives exactly
    `coef`; the minimum over balanced routings. (transformers' `load_balancing_loss_func` divides the counts
    by T instead of T*K, so its value is K times this one.) Only P carries gradient.

    Args:
        probs_TE: router probabilities, rows summing to 1 (float32 recommended).
        routed_counts_E: slots routed to each expert (any numeric dtype; no gradient).
        coef: the loss coefficient alpha (Switch uses 1e-2).
    """
    if probs_TE.dim() != 2:
        raise ValueError(f"probs_TE must be [T, E], got shape {tuple(probs_TE.shape)}")
    num_experts = probs_TE.shape[1]
    if routed_counts_E.shape != (num_experts,):
        raise ValueError(
            f"routed_counts_E must have shape [E={num_experts}], got {tuple(routed_counts_E.shape)}"
        )
    counts = routed_counts_E.to(probs_TE.device, torch.float32)
    f_E = counts / counts.sum().clamp(min=1.0)
    p_E = probs_TE.float().mean(dim=0)
    return coef * num_experts * torch.dot(f_E, p_E)


def router_z_loss(logits_TE: Tensor, coef: float = 1.0) -> Tensor:
    """ST-MoE router z-loss, coef * mean_t (logsumexp_i logits_ti)^2 (Zoph et al., arXiv:2202.08906, eq. 5).

    Penalises large router logits, which destabilise training in low precision.
    """
    if logits_TE.dim() != 2:
        raise ValueError(f"logits_TE must be [T, E], got shape {tuple(logits_TE.shape)}")
    return coef * torch.logsumexp(logits_TE.float(), dim=-1).square().mean()
