"""Metrics of one speculative generation run, and the speedup the cost model predicts.

Legend: B batch, K draft length (γ) of one step, T target block length (K + 1).

Definitions (one run, all rows together):

- **α, acceptance rate** = accepted draft tokens / proposed draft tokens.
- **α_iid** = accepted / (accepted + rejections): the per-token acceptance probability of the i.i.d.
  model of Leviathan et al. 2023 (arXiv 2211.17192, §3.1). Drafts after a row's first rejection are
  never tested, so accepted / proposed under-estimates that probability; the prediction uses α_iid.
- **τ, mean accepted tokens** (Spec-Bench, arXiv 2401.07851): tokens a target verify call yields
  per row, the recovered or bonus token included (plain decoding has τ = 1).
- **acceptance histogram**: entry k is P(draft position k was accepted | a draft was proposed there).
- **per-token latency**: a step's wall time divided evenly among the tokens it committed for the row;
  TPOT/ITL is its mean, P50/P99 its percentiles; the first token counts in TTFT only.
- **tokens per second**: generated tokens of all rows / wall time of the whole call (prefill included).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from specdec.percentile import percentile

__all__ = [
    "StepStats",
    "SpecMetrics",
    "MetricsRecorder",
    "merge_metrics",
    "expected_tokens_per_step",
    "predicted_speedup",
    "predicted_speedup_from_metrics",
    "interpolate_verify_time",
]


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """What one decode step did; one record feeds both the metrics and the γ policy.

    ``gamma``: the γ asked for. ``num_drafted``: draft tokens the target verified (a chain's K, a
    tree's nodes below the root), so the block was ``num_drafted + 1`` tokens long. ``depth``: the
    most tokens a row could accept (K for a chain, the tree's depth; default ``num_drafted``).
    ``num_accepted``: accepted drafts per running row. ``draft_time_s``: drafter time (propose +
    observe); ``target_time_s``: the target forward alone; ``verify_time_s``: forward, verification
    and commit (the real price of a block, which γ policies weigh); ``check_time_s``: the engine's
    checks of the proposal and the logits (:mod:`specdec.checks`), inside ``verify_time_s``.
    ``row_drafted`` / ``row_depth``: per running row, where rows drafted differently (the engine's
    per-row depths; a row's block is padded to ``num_drafted + 1``); default every row as the step.
    """

    gamma: int
    num_drafted: int
    num_accepted: Sequence[int]
    draft_time_s: float
    verify_time_s: float
    target_time_s: float = 0.0
    check_time_s: float = 0.0
    depth: int | None = None
    row_drafted: Sequence[int] | None = None
    row_depth: Sequence[int] | None = None

    @property
    def max_accept(self) -> int:
        return self.num_drafted if self.depth is None else self.depth


@dataclass
class SpecMetrics:
    """Everything measured in one call of :func:`specdec.generate` (see the module doc for definitions)."""

    acceptance_rate: float = 0.0
    mean_accepted_tokens: float = 0.0
    acceptance_histogram: list[float] = field(default_factory=list)
    tokens_per_second: float = 0.0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    target_time_s: float = 0.0
    draft_time_s: float = 0.0
    check_time_s: float = 0.0
    """Time the engine spent checking proposals and logits (:mod:`specdec.checks`)."""
    num_target_calls: int = 0
    num_generated_tokens: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    gamma_history: list[int] = field(default_factory=list)
    # --- beyond the contract: what the cost model and the benchmark need -------------------------
    alpha_iid: float = 0.0
    num_rejections: int = 0
    num_steps: int = 0
    total_time_s: float = 0.0
    prefill_time_s: float = 0.0
    overhead_time_s: float = 0.0
    draft_time_per_token_s: float = 0.0
    verify_time_by_block: dict[int, float] = field(default_factory=dict)
    verify_count_by_block: dict[int, int] = field(default_factory=dict)
    draft_len_history: list[int] = field(default_factory=list)
    num_row_steps: int = 0
    proposed_at_position: list[int] = field(default_factory=list)
    accepted_at_position: list[int] = field(default_factory=list)
    token_latencies_s: list[float] = field(default_factory=list, repr=False)
    """Raw per-token latencies (kept for :func:`merge_metrics`; left out of :meth:`to_dict`)."""

    def to_dict(self) -> dict:
        """A JSON-serialisable dict (block-length keys become strings; raw latencies left out)."""
        d = dataclasses.asdict(self)
        d.pop("token_latencies_s")
        d["verify_time_by_block"] = {str(k): v for k, v in self.verify_time_by_block.items()}
        d["verify_count_by_block"] = {str(k): v for k, v in self.verify_count_by_block.items()}
        return d


class MetricsRecorder:
    """Accumulates what the engine observes; :meth:`finish` turns it into :class:`SpecMetrics`.

    Cheap by design (a few list appends per step): it runs inside every engine step.
    """

    def __init__(self) -> None:
        self.prefill_time_s = 0.0
        self.ttft_s = 0.0
        self.target_time_s = 0.0
        self.draft_time_s = 0.0
        self.check_time_s = 0.0
        self.step_draft_time_s = 0.0  # draft time inside verify steps (the drafter's prefill excluded)
        self.num_target_calls = 0
        self.num_generated = 0
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_rejections = 0
        self.num_row_steps = 0
        self.accepted_tokens_total = 0  # Σ (accepted + 1) over verified row-steps
        self.proposed_at: list[int] = []  # per draft position: row-steps that had a draft there
        self.accepted_at: list[int] = []
        self.latencies: list[float] = []
        self.gamma_history: list[int] = []
        self.draft_len_history: list[int] = []
        self.verify_time_sum: dict[int, float] = {}
        self.verify_count: dict[int, int] = {}

    def record_prefill(
        self, target_time_s: float, draft_time_s: float, ttft_s: float, num_first: int
    ) -> None:
        self.prefill_time_s = target_time_s
        self.target_time_s += target_time_s
        self.draft_time_s += draft_time_s
        self.num_target_calls += 1
        self.ttft_s = ttft_s
        self.num_generated += num_first

    def record_step(self, stats: StepStats) -> None:
        """One verify step; ``stats.num_accepted`` lists the rows still running."""
        num_drafted, depth = stats.num_drafted, stats.max_accept
        self.gamma_history.append(stats.gamma)
        self.draft_len_history.append(num_drafted)
        self.target_time_s += stats.target_time_s
        self.draft_time_s += stats.draft_time_s
        self.check_time_s += stats.check_time_s
        self.step_draft_time_s += stats.draft_time_s
        self.num_target_calls += 1
        T = num_drafted + 1
        self.verify_time_sum[T] = self.verify_time_sum.get(T, 0.0) + stats.target_time_s
        self.verify_count[T] = self.verify_count.get(T, 0) + 1
        rows = len(stats.num_accepted)
        drafted_rows = stats.row_drafted if stats.row_drafted is not None else [num_drafted] * rows
        depth_rows = stats.row_depth if stats.row_depth is not None else [depth] * rows
        deepest = max([depth, *depth_rows])
        if len(self.proposed_at) < deepest:
            grow = deepest - len(self.proposed_at)
            self.proposed_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for a, d, k_max in zip(stats.num_accepted, drafted_rows, depth_rows, strict=True):
            self.num_row_steps += 1
            self.accepted_tokens_total += a + 1
            self.num_accepted += a
            self.num_proposed += d
            if a < k_max:
                self.num_rejections += 1
            for k in range(k_max):
                self.proposed_at[k] += 1
            for k in range(a):
                self.accepted_at[k] += 1

    def record_commit(self, step_wall_s: float, num_tokens: int) -> None:
        """A row committed ``num_tokens`` tokens in a step that took ``step_wall_s``."""
        self.num_generated += num_tokens
        if num_tokens > 0:
            self.latencies.extend([step_wall_s / num_tokens] * num_tokens)

    def finish(self, total_time_s: float) -> SpecMetrics:
        lat = sorted(self.latencies)
        drafted = sum(self.draft_len_history)
        alpha_iid_den = self.num_accepted + self.num_rejections
        return SpecMetrics(
            acceptance_rate=self.num_accepted / self.num_proposed if self.num_proposed else 0.0,
            mean_accepted_tokens=self.accepted_tokens_total / self.num_row_steps
            if self.num_row_steps
            else 0.0,
            acceptance_histogram=[
                a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at, strict=True)
            ],
            tokens_per_second=self.num_generated / total_time_s if total_time_s > 0 else 0.0,
            ttft_s=self.ttft_s,
            tpot_s=sum(lat) / len(lat) if lat else 0.0,
            latency_p50_s=percentile(lat, 50) or 0.0,
            latency_p99_s=percentile(lat, 99) or 0.0,
            target_time_s=self.target_time_s,
            draft_time_s=self.draft_time_s,
            check_time_s=self.check_time_s,
            num_target_calls=self.num_target_calls,
            num_generated_tokens=self.num_generated,
            num_proposed=self.num_proposed,
            num_accepted=self.num_accepted,
            gamma_history=list(self.gamma_history),
            alpha_iid=self.num_accepted / alpha_iid_den if alpha_iid_den else 0.0,
            num_rejections=self.num_rejections,
            num_steps=len(self.gamma_history),
            total_time_s=total_time_s,
            prefill_time_s=self.prefill_time_s,
            overhead_time_s=max(0.0, total_time_s - self.target_time_s - self.draft_time_s),
            draft_time_per_token_s=self.step_draft_time_s / drafted if drafted else 0.0,
            verify_time_by_block={
                T: self.verify_time_sum[T] / n for T, n in sorted(self.verify_count.items())
            },
            verify_count_by_block=dict(sorted(self.verify_count.items())),
            draft_len_history=list(self.draft_len_history),
            num_row_steps=self.num_row_steps,
            proposed_at_position=list(self.proposed_at),
            accepted_at_position=list(self.accepted_at),
            token_latencies_s=lat,
        )


def merge_metrics(runs: Sequence[SpecMetrics]) -> SpecMetrics:
    """Pool several runs (e.g. one per prompt) as if they were one: counts and times add up, rates
    are recomputed from the pooled counts, latencies pooled before taking percentiles."""
    if not runs:
        raise ValueError("merge_metrics needs at least one SpecMetrics")
    total = sum(m.total_time_s for m in runs)
    gen = sum(m.num_generated_tokens for m in runs)
    proposed = sum(m.num_proposed for m in runs)
    accepted = sum(m.num_accepted for m in runs)
    rejections = sum(m.num_rejections for m in runs)
    row_steps = sum(m.num_row_steps for m in runs)
    drafted = sum(sum(m.draft_len_history) for m in runs)
    step_draft = sum(m.draft_time_per_token_s * sum(m.draft_len_history) for m in runs)
    width = max(len(m.proposed_at_position) for m in runs)
    prop_at = [
        sum(m.proposed_at_position[k] for m in runs if k < len(m.proposed_at_position)) for k in range(width)
    ]
    acc_at = [
        sum(m.accepted_at_position[k] for m in runs if k < len(m.accepted_at_position)) for k in range(width)
    ]
    count_by_block: dict[int, int] = {}
    time_by_block: dict[int, float] = {}
    for m in runs:
        for T, n in m.verify_count_by_block.items():
            count_by_block[T] = count_by_block.get(T, 0) + n
            time_by_block[T] = time_by_block.get(T, 0.0) + n * m.verify_time_by_block[T]
    lat = sorted(x for m in runs for x in m.token_latencies_s)
    return SpecMetrics(
        acceptance_rate=accepted / proposed if proposed else 0.0,
        mean_accepted_tokens=(accepted + row_steps) / row_steps if row_steps else 0.0,
        acceptance_histogram=[a / p if p else 0.0 for a, p in zip(acc_at, prop_at, strict=True)],
        tokens_per_second=gen / total if total > 0 else 0.0,
        ttft_s=sum(m.ttft_s for m in runs) / len(runs),
        tpot_s=sum(lat) / len(lat) if lat else 0.0,
        latency_p50_s=percentile(lat, 50) or 0.0,
        latency_p99_s=percentile(lat, 99) or 0.0,
        target_time_s=sum(m.target_time_s for m in runs),
        draft_time_s=sum(m.draft_time_s for m in runs),
        check_time_s=sum(m.check_time_s for m in runs),
        num_target_calls=sum(m.num_target_calls for m in runs),
        num_generated_tokens=gen,
        num_proposed=proposed,
        num_accepted=accepted,
        gamma_history=[g for m in runs for g in m.gamma_history],
        alpha_iid=accepted / (accepted + rejections) if accepted + rejections else 0.0,
        num_rejections=rejections,
        num_steps=sum(m.num_steps for m in runs),
        total_time_s=total,
        prefill_time_s=sum(m.prefill_time_s for m in runs),
        overhead_time_s=sum(m.overhead_time_s for m in runs),
        draft_time_per_token_s=step_draft / drafted if drafted else 0.0,
        verify_time_by_block={T: time_by_block[T] / n for T, n in sorted(count_by_block.items())},
        verify_count_by_block=dict(sorted(count_by_block.items())),
        draft_len_history=[k for m in runs for k in m.draft_len_history],
        num_row_steps=row_steps,
        proposed_at_position=prop_at,
        accepted_at_position=acc_at,
        token_latencies_s=lat,
    )


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """E[tokens per verify step] = (1 − α^(γ+1)) / (1 − α) (Leviathan et al. 2023, arXiv 2211.17192, eq. 1).

    ``alpha`` is the per-token acceptance probability; ``alpha == 1`` gives γ + 1.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha!r}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma!r}")
    if alpha > 1.0 - 1e-9:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(*, alpha: float, gamma: int, t_draft: float, t_verify: float, t_target: float) -> float:
    """Speedup over plain decoding that the cost model predicts.

    ``τ_expected(α, γ) · t_target(1) / (γ · t_draft + t_verify(γ+1))``, with ``t_draft`` one draft
    token's cost, ``t_verify`` the target's cost on a block of γ+1 tokens and ``t_target`` its cost on
    one token (Leviathan et al. 2023, arXiv 2211.17192, Theorem 3.8, with the verify cost measured
    as a function of block length instead of assumed equal to one target call).
    """
    cost = gamma * t_draft + t_verify
    if cost <= 0:
        raise ValueError(f"gamma * t_draft + t_verify must be > 0, got {cost!r}")
    return expected_tokens_per_step(alpha, gamma) * t_target / cost


def interpolate_verify_time(verify_time_by_block: Mapping[int, float], T: int) -> float:
    """Verify cost for block length T: measured, else linear between measured neighbours."""
    if T in verify_time_by_block:
        return verify_time_by_block[T]
    known = sorted(verify_time_by_block)
    lower = [t for t in known if t < T]
    upper = [t for t in known if t > T]
    if lower and upper:
        lo, hi = lower[-1], upper[0]
        w = (T - lo) / (hi - lo)
        return verify_time_by_block[lo] * (1 - w) + verify_time_by_block[hi] * w
    return verify_time_by_block[(lower or upper)[-1 if lower else 0]]


def predicted_speedup_from_metrics(metrics: SpecMetrics, t_target: float) -> float:
    """The predicted speedup of a measured run, from its own α_iid and measured costs.

    Generalises :func:`predicted_speedup` to a run whose draft length K varied from step to step
    (adaptive γ, n-gram misses): predicted time per token = Σ_steps (K·t_draft + t_verify(K+1)) /
    Σ_steps τ_expected(α_iid, K), compared with ``t_target`` (one plain decode step of the same
    target, measured in a plain run). It equals the closed form when K is constant. Returns 0.0 for
    a run with no verify step.
    """
    if t_target <= 0:
        raise ValueError(f"t_target must be > 0, got {t_target!r}")
    if not metrics.draft_len_history or not metrics.verify_time_by_block:
        return 0.0
    alpha = min(max(metrics.alpha_iid, 0.0), 1.0)
    cost = 0.0
    tokens = 0.0
    for K in metrics.draft_len_history:
        t_verify = interpolate_verify_time(metrics.verify_time_by_block, K + 1)
        cost += K * metrics.draft_time_per_token_s + t_verify
        tokens += expected_tokens_per_step(alpha, K)
    return tokens * t_target / cost if cost > 0 else 0.0
