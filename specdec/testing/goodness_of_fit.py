"""Goodness-of-fit tests of sample counts against an exact distribution, with a stated error rate.

- **Impossible cells.** An outcome with zero expected probability (or absent from ``expected``)
  that received any sample is proof of a bug, whatever N: the test fails with p = 0.
- **Pooling.** The χ² approximation needs expected counts that are not too small: every cell whose
  expected count N·p is below ``min_expected`` goes into one pooled cell (topped up with the next
  smallest cells until it reaches ``min_expected`` itself).
- **Statistic.** The G-test (log-likelihood ratio, ``method="g"``, default) or Pearson's χ²
  (``method="pearson"``), via :func:`scipy.stats.power_divergence`, with dof = cells − 1. The G
  statistic's far tail stays closer to χ² when some expected counts are small, which matters at the
  tiny false-alarm rates a CI suite needs. Measured (4·10⁶ null replicates, 40 cells, pooled as
  here): at nominal α = 1e-6 the rejection rate was 1.25e-6 (G) vs 2.0e-6 (Pearson) when the
  smallest expected count was ≈ 5, and 0.75e-6 vs 1.0e-6 when it was ≈ 10.
- **False-alarm rate.** The test rejects when p < ``alpha``; under the null hypothesis that happens
  with probability ≈ ``alpha`` (asymptotically). Choose ``alpha`` for a whole suite with Bonferroni:
  ``alpha = suite_rate / number_of_tests``; :func:`specdec.testing.required_sample_size` gives the N
  that also detects a given bias.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Cell", "GoodnessOfFit", "goodness_of_fit", "assert_same_distribution"]

_METHODS = {"g": "log-likelihood", "pearson": "pearson"}
_POOLED = "<pooled>"


@dataclass(frozen=True)
class Cell:
    """One cell of the test: observed and expected counts and the Pearson residual (O − E)/√E."""

    outcome: Hashable
    observed: int
    expected: float

    @property
    def residual(self) -> float:
        if self.expected <= 0:
            return math.inf if self.observed else 0.0
        return (self.observed - self.expected) / math.sqrt(self.expected)


@dataclass(frozen=True)
class GoodnessOfFit:
    """Result of :func:`goodness_of_fit`; ``str()`` gives a readable report."""

    p_value: float
    statistic: float
    dof: int
    alpha: float
    num_samples: int
    method: str
    num_cells: int
    num_pooled: int
    impossible: tuple[Cell, ...]
    worst_cells: tuple[Cell, ...]
    label: str = ""

    @property
    def passed(self) -> bool:
        """True when the counts are consistent with ``expected`` at level ``alpha``."""
        return not self.impossible and self.p_value >= self.alpha

    def __str__(self) -> str:
        name = {"g": "G-test", "pearson": "Pearson chi-square"}[self.method]
        verdict = "PASS" if self.passed else "FAIL"
        head = f"[{self.label}] " if self.label else ""
        lines = [
            f"{head}{verdict}: {name} p = {self.p_value:.4g} (reject if < alpha = {self.alpha:.3g}); "
            f"statistic {self.statistic:.4g}, dof {self.dof}, N = {self.num_samples}, "
            f"{self.num_cells} cells ({self.num_pooled} pooled)"
        ]
        if self.impossible:
            lines.append(f"  {sum(c.observed for c in self.impossible)} samples in zero-probability cells:")
            lines += [f"    {c.outcome!r}: observed {c.observed}" for c in self.impossible[:8]]
        if self.worst_cells:
            lines.append("  worst cells (observed / expected, residual (O-E)/sqrt(E)):")
            lines += [
                f"    {c.outcome!r}: {c.observed} / {c.expected:.1f}, {c.residual:+.2f}"
                for c in self.worst_cells
            ]
        return "\n".join(lines)


def _as_mapping(x: Mapping[Hashable, float] | Sequence[float], name: str) -> dict[Hashable, float]:
    if isinstance(x, Mapping):
        return dict(x)
    try:
        values = [float(v) for v in x]  # arrays, lists, tensors: outcome = index
    except TypeError as exc:
        raise ValueError(
            f"{name} must be a mapping outcome -> value or a 1-D sequence, got {type(x)}"
        ) from exc
    return dict(enumerate(values))


def goodness_of_fit(
    counts: Mapping[Hashable, int] | Sequence[int],
    expected: Mapping[Hashable, float] | Sequence[float],
    *,
    alpha: float = 1e-6,
    method: str = "g",
    min_expected: float = 5.0,
    num_worst: int = 5,
    label: str = "",
) -> GoodnessOfFit:
    """Test whether ``counts`` were drawn from ``expected`` (probabilities); see the module doc.

    Args:
        counts: outcome → number of samples (a ``Counter``), or a 1-D sequence indexed by outcome.
        expected: outcome → probability (summing to 1 within 1e-6), or a 1-D sequence.
        alpha: false-alarm rate: the probability of rejecting when ``counts`` do follow ``expected``.
        method: ``"g"`` (G-test) or ``"pearson"``.
        min_expected: cells with a smaller expected count are pooled.
    """
    from scipy.stats import power_divergence

    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")
    if method not in _METHODS:
        raise ValueError(f"method must be one of {sorted(_METHODS)}, got {method!r}")
    if min_expected <= 0:
        raise ValueError(f"min_expected must be > 0, got {min_expected!r}")
    obs = _as_mapping(counts, "counts")
    probs = _as_mapping(expected, "expected")
    if any(v < 0 or v != int(v) for v in obs.values()):
        raise ValueError("counts must be non-negative integers")
    if any(not p >= 0 for p in probs.values()):
        raise ValueError("expected probabilities must be non-negative (and not NaN)")
    total_p = sum(probs.values())
    if abs(total_p - 1.0) > 1e-6:
        raise ValueError(f"expected probabilities must sum to 1, got {total_p:.9g}")
    N = int(sum(obs.values()))
    if N == 0:
        raise ValueError("counts hold no samples: a test on zero samples cannot fail, so it is refused")

    impossible = tuple(
        sorted(
            (Cell(x, int(n), 0.0) for x, n in obs.items() if n > 0 and probs.get(x, 0.0) <= 0.0),
            key=lambda c: -c.observed,
        )
    )
    cells = sorted(
        (Cell(x, int(obs.get(x, 0)), N * p / total_p) for x, p in probs.items() if p > 0.0),
        key=lambda c: c.expected,
    )
    # Pool the small cells, topping the pool up with the next smallest until it is large enough.
    n_small = sum(c.expected < min_expected for c in cells)
    pool, rest = cells[:n_small], cells[n_small:]
    while pool and sum(c.expected for c in pool) < min_expected and rest:
        pool.append(rest.pop(0))
    tested = list(rest)
    if pool:
        tested.append(Cell(_POOLED, sum(c.observed for c in pool), sum(c.expected for c in pool)))

    if impossible:
        p_value, statistic = 0.0, math.inf
    elif len(tested) < 2:
        p_value, statistic = 1.0, 0.0  # a single cell holds every sample: nothing to test
    else:
        result = power_divergence(
            [c.observed for c in tested], [c.expected for c in tested], lambda_=_METHODS[method]
        )
        p_value, statistic = float(result.pvalue), float(result.statistic)
    worst = tuple(sorted(tested, key=lambda c: -abs(c.residual))[:num_worst])
    return GoodnessOfFit(
        p_value=p_value,
        statistic=statistic,
        dof=max(len(tested) - 1, 0),
        alpha=alpha,
        num_samples=N,
        method=method,
        num_cells=len(cells),
        num_pooled=len(pool),
        impossible=impossible,
        worst_cells=worst,
        label=label,
    )


def assert_same_distribution(
    counts: Mapping[Hashable, int] | Sequence[int],
    expected: Mapping[Hashable, float] | Sequence[float],
    alpha: float = 1e-6,
    *,
    method: str = "g",
    min_expected: float = 5.0,
    label: str = "",
) -> GoodnessOfFit:
    """Raise ``AssertionError`` (with the report: p-value, worst cells) unless ``counts`` fit
    ``expected`` at false-alarm rate ``alpha``; return the :class:`GoodnessOfFit` otherwise."""
    result = goodness_of_fit(
        counts, expected, alpha=alpha, method=method, min_expected=min_expected, label=label
    )
    if not result.passed:
        raise AssertionError(str(result))
    return result
