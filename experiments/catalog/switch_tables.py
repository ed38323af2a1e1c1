"""``switch-tables``: the exact checks behind Switch Transformer's tables (Fedus et al., arXiv 2101.03961).

- Drop fraction under uniform random routing with a capacity factor equals the binomial tail
  (:func:`experiments.theory.moe_routing.expected_drop_fraction`), checked by Monte-Carlo: each batch of
  routed tokens is counted by every counter in :data:`DROP_COUNTERS` (``reference``: a bincount beside
  the formula; ``moe``: ``moe.MoE``'s own capacity dropping), with the capacity of ``moe.expert_capacity``.
- Under uniform router probabilities the Switch load-balancing loss equals its coefficient, whatever
  the dispatch; computed by a source in :data:`LOSS_SOURCES` (``formula``: the plain-PyTorch formula;
  ``moe``: ``moe.MoE``'s own ``last_aux_loss`` with a zeroed router).

The trained part (:mod:`experiments.catalog.switch_trained`): a tiny byte-level MoE language model
(:mod:`experiments.tiny_moe_lm`) trained on this CPU, with loss against the number of experts at fixed
active FLOPs, a capacity-factor sweep (dropped fraction against loss) and a load-balancing coefficient
sweep (load imbalance against loss).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import moe
from experiments.catalog.switch_trained import (
    ThroughputConfig,
    run_throughput,
    run_training,
    trained_figures,
    trained_sweeps,
    trained_tables,
)
from experiments.config import validate_config
from experiments.experiment import Experiment
from experiments.runner import RunContext
from experiments.store import RunRecord
from experiments.sweep import Sweep
from experiments.theory.moe_routing import (
    drop_fraction,
    expected_drop_fraction,
    random_topk_routing,
    switch_load_balancing_loss,
)
from experiments.tiny_moe_lm import TinyTrainConfig
from specdec.registry import Registry
from specdec.summary import Figure, Summary, Table, series_from_points, table_from_rows

__all__ = [
    "DropCheckConfig",
    "SwitchLossCheckConfig",
    "DROP_COUNTERS",
    "LOSS_SOURCES",
    "capacity",
    "plan",
    "EXPERIMENT",
]


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """The layer's own expert capacity (``moe.expert_capacity``: ceil(cf·T·k/E), at least 1)."""
    if not isinstance(capacity_factor, (int, float)) or not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be a number > 0, got {capacity_factor!r}")
    return moe.expert_capacity(
        num_tokens=num_tokens, top_k=top_k, num_experts=num_experts, capacity_factor=capacity_factor
    )


@dataclass(frozen=True, kw_only=True)
class DropCheckConfig:
    """Uniform random top-k routing of ``num_tokens`` per batch with capacity ceil(cf·T·k/E)."""

    num_experts: int
    top_k: int = 1
    capacity_factor: float = 1.0
    num_tokens: int = 512
    num_batches: int = 400
    seed: int = 0

    def __post_init__(self) -> None:
        validate_config(self)
        _check_shape(self.num_tokens, self.num_experts, self.top_k)
        if not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {self.capacity_factor}")
        if self.num_batches < 2:
            raise ValueError(f"num_batches must be >= 2 (for a standard error), got {self.num_batches}")


@dataclass(frozen=True, kw_only=True)
class SwitchLossCheckConfig:
    """The Switch loss of ``num_tokens`` tokens under uniform router probabilities, from ``source``."""

    num_experts: int
    top_k: int = 1
    coefficient: float = 0.01
    num_tokens: int = 1024
    source: str = "formula"
    seed: int = 0

    def __post_init__(self) -> None:
        validate_config(self)
        _check_shape(self.num_tokens, self.num_experts, self.top_k)
        if not self.coefficient > 0:
            raise ValueError(f"coefficient must be > 0, got {self.coefficient}")


def _check_shape(num_tokens: int, num_experts: int, top_k: int) -> None:
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")


def reference_counter(config: DropCheckConfig) -> Callable[[torch.Tensor], float]:
    """Count overflow per expert with a bincount (:func:`experiments.theory.moe_routing.drop_fraction`)."""
    cap = capacity(config.num_tokens, config.num_experts, config.top_k, config.capacity_factor)
    return lambda expert_ids_TK: drop_fraction(expert_ids_TK, config.num_experts, cap)


def moe_counter(config: DropCheckConfig) -> Callable[[torch.Tensor], float]:
    """``moe.MoE``'s capacity dropping on the given routing: its ``last_drop_fraction`` after ``plan``."""
    layer = moe.MoE(
        dim=8,
        hidden_dim=8,
        num_experts=config.num_experts,
        top_k=config.top_k,
        capacity_factor=config.capacity_factor,
        track_stats=False,
    )

    def count(expert_ids_TK: torch.Tensor) -> float:
        num_tokens = expert_ids_TK.shape[0]
        routing = moe.Routing(
            logits_TE=torch.zeros(num_tokens, config.num_experts),
            experts_TK=expert_ids_TK.long(),
            weights_TK=torch.full(expert_ids_TK.shape, 1.0 / config.top_k),
        )
        layer.plan(routing)
        return float(layer.last_drop_fraction)

    return count


DROP_COUNTERS = Registry(
    "drop counter",
    "specdec.drop_counters",
    builtins={
        "reference": "experiments.catalog.switch_tables:reference_counter",
        "moe": "experiments.catalog.switch_tables:moe_counter",
    },
)
"""Name -> ``factory(config) -> count(expert_ids_TK) -> dropped fraction``; every one counts every batch."""


def formula_loss(config: SwitchLossCheckConfig, generator: torch.Generator) -> float:
    """Uniform router probabilities (softmax of equal logits), random dispatch, the formula's loss."""
    router_probs_TE = torch.softmax(
        torch.zeros(config.num_tokens, config.num_experts, dtype=torch.float64), dim=-1
    )
    expert_ids_TK = random_topk_routing(config.num_experts, config.top_k, skew=1.0)(
        config.num_tokens, generator
    )
    return switch_load_balancing_loss(router_probs_TE, expert_ids_TK, config.coefficient).item()


def moe_loss(config: SwitchLossCheckConfig, generator: torch.Generator) -> float:
    """``moe.MoE``'s own Switch loss (``last_aux_loss``) with a zeroed router: uniform probabilities."""
    layer = moe.MoE(
        dim=16,
        hidden_dim=16,
        num_experts=config.num_experts,
        top_k=config.top_k,
        router="switch" if config.top_k == 1 else "softmax_topk",
        aux_loss_coef=config.coefficient,
    )
    with torch.no_grad():
        layer.router.weight.zero_()
    layer.train()
    layer(torch.randn(config.num_tokens, 16, generator=generator))
    return float(layer.last_aux_loss.detach())


LOSS_SOURCES = Registry(
    "Switch-loss source",
    "specdec.switch_loss_sources",
    builtins={
        "formula": "experiments.catalog.switch_tables:formula_loss",
        "moe": "experiments.catalog.switch_tables:moe_loss",
    },
)
"""Name -> ``fn(config, generator) -> loss under uniform router probabilities``."""


def plan(*, smoke: bool = False) -> tuple[Sweep, ...]:
    """Drop checks over experts × top-k × capacity factor; loss checks over experts × top-k × coefficient;
    the tiny-LM trainings (:func:`experiments.catalog.switch_trained.trained_sweeps`)."""
    drops = Sweep(
        DropCheckConfig(num_experts=8, num_batches=40 if smoke else 400),
        {
            "num_experts": [8] if smoke else [8, 64],
            "top_k": [1] if smoke else [1, 2],
            "capacity_factor": [1.0, 1.5] if smoke else [0.5, 1.0, 1.25, 1.5, 2.0],
        },
    )
    losses = Sweep(
        SwitchLossCheckConfig(num_experts=8),
        {
            "num_experts": [8] if smoke else [8, 64],
            "top_k": [1] if smoke else [1, 2],
            "coefficient": [0.01] if smoke else [0.01, 0.1],
            "source": list(LOSS_SOURCES.names()),
        },
    )
    return (drops, losses, *trained_sweeps(smoke=smoke))


def run_drop_check(config: DropCheckConfig, ctx: RunContext) -> dict:
    """Monte-Carlo drop fraction over ``num_batches`` batches beside the binomial tail."""
    cap = capacity(config.num_tokens, config.num_experts, config.top_k, config.capacity_factor)
    route = random_topk_routing(config.num_experts, config.top_k)
    counters = {name: DROP_COUNTERS.get(name)(config) for name in DROP_COUNTERS.names()}
    generator = torch.Generator().manual_seed(config.seed)
    fractions: dict[str, list[float]] = {name: [] for name in counters}
    for batch in range(config.num_batches):
        expert_ids_TK = route(config.num_tokens, generator)
        for name, count in counters.items():
            fractions[name].append(count(expert_ids_TK))
        ctx.log({f"drop_fraction/{name}": values[-1] for name, values in fractions.items()}, step=batch)
    expected = expected_drop_fraction(config.num_tokens, config.num_experts, config.top_k, cap)
    measured = {name: statistics.fmean(values) for name, values in fractions.items()}
    reference = fractions["reference"]
    sem = statistics.stdev(reference) / math.sqrt(len(reference))
    # z is undefined without variance (e.g. cf << 1, where every batch drops the same)
    z = (measured["reference"] - expected) / sem if sem > 0 else None
    return {"capacity": cap, "expected": expected, "measured": measured, "sem": sem, "z": z}


def run_loss_check(config: SwitchLossCheckConfig, ctx: RunContext) -> dict:
    """The Switch loss under uniform router probabilities, and its distance to the coefficient."""
    generator = torch.Generator().manual_seed(config.seed)
    loss = float(LOSS_SOURCES.get(config.source)(config, generator))
    ctx.log({"loss": loss, "coefficient": config.coefficient}, step=0)
    return {"loss": loss, "abs_error": abs(loss - config.coefficient)}


def summarize(records: Sequence[RunRecord]) -> Summary:
    """The trained tables and loss curves; a drop table and figure (binomial beside Monte-Carlo) and a
    Switch-loss table."""
    drops = [r for r in records if isinstance(r.config, DropCheckConfig)]
    losses = [r for r in records if isinstance(r.config, SwitchLossCheckConfig)]
    trained = [r for r in records if isinstance(r.config, (TinyTrainConfig, ThroughputConfig))]
    tables = trained_tables(trained) if trained else []
    figures = trained_figures(trained) if trained else []
    if drops:
        tables.append(_drop_table(drops))
        figures.append(_drop_figure(drops))
    if losses:
        tables.append(_loss_table(losses))
    return Summary(
        title="Switch Transformer: a tiny MoE LM trained on a CPU, and exact checks of capacity dropping and "
        "the load-balancing loss",
        tables=tuple(tables),
        figures=tuple(figures),
        notes="Trained tables: a tiny byte-level LM on a shared 2-core CPU (sizes in the captions); exact "
        "checks: simulated routing, no hardware dependence.",
    )


def _drop_table(drops: Sequence[RunRecord]) -> Table:
    """The binomial drop fraction beside the Monte-Carlo means, per (E, k, capacity factor)."""
    tokens = sorted({r.config.num_tokens for r in drops})
    batches = sorted({r.config.num_batches for r in drops})
    return table_from_rows(
        "drop-fraction",
        "Dropped fraction of token-to-expert assignments under uniform random top-$k$ routing with "
        "capacity $C=\\lceil \\mathrm{cf}\\cdot Tk/E\\rceil$: the binomial tail "
        "$E\\,\\mathbb{E}[(L-C)^+]/(Tk)$, $L\\sim\\mathrm{Bin}(T,k/E)$, beside a Monte-Carlo "
        "mean over "
        f"{'/'.join(map(str, batches))} batches of $T={'/'.join(map(str, tokens))}$ tokens "
        "($z$: difference in standard errors; -- where every batch drops the same). Simulated "
        "routing; no hardware dependence.",
        [
            ("experts", "$E$", "d"),
            ("top_k", "$k$", "d"),
            ("capacity_factor", "cf", ".2f"),
            ("capacity", "$C$", "d"),
            ("expected", "Binomial", ".3g"),
            ("reference", "Monte-Carlo", ".3g"),
            ("moe", "\\texttt{moe.MoE}", ".3g"),
            ("z", "$z$", "+.1f"),
        ],
        [
            {
                "experts": r.config.num_experts,
                "top_k": r.config.top_k,
                "capacity_factor": r.config.capacity_factor,
                **{k: r.result[k] for k in ("capacity", "expected", "z")},
                **r.result["measured"],
            }
            for r in drops
        ],
    )


def _drop_figure(drops: Sequence[RunRecord]) -> Figure:
    """Drop fraction against the capacity factor per (E, k): the binomial curve and Monte-Carlo points."""
    series = []
    for key in dict.fromkeys((r.config.num_experts, r.config.top_k) for r in drops):
        group = sorted(
            (r for r in drops if (r.config.num_experts, r.config.top_k) == key),
            key=lambda r: r.config.capacity_factor,
        )
        label = f"E={key[0]}, k={key[1]}"
        x = [r.config.capacity_factor for r in group]
        T = group[0].config.num_tokens
        dense = [i / 100 for i in range(int(min(x) * 100), int(max(x) * 100) + 1)]
        curve = [
            (cf, expected_drop_fraction(T, key[0], key[1], capacity(T, key[0], key[1], cf))) for cf in dense
        ]
        measured = [(r.config.capacity_factor, r.result["measured"]["reference"]) for r in group]
        series.append(series_from_points(curve, label=f"{label} binomial", style="line", group=label))
        series.append(
            series_from_points(measured, label=f"{label} Monte-Carlo", style="markers", group=label)
        )
    return Figure(
        name="drop-fraction",
        caption="Drop fraction against capacity factor under uniform random routing: binomial tail "
        "(lines) and Monte-Carlo means (markers). The axis starts at $10^{-6}$, about the "
        "Monte-Carlo resolution; means of zero cannot show on the log scale.",
        xlabel="capacity factor",
        ylabel="dropped fraction of assignments",
        logy=True,
        ymin=1e-6,
        series=tuple(series),
    )


def _loss_table(losses: Sequence[RunRecord]) -> Table:
    """The Switch loss under uniform router probabilities against its coefficient, per source."""
    return table_from_rows(
        "switch-loss",
        "Switch load-balancing loss $\\alpha E\\sum_e f_e P_e$ under uniform router probabilities "
        "equals its coefficient $\\alpha$ whatever the dispatch (here a skewed random dispatch). "
        "Source: formula = the plain-PyTorch reference; moe = \\texttt{moe.MoE}'s own "
        "\\texttt{last\\_aux\\_loss} with a zeroed router (its top-$k$ ties send every token to "
        "the same experts).",
        [
            ("source", "Source", ""),
            ("experts", "$E$", "d"),
            ("top_k", "$k$", "d"),
            ("coefficient", "Coefficient", ".3g"),
            ("loss", "Loss", ".6g"),
            ("abs_error", "$|\\mathrm{loss}-\\alpha|$", ".1e"),
        ],
        [
            {
                "source": r.config.source,
                "experts": r.config.num_experts,
                "top_k": r.config.top_k,
                "coefficient": r.config.coefficient,
                **r.result,
            }
            for r in losses
        ],
    )


EXPERIMENT = Experiment(
    name="switch-tables",
    description="Switch Transformer tables from a tiny MoE LM trained on this CPU (loss vs experts at fixed "
    "active FLOPs, capacity factor vs drops, aux coefficient vs imbalance) and exact checks (binomial drop "
    "fraction, Switch loss = coefficient under uniform routing)",
    plan=plan,
    runners={
        DropCheckConfig: run_drop_check,
        SwitchLossCheckConfig: run_loss_check,
        TinyTrainConfig: run_training,
        ThroughputConfig: run_throughput,
    },
    summarize=summarize,
)
