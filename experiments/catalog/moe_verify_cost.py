"""``moe-verify-cost``: distinct experts touched when a MoE target verifies n tokens in one call.

Under uniform top-k routing the expected number is E(1 − (1 − k/E)ⁿ)
(:func:`experiments.theory.moe_routing.expected_distinct_experts`). In a memory-bound decode step
the expert weights loaded scale with it, so a verify call over n = γ + 1 tokens costs far more than
one token on a sparse model: the reason EAGLE (arXiv 2401.15077) reports a smaller speedup on Mixtral
than on dense models. Measured counts come from a routing source in :data:`ROUTING_SOURCES`:
``uniform`` (the formula's assumption) and ``skewed`` (Zipf-like imbalance); a new source plugs in by
name with the same signature.

Real routing (:class:`TrainedVerifyCostConfig`): the tiny byte-level MoE LM that ``switch-tables``
trains (:mod:`experiments.tiny_moe_lm`; its checkpoint is read from ``<out>/switch-tables/<run_id>/``
when that run is finished, else the model is trained here) routes contiguous held-out text, and the
distinct experts of every block of n consecutive tokens are counted per MoE layer. Beside the real
count: the same routing with the tokens shuffled (independent tokens with the measured, imbalanced
expert loads), so that formula − shuffled is the effect of load imbalance and shuffled − real the
effect of correlation between neighbouring tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from experiments.catalog.switch_trained import base_config
from experiments.config import run_id, validate_config
from experiments.experiment import Experiment
from experiments.runner import RunContext
from experiments.store import RunRecord, experiment_dir, is_finished
from experiments.sweep import Sweep
from experiments.text_corpus import load_corpus
from experiments.theory.moe_routing import (
    RouteFn,
    expected_distinct_experts,
    measure_distinct_experts,
    random_topk_routing,
)
from experiments.tiny_moe_lm import (
    CHECKPOINT_FILE,
    TinyMoELM,
    TinyTrainConfig,
    load_checkpoint,
    load_imbalance,
    routed_experts,
    save_checkpoint,
    torch_threads,
    train,
)
from specdec.registry import Registry
from specdec.summary import Figure, Series, Summary, Table, series_from_points, table_from_rows

__all__ = [
    "MODEL_SHAPES",
    "TRAINED_MODELS",
    "VerifyCostConfig",
    "TrainedVerifyCostConfig",
    "ROUTING_SOURCES",
    "plan",
    "run_verify_cost",
    "run_trained_verify_cost",
    "EXPERIMENT",
]

# Routed-expert shapes (E, k) of public MoE models (shared experts excluded).
MODEL_SHAPES: dict[str, tuple[int, int]] = {
    "Mixtral-8x7B": (8, 2),
    "DeepSeekMoE-16B": (64, 6),
    "Qwen3-30B-A3B": (128, 8),
    "DeepSeek-V3": (256, 8),
}
TABLE_BLOCKS = (1, 2, 4, 8, 16)
# (E, capacity factor, Switch-loss coefficient) of the switch-tables models whose routing is measured.
TRAINED_MODELS: tuple[tuple[int, float | None, float], ...] = (
    (8, None, 1e-2),
    (16, None, 1e-2),
    (8, 1.25, 0.0),
)


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


@dataclass(frozen=True, kw_only=True)
class TrainedVerifyCostConfig:
    """Real routing of ``num_tokens`` contiguous held-out bytes by the tiny MoE LM ``train`` trains."""

    train: TinyTrainConfig
    max_block: int = 16
    num_tokens: int = 65536
    seed: int = 0

    def __post_init__(self) -> None:
        validate_config(self)
        if self.train.model.dense:
            raise ValueError("TrainedVerifyCostConfig.train must train a MoE model (num_experts >= 1)")
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


def plan(*, smoke: bool = False) -> tuple[Sweep, ...]:
    """Each model shape under uniform and skewed (Zipf s = 1) routing; the trained tiny LMs' real routing."""
    shapes = list(MODEL_SHAPES.items())[: 2 if smoke else None]
    base = VerifyCostConfig(
        model="Mixtral-8x7B",
        num_experts=8,
        top_k=2,
        max_block=8 if smoke else 16,
        num_tokens=2048 if smoke else 65536,
    )
    simulated = Sweep(
        base,
        {
            "model,num_experts,top_k": [(name, e, k) for name, (e, k) in shapes],
            "routing,skew": [("uniform", 0.0), ("skewed", 1.0)],
        },
    )
    trained = Sweep(
        TrainedVerifyCostConfig(
            train=base_config(smoke=smoke), max_block=8 if smoke else 16, num_tokens=1024 if smoke else 65536
        ),
        {
            "train.model.num_experts,train.model.capacity_factor,train.model.aux_loss_coef": list(
                TRAINED_MODELS[:1] if smoke else TRAINED_MODELS
            )
        },
    )
    return simulated, trained


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


def _trained_model(config: TrainedVerifyCostConfig, ctx: RunContext) -> tuple[TinyMoELM, str]:
    """The switch-tables checkpoint of ``config.train`` from the same output folder, or a fresh training."""
    source = experiment_dir(ctx.run_dir.parents[1], "switch-tables") / run_id(config.train)
    if is_finished(source) and (source / CHECKPOINT_FILE).is_file():
        print(f"    routing from the checkpoint {source / CHECKPOINT_FILE}", flush=True)
        return load_checkpoint(config.train.model, source / CHECKPOINT_FILE), f"switch-tables/{source.name}"
    print(f"    no finished switch-tables run {source}: training the model here", flush=True)
    model, _ = train(config.train, log=lambda metrics, step: ctx.log({"train": metrics}, step=step))
    save_checkpoint(model, ctx.run_dir / CHECKPOINT_FILE)
    return model, f"trained in moe-verify-cost/{ctx.run_id}"


def run_trained_verify_cost(config: TrainedVerifyCostConfig, ctx: RunContext) -> dict:
    """Distinct experts per block of n consecutive held-out tokens, per layer: real, shuffled, formula."""
    model, source = _trained_model(config, ctx)
    train = config.train
    corpus = load_corpus(train.corpus, heldout_every=train.heldout_every, max_bytes=train.max_corpus_bytes)
    with torch_threads(train.threads):
        experts_LTK = routed_experts(model, corpus.heldout, config.num_tokens)
    E, k = train.model.num_experts, train.model.top_k
    sizes = list(range(1, config.max_block + 1))
    generator = torch.Generator().manual_seed(config.seed)
    real_Ln, shuffled_Ln = [], []
    for ids_TK in experts_LTK:
        permutation = torch.randperm(ids_TK.shape[0], generator=generator)
        for counts, route in (
            (real_Ln, lambda T, _g, ids=ids_TK: ids[:T]),
            (shuffled_Ln, lambda T, _g, ids=ids_TK[permutation]: ids[:T]),
        ):
            per_n = measure_distinct_experts(
                route, E, sizes, num_tokens=config.num_tokens, generator=generator
            )
            counts.append([per_n[n].double().mean().item() for n in sizes])
    mean = lambda rows, i: sum(row[i] for row in rows) / len(rows)  # noqa: E731
    result = {"n": sizes, "formula": [], "measured": [], "shuffled": []}
    for i, n in enumerate(sizes):
        row = {
            "n": n,
            "formula": expected_distinct_experts(E, k, n),
            "measured": mean(real_Ln, i),
            "shuffled": mean(shuffled_Ln, i),
            "measured_per_layer": [row[i] for row in real_Ln],
        }
        ctx.log(row)
        for key in ("formula", "measured", "shuffled"):
            result[key].append(row[key])
    loads = [load_imbalance(torch.bincount(ids.reshape(-1), minlength=E)) for ids in experts_LTK]
    return {
        **result,
        "measured_per_layer": real_Ln,
        "shuffled_per_layer": shuffled_Ln,
        "load_max_over_mean_per_layer": [x["max_over_mean"] for x in loads],
        "load_cv_per_layer": [x["cv"] for x in loads],
        "checkpoint": source,
        "corpus": corpus.info,
    }


def _trained_label(config: TrainedVerifyCostConfig) -> str:
    m = config.train.model
    cf = "dropless" if m.capacity_factor is None else f"cf {m.capacity_factor:g}"
    return f"tiny LM E={m.num_experts}, aux {m.aux_loss_coef:g}, {cf}"


def _trained_summary(records: Sequence[RunRecord]) -> tuple[list, list]:
    """A table of formula / shuffled / real counts per trained model and n, and a figure of the fractions."""
    rows, series, formula_drawn = [], [], set()
    for r in records:
        m, label = r.config.train.model, _trained_label(r.config)
        loads = r.result["load_max_over_mean_per_layer"]
        for n in TABLE_BLOCKS:
            if n > r.config.max_block:
                continue
            i = n - 1
            rows.append(
                {
                    "model": label,
                    "experts": f"{m.num_experts}/{m.top_k}",
                    "n": n,
                    "formula": r.result["formula"][i],
                    "shuffled": r.result["shuffled"][i],
                    "measured": r.result["measured"][i],
                    "ratio": r.result["measured"][i] / r.result["formula"][i],
                    "imbalance": sum(loads) / len(loads),
                }
            )
        E = m.num_experts
        for key, style, name in (
            ("formula", "line", "formula"),
            ("shuffled", "dashed", "shuffled"),
            ("measured", "markers", "real"),
        ):
            if key == "formula":  # one formula line per (E, k)
                if (E, m.top_k) in formula_drawn:
                    continue
                formula_drawn.add((E, m.top_k))
            y = [v / E for v in r.result[key]]
            text = (
                f"E={E}, k={m.top_k} formula"
                if key == "formula"
                else f"E={E}, aux {m.aux_loss_coef:g} {name}"
            )
            series.append(
                Series(
                    label=text,
                    x=r.result["n"],
                    y=y,
                    style=style,
                    group=label,
                )
            )
    num_tokens = sorted({r.config.num_tokens for r in records})
    train = records[0].config.train
    table = table_from_rows(
        "trained-distinct-experts",
        "Distinct experts touched by $n$ consecutive tokens under real routing: the tiny byte-level MoE "
        f"LMs of \\texttt{{switch-tables}} (top-1 Switch, {train.model.layers} MoE layers, "
        f"$d={train.model.dim}$, {train.steps} training steps on a shared 2-core CPU) route "
        f"{', '.join(str(t) for t in num_tokens)} contiguous bytes of held-out Python source, counted over "
        "non-overlapping blocks and averaged over layers. Formula: $E(1-(1-k/E)^n)$ (uniform, independent "
        "tokens); shuffled: the same routing with the tokens permuted (independent tokens, the measured "
        "imbalanced loads); real: consecutive tokens. Ratio: real/formula. Load: max/mean expert load of "
        "the held-out tokens, mean over layers.",
        [
            ("model", "Model", ""),
            ("experts", "$E/k$", ""),
            ("n", "$n$", "d"),
            ("formula", "Formula", ".2f"),
            ("shuffled", "Shuffled", ".2f"),
            ("measured", "Real", ".2f"),
            ("ratio", "Real/formula", ".2f"),
            ("imbalance", "Load max/mean", ".2f"),
        ],
        rows,
    )
    figure = Figure(
        name="trained-distinct-experts",
        caption="Fraction of experts touched by $n$ consecutive tokens of held-out text under the real "
        "routing of the tiny trained MoE LMs (markers), the same routing with tokens shuffled (dashed) and "
        "the uniform formula (lines).",
        xlabel="tokens per verify call $n$",
        ylabel="fraction of experts touched",
        series=tuple(series),
    )
    return [table], [figure]


def summarize(records: Sequence[RunRecord]) -> Summary:
    """Formula beside measurement per model and n; and the fraction of experts touched against n."""
    trained = [r for r in records if isinstance(r.config, TrainedVerifyCostConfig)]
    records = [r for r in records if isinstance(r.config, VerifyCostConfig)]
    trained_tables, trained_figures = _trained_summary(trained) if trained else ([], [])
    title = "Expert traffic of verifying n tokens on a MoE target"
    if not records:
        return Summary(title=title, tables=tuple(trained_tables), figures=tuple(trained_figures))
    by_key = {(r.config.model, r.config.routing): r for r in records}
    models = list(dict.fromkeys(r.config.model for r in records))
    return Summary(
        title=title,
        tables=(_distinct_table(records, by_key, models), *trained_tables),
        figures=(_distinct_figure(by_key, models), *trained_figures),
        notes="Public model shapes: simulated routing (Monte-Carlo), no timing, so no hardware dependence. "
        "Trained: real routing of held-out text by tiny MoE LMs trained on a shared 2-core CPU.",
    )


def _distinct_table(records: Sequence[RunRecord], by_key: dict, models: list[str]) -> Table:
    """Distinct experts per block of n tokens: the formula beside uniform and skewed measurements."""
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
    return table_from_rows(
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


def _distinct_figure(by_key: dict, models: list[str]) -> Figure:
    """The fraction of experts touched against n per model: formula, uniform and skewed routing."""
    series = []
    for model in models:
        for routing, style in (("uniform", "markers"), ("skewed", "dashed")):
            record = by_key.get((model, routing))
            if record is None:
                continue
            E, n = record.config.num_experts, record.result["n"]
            if routing == "uniform":
                formula = [(x, v / E) for x, v in zip(n, record.result["formula"], strict=True)]
                series.append(
                    series_from_points(formula, label=f"{model} formula", style="line", group=model)
                )
            measured = [(x, v / E) for x, v in zip(n, record.result["measured"], strict=True)]
            series.append(series_from_points(measured, label=f"{model} {routing}", style=style, group=model))
    return Figure(
        name="distinct-experts",
        caption="Fraction of experts touched by a verify block of $n$ tokens: formula (lines), uniform "
        "random routing (markers) and skewed routing (dashed).",
        xlabel="tokens per verify call $n$",
        ylabel="fraction of experts touched",
        series=tuple(series),
    )


EXPERIMENT = Experiment(
    name="moe-verify-cost",
    description="Distinct experts touched when verifying n tokens, E(1-(1-k/E)^n), "
    "against simulated routing and the real routing of a trained tiny MoE LM",
    plan=plan,
    runners={VerifyCostConfig: run_verify_cost, TrainedVerifyCostConfig: run_trained_verify_cost},
    summarize=summarize,
)
