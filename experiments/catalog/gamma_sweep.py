"""``gamma-sweep``: α and speedup against the draft length γ, with the cost-model curve overlaid.

Leviathan et al. 2023 (arXiv 2211.17192, §3.3–3.5, Theorem 3.8) predict the walltime improvement
from α, γ and the draft cost; with the verify cost measured as a function of block length (on a
CPU, a block of γ+1 tokens is not free) it is :func:`specdec.metrics.predicted_speedup`::

    speedup(γ) = τ_expected(α, γ) · t_target(1) / (γ · t_draft + t_verify(γ + 1))

Each run decodes the same prompts with plain decoding and with one drafter at every γ of the
sweep, prompt by prompt in turn. The theory curve (γ = 0 … 8) uses the drafter's α_iid pooled
over the run, its measured draft time per token, and the target's measured forward time per block
length T, interpolated between measured lengths
(:func:`specdec.metrics.interpolate_verify_time`). Greedy outputs are compared with plain
greedy decoding token for token (exact-match rate; must be 1 for every γ).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from experiments.catalog.specdec_runs import (
    PLAIN,
    TINY_TARGET,
    InterleavedRunConfig,
    available_drafters,
    drafter_method,
    method_rows,
    run_on_prompts,
)
from experiments.experiment import Experiment
from experiments.runner import RunContext
from experiments.store import RunRecord
from experiments.sweep import Sweep
from specdec.summary import Figure, Summary, Table, series_from_points, table_from_rows

__all__ = ["DRAFTERS", "GammaSweepConfig", "plan", "run_gamma_sweep", "theory_curve", "EXPERIMENT"]

DRAFTERS = ("ngram", "bigram", "eagle")


@dataclass(frozen=True, kw_only=True)
class GammaSweepConfig(InterleavedRunConfig):
    """One drafter at every γ of ``gammas``, beside plain decoding, on the same prompts."""

    drafter: str = "ngram"
    gammas: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    max_gamma_theory: int = 8
    prompt_sets: tuple[str, ...] = ("humaneval", "mtbench")
    num_prompts: int = 3
    max_new_tokens: int = 96
    chat: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.gammas or min(self.gammas) < 1:
            raise ValueError(f"gammas must be a non-empty list of ints >= 1, got {self.gammas}")
        self.at_least(max_gamma_theory=1, num_prompts=1)


def plan(*, smoke: bool = False) -> Sweep:
    """ngram and bigram (and eagle once its weights ship), γ = 1, 2, 3, 4, 6, 8, greedy."""
    if smoke:
        base = GammaSweepConfig(
            target=TINY_TARGET,
            gammas=(1, 2),
            max_gamma_theory=3,
            num_prompts=1,
            max_new_tokens=6,
            lm_corpus_chars=20_000,
        )
        return Sweep(base, {"drafter": ["ngram"]})
    base = GammaSweepConfig()
    return Sweep(base, {"drafter": list(available_drafters(DRAFTERS, base.target)[0])})


def theory_curve(
    *, alpha: float, t_draft: float, t_target: float, verify_time_by_block: dict[int, float], max_gamma: int
) -> list[float]:
    """Predicted speedup for γ = 0 … ``max_gamma`` from measured α and costs (seconds).

    ``verify_time_by_block`` maps block length T to the measured target time; lengths not measured
    come from :func:`specdec.metrics.interpolate_verify_time` (interpolation between measured
    neighbours).
    """
    from specdec.metrics import interpolate_verify_time, predicted_speedup

    alpha = min(max(alpha, 0.0), 1.0)
    return [
        predicted_speedup(
            alpha=alpha,
            gamma=g,
            t_draft=t_draft,
            t_verify=interpolate_verify_time(verify_time_by_block, g + 1),
            t_target=t_target,
        )
        for g in range(max_gamma + 1)
    ]


def run_gamma_sweep(config: GammaSweepConfig, ctx: RunContext) -> dict:
    """Plain decoding and the drafter at each γ; bench-style rows per γ, and the theory curve."""
    from specdec.metrics import merge_metrics

    methods = [PLAIN] + [
        drafter_method(config, config.drafter, g, label=f"ours/{config.drafter}@{g}") for g in config.gammas
    ]
    results, threads = run_on_prompts(config, ctx, config.prompt_sets, methods)
    rows = [
        r for r in method_rows(results, config.temperature, config.prompt_sets) if r["prompt_set"] == "all"
    ]
    for row in rows:
        row["gamma"] = 0 if row["method"] == "ours/none" else int(row["method"].rsplit("@", 1)[1])
    plain = merge_metrics([r.metrics for r in results["ours/none"]])
    everything = merge_metrics([r.metrics for rs in results.values() for r in rs])
    drafted = merge_metrics([r.metrics for m in methods[1:] for r in results[m.label]])
    t_target = plain.verify_time_by_block.get(1) or everything.verify_time_by_block[1]
    curve = theory_curve(
        alpha=drafted.alpha_iid,
        t_draft=drafted.draft_time_per_token_s,
        t_target=t_target,
        # Plain decoding's own T = 1 time, so that the curve is exactly 1 at γ = 0.
        verify_time_by_block={**everything.verify_time_by_block, 1: t_target},
        max_gamma=config.max_gamma_theory,
    )
    return {
        "torch_threads": threads,
        "methods": rows,
        "theory": {
            "gamma": list(range(config.max_gamma_theory + 1)),
            "predicted_speedup": curve,
            "alpha_iid": drafted.alpha_iid,
            "t_draft_ms": drafted.draft_time_per_token_s * 1e3,
            "t_target_ms": t_target * 1e3,
            "verify_ms_by_block": {
                str(T): t * 1e3 for T, t in {**everything.verify_time_by_block, 1: t_target}.items()
            },
        },
    }


def summarize(records: Sequence[RunRecord]) -> Summary:
    """Table per (drafter, γ); figures: speedup against γ (measured, predicted) and verify cost against T."""
    rows = [row for rec in records for row in _rows(rec)]
    cfg = records[0].config if records else GammaSweepConfig()
    sizes = (
        f"{cfg.num_prompts} prompt(s) each from {', '.join(cfg.prompt_sets)}, "
        f"{cfg.max_new_tokens} new tokens, $T={cfg.temperature:g}$, "
        f"{cfg.num_threads} torch thread(s) (CPU-sized)"
    )
    exact = [r["exact"] for r in rows if r["exact"] is not None]
    return Summary(
        title="Draft length: measured against predicted speedup",
        tables=(_table(records, rows, cfg, sizes),),
        figures=_figures(records, sizes) if records else (),
        notes=f"Exact-match rate of greedy outputs, min over gamma: {min(exact):.3f}." if exact else "",
    )


def _rows(rec: RunRecord) -> list[dict]:
    """One table row per γ of one drafter's run (γ = 0: the plain decode of that run)."""
    d, curve = rec.config.drafter, rec.result["theory"]["predicted_speedup"]
    rows = []
    for r in sorted(rec.result["methods"], key=lambda r: r["gamma"]):
        g = r["gamma"]
        rows.append(
            {
                "drafter": d if g else f"plain ({d} run)",
                "gamma": g,
                "alpha": r.get("acceptance_rate") if g else None,
                "alpha_iid": r.get("alpha_iid") if g else None,
                "tau": r.get("mean_accepted_tokens"),
                "speedup": r.get("speedup"),
                "predicted": r.get("predicted_speedup") if g else None,
                "theory": curve[g] if g < len(curve) else None,
                "exact": r.get("exact_match_rate"),
                "tps": r.get("tokens_per_second"),
            }
        )
    return rows


def _table(records: Sequence[RunRecord], rows: list[dict], cfg: GammaSweepConfig, sizes: str) -> Table:
    costs = "; ".join(
        f"{r.config.drafter}: $t_\\mathrm{{draft}} = {r.result['theory']['t_draft_ms']:.2f}$ ms, "
        f"$t_\\mathrm{{target}}(1) = {r.result['theory']['t_target_ms']:.1f}$ ms"
        for r in records
    )
    return table_from_rows(
        "gamma",
        f"Acceptance and speedup against $\\gamma$ on {cfg.target}: {sizes}. $\\alpha$ = accepted/proposed, "
        "$\\alpha_\\mathrm{iid}$ = accepted/(accepted + rejections); speedup over plain decoding measured "
        "in the same run; Pred.: from each row's own $\\alpha_\\mathrm{iid}$ and costs; Theory: "
        "Theorem 3.8 with the drafter's pooled $\\alpha_\\mathrm{iid}$ and measured costs "
        f"({costs}); Exact: greedy outputs equal to plain decoding.",
        [
            ("drafter", "Drafter", ""),
            ("gamma", "$\\gamma$", "d"),
            ("alpha", "$\\alpha$", ".3f"),
            ("alpha_iid", "$\\alpha_\\mathrm{iid}$", ".3f"),
            ("tau", "$\\tau$", ".2f"),
            ("tps", "tok/s", ".1f"),
            ("speedup", "Speedup", ".2f"),
            ("predicted", "Pred.", ".2f"),
            ("theory", "Theory", ".2f"),
            ("exact", "Exact", ".2f"),
        ],
        rows,
    )


def _figures(records: Sequence[RunRecord], sizes: str) -> tuple[Figure, ...]:
    """Speedup against γ (measured markers, Theorem 3.8 line) and verify cost against T, per drafter."""
    speed_series, cost_series = [], []
    for rec in records:
        d, theory = rec.config.drafter, rec.result["theory"]
        measured = sorted((r["gamma"], r["speedup"]) for r in rec.result["methods"] if r.get("speedup"))
        theory_points = list(zip(theory["gamma"], theory["predicted_speedup"], strict=True))
        speed_series += [
            series_from_points(measured, label=f"{d} measured", style="markers", group=d),
            series_from_points(
                theory_points,
                label=f"{d} theory ($\\alpha$={theory['alpha_iid']:.2f})",
                style="line",
                group=d,
            ),
        ]
        blocks = sorted(
            (int(T), ms / theory["t_target_ms"]) for T, ms in theory["verify_ms_by_block"].items()
        )
        cost_series.append(series_from_points(blocks, label=f"runs with {d}", group=d))
    return (
        Figure(
            name="speedup-vs-gamma",
            caption="Speedup over plain decoding against $\\gamma$: measured (markers) and predicted from "
            f"the measured $\\alpha$ and costs (lines; $\\gamma=0$ is plain decoding). {sizes}.",
            xlabel="draft length $\\gamma$",
            ylabel="speedup over plain decoding",
            series=tuple(speed_series),
            ymin=0.0,
        ),
        Figure(
            name="verify-cost",
            caption="Measured target forward time for a block of $T$ tokens, relative to one token: the "
            f"verify cost of $\\gamma = T - 1$ drafts that the theory curve uses. {sizes}.",
            xlabel="block length $T = \\gamma + 1$",
            ylabel="$t_\\mathrm{verify}(T) / t_\\mathrm{target}(1)$",
            series=tuple(cost_series),
            ymin=0.0,
        ),
    )


EXPERIMENT = Experiment(
    name="gamma-sweep",
    description="alpha and speedup against gamma (1..8) for ngram/bigram/eagle, with the Theorem 3.8 curve "
    "from measured alpha and costs",
    plan=plan,
    runners={GammaSweepConfig: run_gamma_sweep},
    summarize=summarize,
)
