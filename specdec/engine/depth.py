"""How deep each request drafts in a step: one controller, policies by name.

Legend: B rows decoding in the step, K draft depth of a row (0 = a plain decode step), T = K + 1
tokens per row in the verify block, a_k the chance that draft position k is accepted given that
every earlier one was.

A row drafting K tokens yields on average ``E(K) = 1 + a_1 + a_1 a_2 + … + a_1…a_K`` tokens
(Leviathan et al. 2023, arXiv 2211.17192, §3.4, with per-position acceptance). The step's block is
padded to the deepest row, so it costs ``c(B, K_max + 1) + d(G, K_max)`` with ``c`` the verify cost
(:mod:`specdec.engine.cost_model`: the grid measured at start, scaled by the engine's own forwards)
and ``d`` the drafting cost of G drafting rows (:class:`~specdec.engine.draft_cost.DraftCost`,
learned per G: one slot drafter drafts all rows with one head forward per position, so ``d`` grows
far less than G-fold; a policy given a float ``t_draft`` charges ``t_draft · Σ K + Σ_{K_r > 0} o_r``,
``o_r`` a row's ``RowView.overhead``).
Policies (:data:`DEPTH_POLICIES`):

- ``fixed``: every row drafts γ (``gamma=G``).
- ``batch-table``: γ from a table by batch size, as vLLM's ``num_speculative_tokens_per_batch_size``
  (``table={1: 5, 4: 3, 8: 1}``: the entry of the largest size ≤ B).
- ``goodput``: SmartSpec's rule (arXiv 2406.14066): the K that maximises the step's expected tokens
  per second, ``Σ_r E_r(min(K, cap_r)) / (c(B, K+1) + d(G, K))``, over K = 0..γ;
  K = 0 wins where speculation does not pay, at any load. **Where the model is unsure** (depths whose
  predicted rates lie within ``margin``, 4 %, of the best: closer than the timings' noise between
  runs), the choice is reproducible, not the noise's: the previous step's K stays while it is among
  them (hysteresis), else the deepest of them where the best drafts at all (the most tokens per target
  call for the same predicted rate), K = 0 where drafting does not pay.
- ``auto`` (the default): ``goodput``.

A row that the policy kept at K = 0 for ``PROBE_EVERY`` (16) steps drafts one token (a probe, in
:mod:`specdec.engine.scheduler`; rows free to follow timings only), so its acceptance estimate follows
the text; the free rows idle for at least 8 steps probe in the same step, since a probe pads the
whole forward to two tokens, and only where a 2-token block of the step's rows costs at most 1.25×
a 1-token one (``PROBE_COST_RATIO``).

**What may depend on timings.** A greedy row's output is the target's argmax chain whatever its
depth, and a ``gumbel`` row's output is plain keyed decoding's whatever its depth (arXiv
2408.07978), so those rows follow the policy. A row sampled under ``exact`` rejection sampling
emits tokens that depend on its proposals, so its depth must not depend on load or timings: under
every policy but ``fixed`` it drafts by the request-local rule ``argmax_K E(K) / (1 + λ K)``, from its
own acceptance only, with a fixed cost per draft token λ (``local_cost``, default 0.35 of a step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specdec.engine.cost_model import VerifyCost
from specdec.engine.draft_cost import DraftCost, PerTokenDraftCost
from specdec.registry import Registry

__all__ = ["DepthPolicy", "DEPTH_POLICIES", "make_depth_policy", "expected_tokens", "RowView"]


@dataclass(frozen=True)
class RowView:
    """What a policy sees of a row: its acceptance estimates a_1..a_cap, its cap (γ, what is left to
    generate, the drafter's limit), whether its depth may follow timings (``free``), and
    ``overhead``: the seconds its drafter spends on a step where it drafts at all, besides
    ``t_draft`` per token (an EAGLE head's catch-up of the tokens committed since its last draft,
    as measured on steps that follow a drafting step)."""

    acceptance: Sequence[float]
    cap: int
    free: bool
    overhead: float = 0.0


def as_draft_cost(t_draft: DraftCost | float) -> DraftCost:
    """A policy's ``t_draft`` argument as a :class:`DraftCost`: the engine's learned one, or a float
    (seconds per drafted token and row, every row drafting on its own)."""
    return t_draft if isinstance(t_draft, DraftCost) else PerTokenDraftCost(t_draft)


def expected_tokens(acceptance: Sequence[float], K: int) -> float:
    """``E(K) = 1 + Σ_{k ≤ K} Π_{j ≤ k} a_j``: tokens a row yields drafting K."""
    total, run = 1.0, 1.0
    for a in acceptance[:K]:
        run *= a
        total += run
    return total


def local_depth(row: RowView, local_cost: float) -> int:
    """The request-local rule: ``argmax_K E(K) / (1 + λ K)`` (depends on the row alone)."""
    best, best_k = 1.0, 0
    for K in range(1, row.cap + 1):
        value = expected_tokens(row.acceptance, K) / (1.0 + local_cost * K)
        if value > best + 1e-12:
            best, best_k = value, K
    return best_k


class DepthPolicy:
    """Base: a policy gives every row of a step its draft depth."""

    gamma: int
    local_cost: float = 0.35

    def depths(
        self, rows: Sequence[RowView], cost: VerifyCost | None, t_draft: DraftCost | float
    ) -> list[int]:
        raise NotImplementedError

    def _pinned(self, rows: Sequence[RowView]) -> list[int | None]:
        """Depths of rows that may not follow the policy (sampled ``exact`` rows), None for the others."""
        return [None if r.free else min(local_depth(r, self.local_cost), r.cap) for r in rows]


def _check_gamma(gamma: Any) -> int:
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma must be an int >= 0, got {gamma!r}")
    return gamma


class FixedDepth(DepthPolicy):
    """Every row drafts γ (capped by what it may still emit). Load-independent for every row."""

    def __init__(self, gamma: int = 4) -> None:
        self.gamma = _check_gamma(gamma)

    def depths(
        self, rows: Sequence[RowView], cost: VerifyCost | None, t_draft: DraftCost | float
    ) -> list[int]:
        return [min(self.gamma, r.cap) for r in rows]


class BatchTableDepth(DepthPolicy):
    """γ by batch size (vLLM's ``num_speculative_tokens_per_batch_size``)."""

    def __init__(self, table: Mapping[int, int] | None = None, gamma: int | None = None) -> None:
        table = dict(table or {1: 6, 2: 4, 4: 2, 8: 1})
        if not table or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in table):
            raise ValueError(f"table must map batch sizes (ints >= 1) to depths, got {table!r}")
        self.table = {k: _check_gamma(v) for k, v in sorted(table.items())}
        self.gamma = max(self.table.values()) if gamma is None else _check_gamma(gamma)

    def depth_for(self, batch_size: int) -> int:
        sizes = [k for k in self.table if k <= batch_size]
        return self.table[max(sizes)] if sizes else self.table[min(self.table)]

    def depths(
        self, rows: Sequence[RowView], cost: VerifyCost | None, t_draft: DraftCost | float
    ) -> list[int]:
        K = min(self.depth_for(len(rows)), self.gamma)
        pinned = self._pinned(rows)
        return [min(K, r.cap) if p is None else p for r, p in zip(rows, pinned, strict=True)]


class GoodputDepth(DepthPolicy):
    """SmartSpec's goodput argmax over the step's common depth (module doc)."""

    def __init__(self, gamma: int = 6, local_cost: float = 0.35, margin: float = 0.04) -> None:
        self.gamma = _check_gamma(gamma)
        if not 0 < local_cost:
            raise ValueError(f"local_cost must be > 0, got {local_cost!r}")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"margin must be a number in [0, 1), got {margin!r}")
        self.local_cost, self.margin = float(local_cost), float(margin)
        self.previous: int | None = None  # the last step's K (hysteresis)

    def depths(
        self, rows: Sequence[RowView], cost: VerifyCost | None, t_draft: DraftCost | float
    ) -> list[int]:
        pinned = self._pinned(rows)
        if cost is None:  # nothing measured: every row by the local rule
            return [min(local_depth(r, self.local_cost), r.cap) for r in rows]
        B = len(rows)
        free = [r for r, p in zip(rows, pinned, strict=True) if p is None]
        draft = as_draft_cost(t_draft)
        fixed_tokens = sum(
            expected_tokens(r.acceptance, p) for r, p in zip(rows, pinned, strict=True) if p is not None
        )
        fixed = [p for p in pinned if p is not None]
        fixed_overhead = sum(r.overhead for r, p in zip(rows, pinned, strict=True) if p)
        rates = []
        for K in range(self.gamma + 1):
            ks = [min(K, r.cap) for r in free]
            gains = [expected_tokens(r.acceptance, k) for r, k in zip(free, ks, strict=True)]
            tokens = fixed_tokens + sum(gains)
            depth = max([*fixed, *ks])
            overhead = fixed_overhead + sum(r.overhead for r, k in zip(free, ks, strict=True) if k)
            seconds = cost.cost(B, depth + 1) + draft.step_seconds([*fixed, *ks]) + overhead
            rates.append(tokens / seconds)
        best_k = self._choose(rates) if free else 0
        return [min(best_k, r.cap) if p is None else p for r, p in zip(rows, pinned, strict=True)]

    def _choose(self, rates: Sequence[float]) -> int:
        """The K of the predicted ``rates`` (one per K = 0..γ): the best, or where the model is unsure
        (within ``margin`` of the best) the previous K, else the deepest (module doc)."""
        best = max(range(len(rates)), key=lambda K: (rates[K], -K))  # the first of equal rates
        near = [K for K, rate in enumerate(rates) if rate >= rates[best] * (1 - self.margin)]
        if self.previous in near:
            K = self.previous
        elif best == 0:
            K = 0
        else:
            K = max(k for k in near if k > 0)
        self.previous = K
        return K


DEPTH_POLICIES = Registry(
    "depth policy",
    "specdec.depth_policies",
    builtins={
        "fixed": "specdec.engine.depth:FixedDepth",
        "batch-table": "specdec.engine.depth:BatchTableDepth",
        "goodput": "specdec.engine.depth:GoodputDepth",
        "auto": "specdec.engine.depth:GoodputDepth",
    },
)
"""Depth policies by name; third-party ones register here or through the ``specdec.depth_policies``
entry-point group. A factory is called with the policy's options (``gamma``, ``table``, ...)."""


def make_depth_policy(
    gamma: int | str | DepthPolicy, options: Mapping[str, Any] | None = None
) -> DepthPolicy:
    """``gamma``: an int (``fixed`` at that depth), a policy name in :data:`DEPTH_POLICIES` (built
    with ``options``), or a :class:`DepthPolicy`."""
    if isinstance(gamma, DepthPolicy):
        if options:
            raise ValueError("gamma_options only apply when gamma is a policy name")
        return gamma
    if isinstance(gamma, int) and not isinstance(gamma, bool):
        return FixedDepth(_check_gamma(gamma))
    if isinstance(gamma, str):
        try:
            return DEPTH_POLICIES.get(gamma)(**dict(options or {}))
        except TypeError as err:
            raise ValueError(f"depth policy {gamma!r}: {err}") from None
    raise ValueError(
        f"gamma must be an int >= 0, a policy name {DEPTH_POLICIES.names()} or a DepthPolicy, got {gamma!r}"
    )
