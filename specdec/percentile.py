"""The one percentile every report uses (``specdec bench``'s and the engine's latencies, ``bench-serve``,
``specdec perplexity``'s KL divergence, the engine benchmarks): numpy's default, linear interpolation
between order statistics at ``q / 100 · (n − 1)`` (llama-perplexity's too)."""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["percentile"]


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (``q`` in [0, 100]) of ``values``, as ``numpy.percentile``; None for no
    values. ``ValueError`` naming ``q`` outside [0, 100]."""
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q!r}")
    ordered = sorted(values)
    if not ordered:
        return None
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))
