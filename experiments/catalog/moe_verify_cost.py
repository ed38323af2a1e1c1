"""``moe-verify-cost``: distinct experts touched when a MoE target verifies n tokens in one call.

Under uniform top-k routing the expected number is E(1 − (1 − k/E)ⁿ)
(:func:`experiments.theory.moe_routing.expected_distinct_experts`). In a memory-bound decode step
the expert weights loaded scale with it, so a verify call over n = γ + 1 tokens costs far more than
one token on a sparse model: the reason EAGLE (arXiv 2401.15077) reports a smaller speedup on Mixtral
than on dense models. Measured counts come from a routing source in :data:`ROUTING_SOURCES`:
``uniform`` (the formula's assumption) and ``skewed`` (Zipf-like imbalance) now; a source that routes
real tokens through ``moe.MoE`` plugs in by name with the same signature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from experiments.config import validate_config
from experiments.experiment import Experiment
from experiments.runner import RunContext
from experiments.store import RunRecord
from experiments.summary import Figure, Series, Summary, table_from_rows
from experiments.sweep import Sweep
from experiments.theory.moe_routing import (
    RouteFn,
    expected_distinct_experts,
    measure_distinct_experts,
    random_topk_routing,
)
from specdec.registry import Registry

__all__ = ["MODEL_SHAPES", "VerifyCostConfig", "ROUTING_SOURCES", "plan", "run_verify_cost", "EXPERIMENT"]

# Routed-expert shapes (E, k) of public MoE models (shared experts excluded).
MODEL_SHAPES: dict[str, tuple[int, int]] = {
    "Mixtral-8x7B": (8, 2),
    "DeepSeekMoE-16B": (64, 6),
    "Qwen3-30B-A3B": (128, 8),
    "DeepSeek-V3": (256, 8),
}
TABLE_BLOCKS = (1, 2, 4, 8, 16)


@dataclass(frozen=True, kw_only=True)
class VerifyCostConfig:
    """One MoE shape and routing source, measured over verify blocks of n = 1..max_block tokens."""

    model: str
    num_experts: int
    top_k: int
    routing: str = "uniform"
    skew: float = 0.0
    max_block: int = 16
    num_tokens: int = 32768
    seed: int = 0

    def __post_init__(self) -> None:
        validate_config(self)
        expected_distinct_experts(self.num_experts, self.top_k, 1)  # range checks
        if self.max_block < 1 or self.num_tokens < self.max_block:
            raise ValueError(
                "need 1 <= max_block <= num_tokens, "
                f"got max_block={self.max_block}, num_tokens={self.num_tokens}"
            )


def uniform_source(config: VerifyCostConfig) -> RouteFn:
    """k distinct experts per token, uniformly at random (the closed form's assumption)."""
    return random_topk_routing(config.num_experts, config.top_k)


def skewed_source(config: VerifyCostConfig) -> RouteFn:
    """k distinct experts per token with P(e) ∝ (e+1)^(−skew): a load-imbalanced router."""
    return random_topk_routing(config.num_experts, config.top_k, skew=config.skew)


ROUTING_SOURCES = Registry(
    "routing source",
    "specdec.routing_sources",
    builtins={
        "uniform": "experiments.catalog.moe_verify_cost:uniform_source",
        "skewed": "experiments.catalog.moe_verify_cost:skewed_source",
    },
)
"""Name -> ``factory(config) -> route(num_tokens, generator) -> expert_ids_TK``."""


def plan(*, smoke: bool = False) -> Sweep:
    """Each model shape under uniform and skewed (Zipf s = 1) routing."""
    shapes = list(MODEL_SHAPES.items())[: 2 if smoke else None]
    base = VerifyCostConfig(
        model="Mixtral-8x7B",
        num_experts=8,
        top_k=2,
        max_block=8 if smoke else 16,
        num_tokens=2048 if smoke else 65536,
    )
    return Sweep(
        base,
        {
            "model,num_experts,top_k": [(name, e, k) for name, (e, k) in shapes],
            "routing,skew": [("uniform", 0.0), ("skewed", 1.0)],
        },
    )


def run_verify_cost(config: VerifyCostConfig, ctx: RunContext) -> dict:
    """Route ``num_tokens`` tokens, then count distinct experts per block of n for n = 1..max_block."""
    route = ROUTING_SOURCES.get(config.routing)(config)
    generator = torch.Generator().manual_seed(config.seed)
    sizes = list(range(1, config.max_block + 1))
    counts = measure_distinct_experts(
        route, config.num_experts, sizes, num_tokens=config.num_tokens, generator=generator
    )
    blocks, formula, measured, sem = [], [], [], []
    for n in sizes:
        counts_B = counts[n].double()
        mean = counts_B.mean().item()
        err = (counts_B.std() / counts_B.numel() ** 0.5).item() if counts_B.numel() > 1 else float("nan")
        expected = expected_distinct_experts(config.num_experts, config.top_k, n)
        ctx.log(
            {"n": n, "formula": expected, "measured": mean, "sem": err, "blocks": counts_B.numel()}, step=n
        )
        blocks.append(n)
        formula.append(expected)
        measured.append(mean)
        sem.append(err)
    return {"n": blocks, "formula": formula, "measured": measured, "sem": sem}


def summarize(records: Sequence[RunRecord]) -> Summary:
    """Formula beside measurement per model and n; and the fraction of experts touched against n."""
    by_key = {(r.config.model, r.config.routing): r for r in records}
    models = list(dict.fromkeys(r.config.model for r in records))
    rows = []
    for model in models:
        uniform, skewed = by_key.get((model, "uniform")), by_key.get((model, "skewed"))
        ref = uniform or skewed
        for n in TABLE_BLOCKS:
            if n > ref.config.max_block:
                continue
            i = n - 1
            formula = ref.result["formula"][i]
            rows.append(
                {
                    "model": model,
                    "experts": f"{ref.config.num_experts}/{ref.config.top_k}",
                    "n": n,
                    "formula": formula,
                    "uniform": uniform.result["measured"][i] if uniform else None,
                    "skewed": skewed.result["measured"][i] if skewed else None,
                    "traffic": formula / ref.config.top_k,
                }
            )
    num_tokens = sorted({r.config.num_tokens for r in records})
    table = table_from_rows(
        "distinct-experts",
        "Distinct experts touched when verifying $n$ tokens in one call: the formula "
        "$E(1-(1-k/E)^n)$ beside Monte-Carlo counts under uniform random top-$k$ routing and under a "
        "skewed (Zipf, $s=1$) router, over non-overlapping blocks of "
        f"{', '.join(str(t) for t in num_tokens)} routed tokens. Traffic: expert weights read relative to "
        "one token ($=$ formula$/k$). Routing is simulated, not taken from the models named.",
        [
            ("model", "Model shape", ""),
            ("experts", "$E/k$", ""),
            ("n", "$n$", "d"),
            ("formula", "Formula", ".2f"),
            ("uniform", "Uniform (meas.)", ".2f"),
            ("skewed", "Skewed (meas.)", ".2f"),
            ("traffic", "Traffic", ".2f"),
        ],
        rows,
    )
    series = []
    for model in models:
        for routing, style in (("uniform", "markers"), ("skewed", "dashed")):
            record = by_key.get((model, routing))
            if record is None:
                continue
            E = record.config.num_experts
            if routing == "uniform":
                series.append(
                    Series(
                        label=f"{model} formula",
                        x=record.result["n"],
                        y=[v / E for v in record.result["formula"]],
                        style="line",
                        group=model,
                    )
                )
            series.append(
                Series(
                    label=f"{model} {routing}",
                    x=record.result["n"],
                    y=[v / E for v in record.result["measured"]],
                    style=style,
                    group=model,
                )
            )
    figure = Figure(
        name="distinct-experts",
        caption="Fraction of experts touched by a verify block of $n$ tokens: formula (lines), uniform "
        "random routing (markers) and skewed routing (dashed).",
        xlabel="tokens per verify call $n$",
        ylabel="fraction of experts touched",
        series=tuple(series),
    )
    return Summary(
        title="Expert traffic of verifying n tokens on a MoE target",
        tables=(table,),
        figures=(figure,),
        notes="Simulated routing (Monte-Carlo); no timing, so no hardware dependence.",
    )


EXPERIMENT = Experiment(
    name="moe-verify-cost",
    description="Distinct experts touched when verifying n tokens, E(1-(1-k/E)^n), "
    "against routed-token counts",
    plan=plan,
    runners={VerifyCostConfig: run_verify_cost},
    summarize=summarize,
)
