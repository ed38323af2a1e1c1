"""What a verify block costs on this machine, as a function of rows and tokens per row.

Legend: B rows in the block (requests decoding together), T tokens per row (draft depth K + 1).

:class:`VerifyCostModel` is measured when the engine starts (:func:`measure_verify_cost`: timed
forwards over a small grid of (B, T) on the engine's own cache, before any request holds a slot, then
rolled back), or read where :mod:`specdec.engine.cost_cache` keeps it for this machine, and read by
interpolation afterwards.

:class:`OnlineVerifyCost` learns from the engine's own verify forwards, robust to outliers: per row
count, the median of the recent ratios of a forward's seconds to the grid's prediction scales that row
count's grid. The grid keeps the shape (how the cost grows with T, measured side by side); the steps
give the level the engine actually runs at, beside drafting (whose cost is learned on the same steps,
:mod:`specdec.engine.draft_cost`), where back-to-back forwards at start ran with warmer caches. Both
only choose draft depths: what tokens come out does not depend on them
(:mod:`specdec.engine.depth` says which rows may use them). On an accelerator a forward returns once
its work is queued, so the device is synchronised before each clock is read
(:func:`device_synchronizer`): each point times the work, not its launch.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "VerifyCostModel",
    "OnlineVerifyCost",
    "VerifyCost",
    "measure_verify_cost",
    "device_synchronizer",
    "MIN_CALLS",
    "SETTLE_CALLS",
    "COST_CONTEXT",
]

COST_CONTEXT = 64 + 8
"""Cache slots per row that :func:`measure_verify_cost` fills with its defaults: the 64-token context and
its longest block (8 tokens); an engine that measures the grid needs at least this ``max_model_len``."""

MIN_CALLS, SETTLE_CALLS = 3, 6
"""Forwards per grid point and round: at least MIN_CALLS, at most SETTLE_CALLS (while each is
faster than the ones before)."""


@dataclass(frozen=True)
class VerifyCostModel:
    """Seconds per block on a grid: ``seconds[i][j]`` for ``rows[i]`` rows of ``tokens[j]`` tokens."""

    rows: tuple[int, ...]
    tokens: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if not self.rows or not self.tokens or len(self.seconds) != len(self.rows):
            raise ValueError("a cost model needs a non-empty grid of rows x tokens")
        if any(len(r) != len(self.tokens) for r in self.seconds):
            raise ValueError("seconds must have one entry per (rows, tokens) point")

    @staticmethod
    def _bracket(grid: Sequence[int], x: float) -> tuple[int, int, float]:
        """Indices i, j of the grid points around x and the weight of j (flat outside the grid)."""
        if x <= grid[0]:
            return 0, 0, 0.0
        if x >= grid[-1]:
            return len(grid) - 1, len(grid) - 1, 0.0
        j = bisect.bisect_left(grid, x)
        i = j - 1
        return i, j, (x - grid[i]) / (grid[j] - grid[i])

    def cost(self, rows: int, tokens: int) -> float:
        """Seconds of one forward over ``rows`` rows of ``tokens`` tokens (bilinear; beyond the
        grid's largest block, linear in the tokens past it at the last measured slope)."""
        i0, i1, wi = self._bracket(self.rows, rows)
        s = self.seconds
        per_row = [s[i0][j] * (1 - wi) + s[i1][j] * wi for j in range(len(self.tokens))]
        t = self.tokens
        if tokens > t[-1] and len(t) > 1:
            slope = (per_row[-1] - per_row[-2]) / (t[-1] - t[-2])
            return per_row[-1] + max(slope, 0.0) * (tokens - t[-1])
        j0, j1, wj = self._bracket(t, tokens)
        return per_row[j0] * (1 - wj) + per_row[j1] * wj

    def to_dict(self) -> dict[str, Any]:
        seconds = [list(r) for r in self.seconds]
        return {"rows": list(self.rows), "tokens": list(self.tokens), "seconds": seconds}


class OnlineVerifyCost:
    """The measured grid, scaled per row count by what the engine's verify forwards take (module doc).

    ``observe(B, T, seconds)`` after each verify forward of B rows of T tokens; ``cost(B, T)`` is the
    grid's cost times ``scale(B)``: the median of the last ``window`` ratios observed at B, once there
    are ``min_samples`` of them (else the nearest row count's that has, else 1)."""

    def __init__(self, grid: VerifyCostModel, *, window: int = 64, min_samples: int = 8) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"need window >= min_samples >= 1, got {window=}, {min_samples=}")
        self.grid, self.window, self.min_samples = grid, window, min_samples
        self._ratios: dict[int, deque[float]] = {}
        self._scales: dict[int, float] = {}  # row count -> the median of its ratios, once known

    @property
    def rows(self) -> tuple[int, ...]:
        return self.grid.rows

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.grid.tokens

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """A verify forward of ``rows`` rows of ``tokens`` tokens took ``seconds``."""
        predicted = self.grid.cost(rows, tokens)
        if rows > 0 and tokens > 0 and seconds > 0 and predicted > 0:
            ratios = self._ratios.setdefault(rows, deque(maxlen=self.window))
            ratios.append(seconds / predicted)
            if len(ratios) >= self.min_samples:  # once per forward, not per depth the policy weighs
                self._scales[rows] = statistics.median(ratios)

    def scale(self, rows: int) -> float:
        """How much slower (> 1) or faster than the grid the engine's forwards of ``rows`` rows run."""
        if not self._scales:
            return 1.0
        nearest = min(self._scales, key=lambda B: (abs(B - rows), B))
        return self._scales[nearest]

    def cost(self, rows: int, tokens: int) -> float:
        """Seconds of one forward over ``rows`` rows of ``tokens`` tokens, as the engine runs them."""
        return self.grid.cost(rows, tokens) * self.scale(rows)

    def to_dict(self) -> dict[str, Any]:
        scales = {B: self.scale(B) for B in sorted(self._ratios)}
        return {**self.grid.to_dict(), "scale": scales}


VerifyCost = VerifyCostModel | OnlineVerifyCost
"""What a depth policy reads: ``cost(B, T)``, seconds of a verify forward of B rows of T tokens."""


def device_synchronizer(device: Any) -> Callable[[], None]:
    """A call that waits for ``device``'s queued work: nothing on the CPU (or None); on an accelerator
    ``torch.accelerator.synchronize`` (``torch.<type>.synchronize`` where torch has no
    ``torch.accelerator``)."""
    if device is None or torch.device(device).type in ("cpu", "meta"):
        return lambda: None
    device = torch.device(device)
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        return lambda: accelerator.synchronize(device)
    return lambda: getattr(torch, device.type).synchronize(device)


@torch.inference_mode()
def measure_verify_cost(
    target: Any,
    *,
    max_rows: int,
    tokens: Sequence[int] = (1, 2, 3, 5, 8),
    context: int = 64,
    repeats: int = 2,
) -> VerifyCostModel:
    """Time forwards of every (B, T) on a grid on the target's cache (it must be reset and empty),
    then roll every row back to 0. ``context`` tokens are prefilled first so attention has a
    realistic length; in each of ``repeats`` rounds over the grid a point runs back to back until it
    stops getting faster and keeps its fastest time (its steady cost, as decoding repeats a shape; a
    shared machine only adds time); a point is the median of its rounds' times, and the grid is
    made non-decreasing in rows and in tokens by capping each point with the larger blocks' times.
    On an accelerator (``target.device``) the device is synchronised before each clock is read
    (:func:`device_synchronizer`)."""
    rows = tuple(sorted({r for r in (1, 2, 4, 8, 16, 32) if r < max_rows} | {max_rows}))
    tokens = tuple(sorted(set(tokens)))
    rows_all = torch.arange(max_rows)
    vocab = int(target.vocab_size)
    sync = device_synchronizer(getattr(target, "device", None))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (max_rows, context), generator=gen)
    target.forward(prompt, torch.zeros(max_rows, dtype=torch.long), rows_B=rows_all)
    # Rounds over the whole grid, each point the median of its rounds: a burst of load on a shared
    # machine then spoils one round of a point, not the point.
    rounds: list[list[list[float]]] = [[[] for _ in tokens] for _ in rows]  # each round's steady time
    blocks = {T: torch.randint(0, vocab, (max_rows, T), generator=gen) for T in tokens}
    start = torch.full((max_rows,), context, dtype=torch.long)
    for _ in range(repeats):
        for i, B in enumerate(rows):
            for j, T in enumerate(tokens):
                # Decoding repeats a shape step after step; the first forwards after another shape
                # run slower (on a Xeon with a large L3, one row of one token took 5-6 ms for three
                # forwards after blocks of 8 rows, then 3 ms: the weights back in cache). So a point
                # runs at least MIN_CALLS times, and on while it keeps getting faster (at most
                # SETTLE_CALLS): its steady cost.
                times: list[float] = []
                while len(times) < SETTLE_CALLS:
                    sync()  # the rollback before, and anything else queued, is not this forward's
                    t0 = time.perf_counter()
                    target.forward(blocks[T][:B], start[:B], rows_B=rows_all[:B])
                    sync()  # the forward's work, not only its launch
                    times.append(time.perf_counter() - t0)
                    target.rollback(start[:B], rows_B=rows_all[:B])
                    if len(times) >= MIN_CALLS and times[-1] > 0.95 * min(times[:-1]):
                        break  # no longer getting faster
                rounds[i][j].append(min(times))
    best = [[statistics.median(point) for point in line] for line in rounds]
    # A block with fewer rows or fewer tokens does not cost more: what says otherwise is noise, and
    # noise only adds time, so a point is capped by the larger blocks' times (a burst of load on one
    # small point must not raise the points above it: raising them flattened the grid, and depth
    # choices took deep blocks for nearly free).
    for i in reversed(range(len(rows))):
        for j in reversed(range(len(tokens))):
            cap = min(
                best[i + 1][j] if i + 1 < len(rows) else float("inf"),
                best[i][j + 1] if j + 1 < len(tokens) else float("inf"),
            )
            best[i][j] = min(best[i][j], cap)
    grid = [tuple(line) for line in best]
    target.rollback(torch.zeros(max_rows, dtype=torch.long), rows_B=rows_all)
    return VerifyCostModel(rows, tokens, tuple(grid))
