"""How many samples a goodness-of-fit test needs to catch a bias of a given size.

A biased sampler draws from P₁ instead of P₀, with total-variation distance δ = ½ Σ|P₁ − P₀|.
Over N samples and C cells, the χ² (and G) statistic is asymptotically non-central χ² with
C − 1 degrees of freedom and non-centrality λ = N · χ²(P₁‖P₀), χ²(P₁‖P₀) = Σ (P₁ − P₀)² / P₀
(the local-alternative approximation). By Cauchy–Schwarz,

    2δ = Σ |P₁ − P₀| = Σ (|P₁ − P₀| / √P₀) · √P₀ ≤ √(χ²(P₁‖P₀)),   so   λ ≥ 4 N δ²,

with equality for the worst direction (P₁ − P₀ ∝ ±P₀). Hence a test at false-alarm rate α detects
*every* bias of TV ≥ δ with probability ≥ 1 − β once N ≥ λ*/(4δ²), where λ* solves
P(χ'²_{C−1}(λ*) > χ²_{C−1, 1−α}) = 1 − β.

The bound is on the cells as tested: bias hidden inside pooled small cells (expected count below
``min_expected``) is only seen through the pooled cell.
"""

from __future__ import annotations

import math

__all__ = ["required_sample_size", "detection_power"]


def _check(tv_distance: float, num_cells: int, alpha: float) -> None:
    if not 0.0 < tv_distance <= 1.0:
        raise ValueError(f"tv_distance must lie in (0, 1], got {tv_distance!r}")
    if isinstance(num_cells, bool) or not isinstance(num_cells, int) or num_cells < 2:
        raise ValueError(f"num_cells must be an int >= 2, got {num_cells!r}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")


def detection_power(tv_distance: float, num_samples: int, *, num_cells: int, alpha: float = 1e-6) -> float:
    """Lower bound on P(reject) for any bias of total variation ``tv_distance`` (module doc)."""
    from scipy.stats import chi2, ncx2

    _check(tv_distance, num_cells, alpha)
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples!r}")
    dof = num_cells - 1
    critical = chi2.isf(alpha, dof)
    return float(ncx2.sf(critical, dof, 4.0 * num_samples * tv_distance**2))


def required_sample_size(
    tv_distance: float, *, num_cells: int, alpha: float = 1e-6, beta: float = 1e-6
) -> int:
    """Smallest N at which a test at false-alarm rate ``alpha`` misses a bias of total variation
    ``tv_distance`` with probability at most ``beta`` (module doc)."""
    from scipy.optimize import brentq
    from scipy.stats import chi2, ncx2

    _check(tv_distance, num_cells, alpha)
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must lie in (0, 1), got {beta!r}")
    dof = num_cells - 1
    critical = chi2.isf(alpha, dof)

    def log_miss(lam: float) -> float:  # log P(statistic <= critical) - log beta, decreasing in lam
        return math.log(max(ncx2.cdf(critical, dof, lam), 1e-300)) - math.log(beta)

    hi = max(1.0, critical)
    while log_miss(hi) > 0:
        hi *= 2
    lam = brentq(log_miss, 0.0, hi, xtol=1e-9, rtol=1e-12) if log_miss(0.0) > 0 else 0.0
    return max(1, math.ceil(lam / (4.0 * tv_distance**2)))
