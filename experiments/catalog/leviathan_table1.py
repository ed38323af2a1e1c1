"""``leviathan-table1``: Table 1 and the optimal-γ figure of Leviathan et al. 2023 (arXiv 2211.17192).

Table 1 lists, for six (α, γ), the expected factor of increase in arithmetic operations and the
expected walltime improvement. Their closed forms (Theorems 3.8 and 3.11) depend on the draft cost c
(walltime) and ĉ (operations); solving for the costs that reproduce all six published pairs to two
decimals gives c ∈ [0, 1.0e-4] and ĉ ∈ [0, 1.3e-3]: the table is for c = ĉ = 0 (a free draft
model), which is this experiment's default. The optimal-γ figure (their Figure 3) plots the γ that
maximises the walltime improvement against α for several c.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from experiments.config import validate_config
from experiments.experiment import Experiment
from experiments.runner import RunContext
from experiments.store import RunRecord
from experiments.sweep import Sweep
from experiments.theory.leviathan import (
    expected_tokens,
    operations_factor,
    optimal_gamma,
    reproducing_interval,
    walltime_improvement,
)
from specdec.summary import Figure, Series, Summary, Table, series_from_points, table_from_rows

__all__ = ["PUBLISHED", "Table1RowConfig", "OptimalGammaConfig", "plan", "EXPERIMENT"]

# (alpha, gamma) -> (operations factor, walltime improvement), as printed in their Table 1.
PUBLISHED: dict[tuple[float, int], tuple[float, float]] = {
    (0.6, 2): (1.53, 1.96),
    (0.7, 3): (1.58, 2.53),
    (0.8, 2): (1.23, 2.44),
    (0.8, 5): (1.63, 3.69),
    (0.9, 2): (1.11, 2.71),
    (0.9, 10): (1.60, 6.86),
}
FIGURE_COSTS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


@dataclass(frozen=True, kw_only=True)
class Table1RowConfig:
    """One row of Table 1: acceptance rate α, draft length γ, and the costs c (walltime), ĉ (operations)."""

    alpha: float
    gamma: int
    c: float = 0.0
    c_hat: float = 0.0
    max_gamma_curve: int = 12

    def __post_init__(self) -> None:
        validate_config(self)
        walltime_improvement(self.alpha, self.gamma, self.c)  # range checks
        operations_factor(self.alpha, self.gamma, self.c_hat)


@dataclass(frozen=True, kw_only=True)
class OptimalGammaConfig:
    """One curve of the optimal-γ figure: γ* over an α grid for one draft cost c."""

    c: float
    alpha_min: float = 0.0
    alpha_max: float = 0.95
    num_alphas: int = 96
    max_gamma: int = 1000

    def __post_init__(self) -> None:
        validate_config(self)
        if not 0.0 <= self.alpha_min <= self.alpha_max <= 1.0:
            raise ValueError(f"need 0 <= alpha_min <= alpha_max <= 1, got {self.alpha_min}, {self.alpha_max}")
        if self.num_alphas < 2:
            raise ValueError(f"num_alphas must be >= 2, got {self.num_alphas}")
        optimal_gamma(0.5, self.c, max_gamma=self.max_gamma)  # range checks


def plan(*, smoke: bool = False) -> tuple[Sweep, ...]:
    """The six Table 1 rows at c = ĉ = 0, and one optimal-γ curve per c (coarser grid when smoke)."""
    rows = Sweep(Table1RowConfig(alpha=0.6, gamma=2), {"alpha,gamma": list(PUBLISHED)})
    curve_base = OptimalGammaConfig(c=0.01, num_alphas=12 if smoke else 96, max_gamma=200 if smoke else 1000)
    curves = Sweep(curve_base, {"c": FIGURE_COSTS[:2] if smoke else FIGURE_COSTS})
    return rows, curves


def run_row(config: Table1RowConfig, ctx: RunContext) -> dict:
    """Compute one row; log the improvement for γ = 1..max_gamma_curve as per-step metrics."""
    for gamma in range(1, config.max_gamma_curve + 1):
        ctx.log(
            {
                "gamma": gamma,
                "expected_tokens": expected_tokens(config.alpha, gamma),
                "walltime_improvement": walltime_improvement(config.alpha, gamma, config.c),
                "operations_factor": operations_factor(config.alpha, gamma, config.c_hat),
            },
            step=gamma,
        )
    return {
        "expected_tokens": expected_tokens(config.alpha, config.gamma),
        "walltime_improvement": walltime_improvement(config.alpha, config.gamma, config.c),
        "operations_factor": operations_factor(config.alpha, config.gamma, config.c_hat),
    }


def run_optimal_gamma(config: OptimalGammaConfig, ctx: RunContext) -> dict:
    """γ* and the improvement it gives at each α of the grid (one logged step per α)."""
    step = (config.alpha_max - config.alpha_min) / (config.num_alphas - 1)
    alphas, gammas, improvements = [], [], []
    for i in range(config.num_alphas):
        alpha = round(config.alpha_min + i * step, 12)
        gamma = optimal_gamma(alpha, config.c, max_gamma=config.max_gamma)
        improvement = walltime_improvement(alpha, gamma, config.c)
        ctx.log({"alpha": alpha, "optimal_gamma": gamma, "walltime_improvement": improvement}, step=i)
        alphas.append(alpha)
        gammas.append(gamma)
        improvements.append(improvement)
    return {"alpha": alphas, "optimal_gamma": gammas, "walltime_improvement": improvements}


def summarize(records: Sequence[RunRecord]) -> Summary:
    """Table 1 with the published numbers beside ours, the cost interval that reproduces them, the figure."""
    row_records = [r for r in records if isinstance(r.config, Table1RowConfig)]
    c_range = reproducing_interval([(a, g, w) for (a, g), (_, w) in PUBLISHED.items()], kind="walltime")
    c_hat_range = reproducing_interval([(a, g, o) for (a, g), (o, _) in PUBLISHED.items()], kind="operations")
    curve_records = sorted(
        (r for r in records if isinstance(r.config, OptimalGammaConfig)), key=lambda r: r.config.c
    )
    return Summary(
        title="Leviathan et al. (2023), Table 1 and the optimal draft length",
        tables=(_table1(row_records, c_range, c_hat_range),) if row_records else (),
        figures=_curves(curve_records) if curve_records else (),
        notes=f"c interval reproducing Table 1: {c_range}; c-hat interval: {c_hat_range}. "
        "Analytic: no hardware dependence.",
        extra={"c_interval": c_range, "c_hat_interval": c_hat_range},
    )


def _table1(row_records: Sequence[RunRecord], c_range, c_hat_range) -> Table:
    """Ours beside the paper's Ops and Speed per (α, γ), and whether the pair matches to 0.005."""
    rows = []
    for record in row_records:
        cfg, res = record.config, record.result
        published = PUBLISHED.get((cfg.alpha, cfg.gamma))
        ops_paper, wall_paper = published if published else (None, None)
        rows.append(
            {
                "alpha": cfg.alpha,
                "gamma": cfg.gamma,
                "ops_paper": ops_paper,
                "ops_ours": res["operations_factor"],
                "wall_paper": wall_paper,
                "wall_ours": res["walltime_improvement"],
                "match": "yes" if published and _matches(published, res) else "no",
            }
        )
    costs = sorted({(r.config.c, r.config.c_hat) for r in row_records})
    cost_tex = "; ".join(f"$c = {c:g}$, $\\hat c = {ch:g}$" for c, ch in costs)
    if c_range and c_hat_range:
        interval_tex = (
            f"The costs that reproduce all six published pairs to 0.01 are $c \\in [{c_range[0]:.2g}, "
            f"{c_range[1]:.2g}]$ and $\\hat c \\in [{c_hat_range[0]:.2g}, {c_hat_range[1]:.2g}]$: "
            "their Table 1 assumes $c = \\hat c = 0$."
        )
    else:
        interval_tex = "No single cost reproduces all six published pairs."
    return table_from_rows(
        "table1",
        "Leviathan et al.\\ (2023) Table 1 recomputed from its closed forms (Theorems 3.8 and 3.11) at "
        f"{cost_tex}: expected factor of increase in arithmetic operations (Ops) and expected walltime "
        f"improvement (Speed), the paper's numbers beside ours. {interval_tex}",
        [
            ("alpha", "$\\alpha$", ".1f"),
            ("gamma", "$\\gamma$", "d"),
            ("ops_paper", "Ops (paper)", ".2f"),
            ("ops_ours", "Ops (ours)", ".2f"),
            ("wall_paper", "Speed (paper)", ".2f"),
            ("wall_ours", "Speed (ours)", ".2f"),
            ("match", "Match", ""),
        ],
        rows,
    )


def _curves(curve_records: Sequence[RunRecord]) -> tuple[Figure, ...]:
    """The optimal γ and the walltime improvement at it against α, one curve per draft cost c."""

    def curves(key: str, style: str) -> tuple[Series, ...]:
        return tuple(
            series_from_points(
                list(zip(r.result["alpha"], r.result[key], strict=True)),
                label=f"c = {r.config.c:g}",
                style=style,
            )
            for r in curve_records
        )

    return (
        Figure(
            name="optimal-gamma",
            caption="Optimal $\\gamma$ (maximising the expected walltime improvement, Theorem 3.8) as a "
            "function of $\\alpha$ for several draft costs $c$, as in Leviathan et al.\\ (2023) "
            "Figure 3; "
            "$\\gamma = 0$ means plain decoding wins.",
            xlabel="acceptance rate $\\alpha$",
            ylabel="optimal $\\gamma$",
            logy=False,
            series=curves("optimal_gamma", "step"),
        ),
        Figure(
            name="optimal-speedup",
            caption="Expected walltime improvement at the optimal $\\gamma$ against $\\alpha$, per draft "
            "cost $c$ (Leviathan et al.\\ 2023, Theorem 3.8).",
            xlabel="acceptance rate $\\alpha$",
            ylabel="walltime improvement at optimal $\\gamma$",
            logy=True,
            series=curves("walltime_improvement", "line"),
        ),
    )


def _matches(published: tuple[float, float], result: dict) -> bool:
    ops, wall = published
    return (
        abs(result["operations_factor"] - ops) <= 0.005
        and abs(result["walltime_improvement"] - wall) <= 0.005
    )


EXPERIMENT = Experiment(
    name="leviathan-table1",
    description="Leviathan et al. 2023 Table 1 (ops factor, walltime improvement) exact, "
    "and the optimal-gamma figure",
    plan=plan,
    runners={Table1RowConfig: run_row, OptimalGammaConfig: run_optimal_gamma},
    summarize=summarize,
)
