"""Closed-form speculative-decoding theory of Leviathan, Kalman & Matias 2023 (arXiv 2211.17192), §3.

Words as in the paper: α is the acceptance rate (expected probability that a draft token is accepted),
γ the number of draft tokens per target call, c the cost of one draft-model run relative to one
target run (walltime), ĉ (``c_hat``) the same ratio in arithmetic operations.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = [
    "expected_tokens",
    "walltime_improvement",
    "operations_factor",
    "optimal_gamma",
    "reproducing_interval",
]


def _check(alpha: float, gamma: int, cost: float, cost_name: str) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma must be an int >= 0, got {gamma!r}")
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not math.isfinite(cost) or cost < 0:
        raise ValueError(f"{cost_name} must be a finite number >= 0, got {cost!r}")


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens produced per target call, (1 − α^(γ+1)) / (1 − α) (eq. 1); γ + 1 at α = 1."""
    _check(alpha, gamma, 0.0, "c")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def walltime_improvement(alpha: float, gamma: int, c: float) -> float:
    """Expected walltime improvement factor, (1 − α^(γ+1)) / ((1 − α)(γc + 1)) (Theorem 3.8)."""
    _check(alpha, gamma, c, "c")
    return expected_tokens(alpha, gamma) / (gamma * c + 1.0)


def operations_factor(alpha: float, gamma: int, c_hat: float) -> float:
    """Expected increase factor of arithmetic operations, (1 − α)(γĉ + γ + 1) / (1 − α^(γ+1)) (Thm 3.11)."""
    _check(alpha, gamma, c_hat, "c_hat")
    return (gamma * c_hat + gamma + 1.0) / expected_tokens(alpha, gamma)


def optimal_gamma(alpha: float, c: float, *, max_gamma: int = 1000) -> int:
    """The integer γ in [0, max_gamma] maximising :func:`walltime_improvement` (0: do not speculate).

    Ties go to the smaller γ. γ = 0 gives improvement 1 (plain decoding), so the answer is 0 exactly
    when no γ ≥ 1 beats plain decoding (Corollary 3.9: some γ does iff α > c).
    """
    _check(alpha, 0, c, "c")
    if isinstance(max_gamma, bool) or not isinstance(max_gamma, int) or max_gamma < 0:
        raise ValueError(f"max_gamma must be an int >= 0, got {max_gamma!r}")
    best_gamma, best = 0, 1.0
    for gamma in range(1, max_gamma + 1):
        value = walltime_improvement(alpha, gamma, c)
        if value > best * (1.0 + 1e-12):
            best_gamma, best = gamma, value
    return best_gamma


def reproducing_interval(
    rows: Sequence[tuple[float, int, float]], *, kind: str, tolerance: float = 0.005
) -> tuple[float, float] | None:
    """The interval of costs that reproduces every published ``(alpha, gamma, value)`` to ``tolerance``.

    ``kind="walltime"`` solves |walltime_improvement(α, γ, c) − value| ≤ tolerance for c ≥ 0;
    ``kind="operations"`` solves the same for ĉ in :func:`operations_factor`. Both are monotone in the
    cost, so each row gives an interval in closed form; the answer is their intersection (None if
    empty). ``tolerance=0.005`` means "equal after rounding to two decimals".
    """
    if kind not in ("walltime", "operations"):
        raise ValueError(f"kind must be 'walltime' or 'operations', got {kind!r}")
    low, high = 0.0, math.inf
    for alpha, gamma, value in rows:
        if gamma < 1:
            raise ValueError(f"rows need gamma >= 1 to constrain the cost, got gamma={gamma}")
        tokens = expected_tokens(alpha, gamma)
        if kind == "walltime":  # tokens / (γc + 1) decreases in c
            row_low = (tokens / (value + tolerance) - 1.0) / gamma
            row_high = (tokens / (value - tolerance) - 1.0) / gamma
        else:  # (γĉ + γ + 1) / tokens increases in ĉ
            row_low = ((value - tolerance) * tokens - gamma - 1.0) / gamma
            row_high = ((value + tolerance) * tokens - gamma - 1.0) / gamma
        low, high = max(low, row_low), min(high, row_high)
    return (low, high) if low <= high else None


def improvement_curve(alpha: float, c: float, gammas: Iterable[int]) -> list[float]:
    """:func:`walltime_improvement` over several γ."""
    return [walltime_improvement(alpha, g, c) for g in gammas]
