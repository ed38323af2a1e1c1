"""Discrete distributions and counts as plain dicts: outcome → probability (or → count).

Outcomes are any hashable values; the enumeration and Monte-Carlo helpers use tuples of token ids
(the tokens a speculative step, or a whole generation, emitted).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping

__all__ = ["Distribution", "Counts", "marginalize", "total_variation"]

Distribution = dict[Hashable, float]
"""outcome → probability."""

Counts = Counter
"""outcome → number of samples (a :class:`collections.Counter`)."""


def marginalize(dist: Mapping[Hashable, float], key: Callable[[Hashable], Hashable]) -> dict:
    """Sum probabilities (or counts) over outcomes with the same ``key(outcome)``.

    Works on distributions and on counts alike, so a test maps both through the same key, e.g.
    ``key=lambda s: s[:2] if len(s) >= 2 else "rejected at 0"`` for the joint of the first two
    tokens with every shorter outcome pooled into one cell.
    """
    out: dict = Counter() if isinstance(dist, Counter) else {}
    for outcome, value in dist.items():
        k = key(outcome)
        out[k] = out.get(k, 0) + value
    return out


def total_variation(a: Mapping[Hashable, float], b: Mapping[Hashable, float]) -> float:
    """TV(a, b) = ½ Σ |a(x) − b(x)| over the union of outcomes (counts are normalised first)."""
    sa, sb = float(sum(a.values())), float(sum(b.values()))
    if sa <= 0 or sb <= 0:
        raise ValueError("total_variation needs two non-empty distributions")
    return 0.5 * sum(abs(a.get(x, 0) / sa - b.get(x, 0) / sb) for x in set(a) | set(b))
