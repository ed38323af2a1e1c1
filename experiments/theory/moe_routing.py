"""Routing statistics of Mixture-of-Experts layers: closed forms and the measurements they predict.

Legend: T tokens, K experts per token (top-k), E experts, B blocks of n consecutive tokens.

- Verifying n draft tokens in one target call touches the union of their experts. With each token
  routed to k of E experts uniformly at random, an expert is missed by all n tokens with probability
  (1 − k/E)ⁿ, so E[distinct experts] = E(1 − (1 − k/E)ⁿ): the weight traffic of a verify call grows
  with n, unlike a dense target (why EAGLE, arXiv 2401.15077, reports a smaller speedup on Mixtral).
- Capacity dropping (GShard arXiv 2006.16668, Switch Transformer arXiv 2101.03961): each expert takes at
  most C (``moe.expert_capacity``: ceil(capacity_factor · T·k / E)) of the T·k assignments of a batch.
  Under uniform random routing the load of one expert is Binomial(T, k/E), so the expected dropped
  fraction is the binomial tail E · E[(L − C)⁺] / (T·k).
- Switch load-balancing loss (arXiv 2101.03961, eq. 4): coefficient · E · Σ_e f_e P_e, with f_e the
  fraction of assignments routed to expert e and P_e the mean router probability of e. Under uniform
  router probabilities P_e = 1/E, so the loss equals the coefficient whatever the dispatch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = [
    "RouteFn",
    "expected_distinct_experts",
    "distinct_experts_per_block",
    "measure_distinct_experts",
    "expected_drop_fraction",
    "drop_fraction",
    "switch_load_balancing_loss",
    "random_topk_routing",
]

RouteFn = Callable[[int, torch.Generator], torch.Tensor]
"""A routing source: ``route(num_tokens, generator) -> expert_ids_TK`` (long, distinct experts per row)."""


def _check_ek(num_experts: int, top_k: int) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")


def expected_distinct_experts(num_experts: int, top_k: int, n: int) -> float:
    """E(1 − (1 − k/E)ⁿ): expected distinct experts touched by n tokens under uniform top-k routing."""
    _check_ek(num_experts, top_k)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** n)


def distinct_experts_per_block(
    expert_ids_TK: torch.Tensor, num_experts: int, block_size: int
) -> torch.Tensor:
    """Distinct experts in each block of ``block_size`` consecutive tokens -> ``[T // block_size]`` long.

    Blocks do not overlap; a trailing partial block is dropped.
    """
    if expert_ids_TK.dim() != 2:
        raise ValueError(f"expert_ids_TK must be [T, K], got shape {tuple(expert_ids_TK.shape)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    T, K = expert_ids_TK.shape
    num_blocks = T // block_size
    if num_blocks == 0:
        raise ValueError(f"need at least block_size={block_size} tokens, got T={T}")
    if expert_ids_TK.numel() and (expert_ids_TK.min() < 0 or expert_ids_TK.max() >= num_experts):
        raise ValueError(f"expert_ids_TK must lie in [0, num_experts={num_experts})")
    ids_BX = expert_ids_TK[: num_blocks * block_size].reshape(num_blocks, block_size * K).long()
    touched_BE = torch.zeros(num_blocks, num_experts, dtype=torch.bool)
    touched_BE.scatter_(1, ids_BX, True)
    return touched_BE.sum(dim=1)


def measure_distinct_experts(
    route: RouteFn, num_experts: int, block_sizes: list[int], *, num_tokens: int, generator: torch.Generator
) -> dict[int, torch.Tensor]:
    """Route ``num_tokens`` tokens with ``route``, then count distinct experts per block for each size.

    Returns ``{n: counts_B}``; compare ``counts_B.mean()`` with :func:`expected_distinct_experts`.
    """
    expert_ids_TK = route(num_tokens, generator)
    if expert_ids_TK.dim() != 2 or expert_ids_TK.shape[0] != num_tokens:
        raise ValueError(
            f"route must return [num_tokens={num_tokens}, K] ids, got {tuple(expert_ids_TK.shape)}"
        )
    return {n: distinct_experts_per_block(expert_ids_TK, num_experts, n) for n in block_sizes}


def expected_drop_fraction(num_tokens: int, num_experts: int, top_k: int, capacity: int) -> float:
    """E·E[(L − C)⁺]/(T·k) with L ~ Binomial(T, k/E): the binomial tail of dropped assignments.

    Exact for uniform random top-k routing (k distinct experts per token), where each expert's load is
    Binomial(T, k/E) and dropping beyond ``capacity`` is per expert.
    """
    from scipy.stats import binom

    _check_ek(num_experts, top_k)
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
    if capacity >= num_tokens:
        return 0.0
    loads = torch.arange(capacity + 1, num_tokens + 1, dtype=torch.float64).numpy()
    pmf = binom.pmf(loads, num_tokens, top_k / num_experts)
    excess = float(((loads - capacity) * pmf).sum())
    return num_experts * excess / (num_tokens * top_k)


def drop_fraction(expert_ids_TK: torch.Tensor, num_experts: int, capacity: int) -> float:
    """Measured fraction of the T·k assignments that exceed their expert's ``capacity``."""
    if expert_ids_TK.dim() != 2:
        raise ValueError(f"expert_ids_TK must be [T, K], got shape {tuple(expert_ids_TK.shape)}")
    counts_E = torch.bincount(expert_ids_TK.reshape(-1).long(), minlength=num_experts)
    dropped = (counts_E - capacity).clamp(min=0).sum().item()
    return dropped / expert_ids_TK.numel()


def switch_load_balancing_loss(
    router_probs_TE: torch.Tensor, expert_ids_TK: torch.Tensor, coefficient: float
) -> torch.Tensor:
    """coefficient · E · Σ_e f_e P_e (Switch Transformer, arXiv 2101.03961 eq. 4; top-k as in GShard).

    f_e = (assignments to e) / (T·k) from the hard dispatch ``expert_ids_TK``; P_e = mean over tokens
    of ``router_probs_TE[:, e]``.
    """
    if router_probs_TE.dim() != 2 or expert_ids_TK.dim() != 2:
        raise ValueError(
            f"router_probs_TE must be [T, E] and expert_ids_TK [T, K], got {tuple(router_probs_TE.shape)} "
            f"and {tuple(expert_ids_TK.shape)}"
        )
    T, E = router_probs_TE.shape
    if expert_ids_TK.shape[0] != T:
        raise ValueError(f"expert_ids_TK has {expert_ids_TK.shape[0]} tokens, router_probs_TE has {T}")
    counts_E = torch.bincount(expert_ids_TK.reshape(-1).long(), minlength=E).to(router_probs_TE.dtype)
    fraction_E = counts_E / expert_ids_TK.numel()
    mean_prob_E = router_probs_TE.mean(dim=0)
    return coefficient * E * (fraction_E * mean_prob_E).sum()


def random_topk_routing(num_experts: int, top_k: int, *, skew: float = 0.0) -> RouteFn:
    """A routing source drawing k distinct experts per token, with P(e) ∝ (e+1)^(−skew).

    ``skew = 0`` is uniform random routing (the assumption of the closed forms); ``skew > 0`` is a
    Zipf-like imbalance, as a load-imbalanced router would produce.
    """
    _check_ek(num_experts, top_k)
    if not isinstance(skew, (int, float)) or not math.isfinite(skew) or skew < 0:
        raise ValueError(f"skew must be a finite number >= 0, got {skew!r}")
    weights_E = torch.arange(1, num_experts + 1, dtype=torch.float64) ** (-float(skew))

    def route(num_tokens: int, generator: torch.Generator) -> torch.Tensor:
        if skew == 0.0:  # k distinct uniform experts: the top-k of i.i.d. uniform scores
            return torch.rand(num_tokens, num_experts, generator=generator).topk(top_k, dim=1).indices
        return torch.multinomial(
            weights_E.expand(num_tokens, -1), top_k, replacement=False, generator=generator
        )

    return route
