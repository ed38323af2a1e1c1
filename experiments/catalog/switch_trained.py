"""The trained part of ``switch-tables``: a tiny MoE LM trained on this CPU, in the shape of Switch
Transformer's tables (Fedus et al., arXiv 2101.03961, Table 1 and the expert-count scaling of Sec. 3).

Three sweeps of :class:`experiments.tiny_moe_lm.TinyTrainConfig` around one base model (top-1 ``switch``
router, Switch load-balancing loss 1e-2, dropless), each run one training from scratch with the same seeded
batches:

- **experts**: dense SwiGLU FFN against E = 2, 4, 8, 16 experts of the same hidden size, so the active
  FLOPs per token stay (almost: the router adds 2DE) those of the dense model while parameters grow with E;
- **capacity**: E = 8 with capacity factors 0.5, 1.0, 1.25, 2.0 and dropless: dropped fraction against
  held-out loss;
- **aux**: E = 8, capacity factor 1.25, Switch-loss coefficient 0, 1e-3, 1e-2, 1e-1: load imbalance
  (max/mean expert load, coefficient of variation, before dropping) and what it costs in drops and loss.

Points shared by two sweeps (e.g. E = 8 dropless) are one run. Runs with several seeds are averaged in the
tables. One more run (:class:`ThroughputConfig`) times training steps of the experts and capacity models
side by side, for the tables' tokens/s. Each training writes the checkpoint ``model.safetensors`` beside
its results; ``moe-verify-cost`` reads the routing of held-out text from it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from experiments.config import validate_config
from experiments.runner import RunContext
from experiments.store import RunRecord
from experiments.sweep import Sweep
from experiments.text_corpus import load_corpus, sample_batch
from experiments.tiny_moe_lm import (
    CHECKPOINT_FILE,
    TinyLMConfig,
    TinyMoELM,
    TinyTrainConfig,
    make_optimizer,
    save_checkpoint,
    torch_threads,
    train,
    train_step,
)
from specdec.summary import Figure, Series, Table, table_from_rows

__all__ = [
    "EXPERT_COUNTS",
    "CAPACITY_FACTORS",
    "AUX_COEFFICIENTS",
    "AUX_SWEEP_CAPACITY_FACTOR",
    "SEEDS",
    "base_config",
    "trained_sweeps",
    "run_training",
    "ThroughputConfig",
    "run_throughput",
    "trained_tables",
    "trained_figures",
]

EXPERT_COUNTS = (0, 2, 4, 8, 16)  # 0: the dense baseline
CAPACITY_FACTORS: tuple[float | None, ...] = (0.5, 1.0, 1.25, 2.0, None)  # None: dropless
AUX_COEFFICIENTS = (0.0, 1e-3, 1e-2, 1e-1)
AUX_SWEEP_CAPACITY_FACTOR = 1.25  # Switch's training default: imbalance shows up as dropped tokens
BASE_EXPERTS = 8
SEEDS = (0, 1, 2)  # weights and batches; the tables show the mean and the std over seeds
BASE_AUX = 1e-2


def base_config(*, smoke: bool = False) -> TinyTrainConfig:
    """The base run: E = 8 top-1 Switch routing, dropless, aux 1e-2 (tiny sizes for ``smoke``)."""
    if smoke:
        model = TinyLMConfig(dim=16, heads=2, layers=1, seq_len=16, hidden_dim=16, num_experts=BASE_EXPERTS)
        return TinyTrainConfig(
            model=model, steps=4, batch_size=4, eval_interval=2, eval_sequences=4, max_corpus_bytes=1 << 16
        )
    model = TinyLMConfig(dim=64, heads=4, layers=2, seq_len=64, hidden_dim=128, num_experts=BASE_EXPERTS)
    return TinyTrainConfig(model=model, steps=2000, batch_size=16, eval_interval=100, eval_sequences=256)


def trained_sweeps(*, smoke: bool = False) -> tuple[Sweep, ...]:
    """The experts, capacity-factor and aux-coefficient sweeps (shared points run once), and the
    side-by-side throughput run."""
    base = base_config(smoke=smoke)
    experts = (0, BASE_EXPERTS) if smoke else EXPERT_COUNTS  # smoke: 4 distinct runs
    factors = (AUX_SWEEP_CAPACITY_FACTOR, None) if smoke else CAPACITY_FACTORS
    coefs = (0.0, BASE_AUX) if smoke else AUX_COEFFICIENTS
    seeds = [0] if smoke else list(SEEDS)
    throughput = ThroughputConfig(
        base=base,
        experts=experts,
        capacity_factors=tuple(f for f in factors if f is not None),
        rounds=2 if smoke else 10,
        steps_per_round=2 if smoke else 10,
        warmup_steps=1 if smoke else 3,
    )
    return (
        Sweep(throughput),
        Sweep(base, {"model.num_experts": list(experts), "seed": seeds}),
        Sweep(base, {"model.capacity_factor": list(factors), "seed": seeds}),
        Sweep(
            base,
            {
                "model.capacity_factor": [AUX_SWEEP_CAPACITY_FACTOR],
                "model.aux_loss_coef": list(coefs),
                "seed": seeds,
            },
        ),
    )


def run_training(config: TinyTrainConfig, ctx: RunContext) -> dict[str, Any]:
    """Train one tiny LM; every step to ``metrics.jsonl``; the weights to ``model.safetensors``."""
    total = config.steps

    def log(metrics: dict[str, Any], step: int) -> None:
        ctx.log(metrics, step=step)
        if step == total or step % max(1, total // 10) == 0:
            extra = f", held-out {metrics['eval_loss']:.4f}" if "eval_loss" in metrics else ""
            print(f"    step {step}/{total}: loss {metrics['loss']:.4f}{extra}", flush=True)

    model, result = train(config, log=log)
    save_checkpoint(model, ctx.run_dir / CHECKPOINT_FILE)
    return result


@dataclass(frozen=True, kw_only=True)
class ThroughputConfig:
    """Training throughput of the experts and capacity-factor models, measured side by side in one run.

    Every model (``base`` with E in ``experts``; E = 8 with each of ``capacity_factors``) takes
    ``steps_per_round`` training steps in turn (a rotating order), for ``rounds`` rounds, on the same
    batches; tokens/s is
    the tokens of a step over the model's median step time. Interleaving exposes all models to the same
    background load, so their ratios mean something on a shared machine; separate runs' times do not.
    """

    base: TinyTrainConfig
    experts: tuple[int, ...] = EXPERT_COUNTS
    capacity_factors: tuple[float, ...] = (0.5, 1.0, 1.25, 2.0)
    rounds: int = 10
    steps_per_round: int = 10
    warmup_steps: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        validate_config(self)
        if min(self.rounds, self.steps_per_round) < 1 or self.warmup_steps < 0:
            raise ValueError(
                "ThroughputConfig needs rounds >= 1, steps_per_round >= 1, warmup_steps >= 0, got "
                f"{self.rounds}, {self.steps_per_round}, {self.warmup_steps}"
            )

    def variants(self) -> dict[str, TinyLMConfig]:
        """Name -> model config: ``E=<n>`` (dropless) and ``cf=<f>`` (E = 8)."""
        m = self.base.model
        out = {f"E={e}": dataclasses.replace(m, num_experts=e, capacity_factor=None) for e in self.experts}
        for cf in self.capacity_factors:
            out[f"cf={cf:g}"] = dataclasses.replace(m, num_experts=BASE_EXPERTS, capacity_factor=cf)
        return out


def run_throughput(config: ThroughputConfig, ctx: RunContext) -> dict[str, Any]:
    """Interleaved training steps of every variant; median tokens/s and the ratio to the dense model."""
    base = config.base
    corpus = load_corpus(base.corpus, heldout_every=base.heldout_every, max_bytes=base.max_corpus_bytes)
    generator = torch.Generator().manual_seed(config.seed)
    models = {}
    for name, model_config in config.variants().items():
        torch.manual_seed(config.seed)
        model = TinyMoELM(model_config).train()
        models[name] = (model, make_optimizer(model, base.lr))
    seconds: dict[str, list[float]] = {name: [] for name in models}
    tokens = base.batch_size * base.model.seq_len
    with torch_threads(base.threads):
        for round_ in range(config.rounds):
            batches = [
                sample_batch(corpus.train, base.batch_size, base.model.seq_len, generator)
                for _ in range(config.warmup_steps + config.steps_per_round)
            ]
            names = list(models)
            shift = round_ % len(names)  # rotate who goes first: no model always follows the same one
            for name in names[shift:] + names[:shift]:
                model, optimizer = models[name]
                for i, (inputs, targets) in enumerate(batches):
                    started = time.perf_counter()
                    train_step(model, optimizer, inputs, targets, base.grad_clip)
                    if i >= config.warmup_steps:  # the first steps after a switch pay for cold caches
                        seconds[name].append(time.perf_counter() - started)
            rates = {name: tokens / statistics.median(times) for name, times in seconds.items()}
            ctx.log({"round": round_, **{f"tokens_per_s/{n}": r for n, r in rates.items()}}, step=round_)
            print(
                f"    round {round_ + 1}/{config.rounds}: "
                + ", ".join(f"{n} {r:,.0f}" for n, r in rates.items())
            )
    dense = rates.get("E=0")
    return {
        "tokens_per_s": rates,
        "ratio_to_dense": {name: rate / dense for name, rate in rates.items()} if dense else None,
        "steps_timed": {name: len(times) for name, times in seconds.items()},
        "threads": base.threads,
    }


# --------------------------------------------------------------------------------------------- summary
def _key(config: TinyTrainConfig) -> tuple:
    m = config.model
    return (m.num_experts, m.capacity_factor, m.aux_loss_coef)


def _mean_over_seeds(records: Sequence[RunRecord]) -> dict[tuple, dict[str, Any]]:
    """Per (E, capacity factor, aux) point: seed-mean of the numbers the tables show, and the loss std."""
    groups: dict[tuple, list[RunRecord]] = {}
    for record in records:
        groups.setdefault(_key(record.config), []).append(record)
    points = {}
    for key, group in groups.items():
        heldout = [r.result["heldout"] for r in group]
        mean = lambda values: statistics.fmean(values) if all(v is not None for v in values) else None  # noqa: E731
        loss = [h["loss"] for h in heldout]
        points[key] = {
            "config": group[0].config,
            "seeds": len(group),
            "loss": mean(loss),
            "loss_std": statistics.stdev(loss) if len(loss) > 1 else None,
            "ppl": math.exp(mean(loss)),
            "bpb": mean(loss) / math.log(2),
            "eval_drop": mean([h.get("drop_fraction") for h in heldout]),
            "train_drop": mean([r.result["train_drop_fraction"] for r in group]),
            "max_over_mean": mean([h.get("load_max_over_mean") for h in heldout]),
            "cv": mean([h.get("load_cv") for h in heldout]),
            "params_total": group[0].result["params_total"],
            "params_active": group[0].result["params_active"],
            "flops": group[0].result["active_flops_per_token"],
            "curve": _mean_curve([r.result["curve"] for r in group]),
            "train_tokens": group[0].result["train_tokens"],
            "corpus": group[0].result["corpus"],
        }
    return points


def _mean_curve(curves: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Held-out loss per evaluation step, averaged over the seeds (steps every seed evaluated)."""
    steps = sorted(set.intersection(*({c["step"] for c in curve} for curve in curves)))
    by_step = [{c["step"]: c["loss"] for c in curve} for curve in curves]
    return [{"step": s, "loss": statistics.fmean(b[s] for b in by_step)} for s in steps]


def _sizes(point: dict[str, Any]) -> str:
    c = point["config"]
    m = c.model
    corpus = point["corpus"]
    return (
        f"byte-level decoder, {m.layers} layers, $d={m.dim}$, {m.heads} heads, context {m.seq_len}, "
        f"expert/FFN hidden {m.hidden_dim}; {c.steps} steps of {c.batch_size}$\\times${m.seq_len} bytes "
        f"({point['train_tokens'] / 1e6:.2f}M tokens) on Python {corpus['corpus']} sources "
        f"({corpus['train_bytes'] / 1e6:.1f} MB train, {corpus['heldout_bytes'] / 1e3:.0f} kB "
        "held-out files); "
        f"held-out loss in nats/byte over {c.eval_sequences} windows"
    )


def _variant(model: TinyLMConfig) -> str:
    """The model's name in ThroughputConfig.variants."""
    factor = model.capacity_factor
    return f"E={model.num_experts}" if factor is None else f"cf={factor:g}"


def _factor_text(factor: float | None) -> str:
    return "dropless" if factor is None else f"{factor:g}"


def _capacity(factor: float | None, tokens: int) -> int | None:
    return None if factor is None else math.ceil(factor * tokens / BASE_EXPERTS)


def _seed_note(points: Sequence[dict[str, Any]]) -> str:
    seeds = sorted({p["seeds"] for p in points})
    if seeds == [1]:
        return "One seed per point (same batches for every run)."
    return f"Mean over {'/'.join(map(str, seeds))} seeds; $\\pm$: std over seeds."


def _with_std(columns: list[tuple[str, str, str]], points: Sequence[dict[str, Any]]) -> list:
    if any(p["seeds"] > 1 for p in points):
        i = [c[0] for c in columns].index("loss") + 1
        columns.insert(i, ("loss_std", "$\\pm$", ".3f"))
    return columns


def _experts_points(points: dict[tuple, dict[str, Any]]) -> list[dict[str, Any]]:
    """The dropless, base-coefficient points, by E (dense first)."""
    chosen = [p for (_, cf, aux), p in points.items() if cf is None and aux == BASE_AUX]
    return sorted(chosen, key=lambda p: p["config"].model.num_experts)


def _capacity_points(points: dict[tuple, dict[str, Any]]) -> list[dict[str, Any]]:
    """The E = 8, base-coefficient points, by capacity factor (dropless last)."""
    chosen = [p for (e, _, aux), p in points.items() if e == BASE_EXPERTS and aux == BASE_AUX]
    factor = lambda p: p["config"].model.capacity_factor  # noqa: E731
    return sorted(chosen, key=lambda p: math.inf if factor(p) is None else factor(p))


def _aux_points(points: dict[tuple, dict[str, Any]]) -> list[dict[str, Any]]:
    """The E = 8, capacity-factor-1.25 points, by coefficient."""
    chosen = [p for (e, cf, _), p in points.items() if e == BASE_EXPERTS and cf == AUX_SWEEP_CAPACITY_FACTOR]
    return sorted(chosen, key=lambda p: p["config"].model.aux_loss_coef)


def _throughput(records: Sequence[RunRecord]) -> tuple[dict[str, float], dict[str, float], str]:
    """Tokens/s and ratio to dense by variant name from the side-by-side run (empty if none), and a note."""
    runs = [r for r in records if isinstance(r.config, ThroughputConfig)]
    if not runs:
        return {}, {}, "Tokens/s: not measured (no throughput run)."
    run = runs[0]
    c = run.config
    note = (
        "Tokens/s: training steps of all models measured side by side in one run, interleaved "
        f"({c.rounds} rounds of {c.steps_per_round} steps each, median step, freshly initialised, "
        f"{c.base.threads} thread), on a shared 2-core CPU."
    )
    return run.result["tokens_per_s"], run.result["ratio_to_dense"] or {}, note


def trained_tables(records: Sequence[RunRecord]) -> list[Table]:
    """Tables (a) experts at fixed active FLOPs, (b) capacity factor, (c) aux-loss coefficient."""
    throughput = _throughput(records)
    points = _mean_over_seeds([r for r in records if isinstance(r.config, TinyTrainConfig)])
    experts, capacity, aux = _experts_points(points), _capacity_points(points), _aux_points(points)
    return (
        ([_experts_table(experts, throughput)] if experts else [])
        + ([_capacity_table(capacity, throughput)] if capacity else [])
        + ([_aux_table(aux)] if aux else [])
    )


def _experts_table(experts: list[dict], throughput: tuple[dict, dict, str]) -> Table:
    """(a) Loss, load balance and speed against the number of experts at fixed active FLOPs."""
    rates, ratios, rate_note = throughput
    dense = next((p for p in experts if p["config"].model.dense), None)
    rows = []
    for p in experts:
        m = p["config"].model
        rows.append(
            {
                "model": "dense" if m.dense else f"Switch top-{m.top_k}",
                "experts": None if m.dense else m.num_experts,
                "params": p["params_total"] / 1e6,
                "active": p["params_active"] / 1e6,
                "flops": p["flops"] / 1e6,
                "loss": p["loss"],
                "loss_std": p["loss_std"],
                "ppl": p["ppl"],
                "delta": p["loss"] - dense["loss"] if dense else None,
                "cv": p["cv"],
                "tokens_per_s": rates.get(f"E={m.num_experts}"),
                "speed": ratios.get(f"E={m.num_experts}"),
            }
        )
    columns = [
        ("model", "Model", ""),
        ("experts", "$E$", "d"),
        ("params", "Params (M)", ".3f"),
        ("flops", "MFLOP/tok", ".3f"),
        ("loss", "Loss", ".4f"),
        ("ppl", "PPL", ".3f"),
        ("delta", "$\\Delta$", "+.4f"),
        ("cv", "Load CV", ".2f"),
        ("tokens_per_s", "Tok/s", ".0f"),
        ("speed", "Speed", ".2f"),
    ]
    return table_from_rows(
        "experts",
        "Loss against the number of experts at fixed active FLOPs (the shape of Switch "
        "Transformer's scaling comparison, arXiv 2101.03961): a dense SwiGLU FFN against top-1 "
        "Switch routing over $E$ experts of the same hidden size, dropless, load-balancing "
        "coefficient $10^{-2}$. MFLOP/tok: forward matmul FLOPs per token, i.e. active FLOPs (the "
        f"router adds $2dE$). Tiny sizes: {_sizes(experts[0])}. Loss: held-out, nats/byte; PPL: per "
        "byte; $\\Delta$: loss minus the dense loss. Load CV: coefficient of variation of the "
        f"held-out expert load, mean over layers. {rate_note} Speed: tokens/s over the dense "
        "model's. " + _seed_note(experts),
        _with_std(columns, experts),
        rows,
    )


def _capacity_table(capacity: list[dict], throughput: tuple[dict, dict, str]) -> Table:
    """(b) Dropped tokens and loss against the capacity factor."""
    rates, ratios, rate_note = throughput
    dropless = next((p for p in capacity if p["config"].model.capacity_factor is None), None)
    c = capacity[0]["config"]
    tokens = c.batch_size * c.model.seq_len
    columns = [
        ("cf", "cf", ""),
        ("capacity", "$C$", "d"),
        ("train_drop", "Drop (train)", ".4f"),
        ("eval_drop", "Drop (held-out)", ".4f"),
        ("loss", "Loss", ".4f"),
        ("delta", "$\\Delta$", "+.4f"),
        ("tokens_per_s", "Tok/s", ".0f"),
        ("speed", "Speed", ".2f"),
    ]
    return table_from_rows(
        "capacity",
        f"Capacity factor against dropped tokens and loss ($E={BASE_EXPERTS}$, top-1 Switch, "
        "coefficient $10^{-2}$; the shape of Switch Transformer's Table 1): each expert takes at "
        f"most $C=\\lceil \\mathrm{{cf}}\\cdot T/E\\rceil$ of the $T={tokens}$ tokens of a batch "
        "(held-out batches have the same size); a dropped token skips the FFN through the residual. "
        "Drop: dropped fraction of tokens, mean over training steps and over the held-out batches. "
        "Loss: held-out, nats/byte; $\\Delta$: loss minus the dropless loss. Same tiny model and "
        f"data as the experts table. {rate_note} Speed: tokens/s over the dense model's. "
        + _seed_note(capacity),
        _with_std(columns, capacity),
        [
            {
                "cf": _factor_text(p["config"].model.capacity_factor),
                "capacity": _capacity(p["config"].model.capacity_factor, tokens),
                "train_drop": p["train_drop"],
                "eval_drop": p["eval_drop"],
                "loss": p["loss"],
                "loss_std": p["loss_std"],
                "delta": p["loss"] - dropless["loss"] if dropless else None,
                "tokens_per_s": rates.get(_variant(p["config"].model)),
                "speed": ratios.get(_variant(p["config"].model)),
            }
            for p in capacity
        ],
    )


def _aux_table(aux: list[dict]) -> Table:
    """(c) Load imbalance and loss against the load-balancing coefficient."""
    columns = [
        ("coef", "Coefficient", "g"),
        ("max_over_mean", "Max/mean load", ".2f"),
        ("cv", "Load CV", ".3f"),
        ("eval_drop", "Drop (held-out)", ".4f"),
        ("loss", "Loss", ".4f"),
    ]
    return table_from_rows(
        "aux-loss",
        "Switch load-balancing loss coefficient against load imbalance and loss "
        f"($E={BASE_EXPERTS}$, top-1, capacity factor {AUX_SWEEP_CAPACITY_FACTOR:g}, so imbalance "
        "costs dropped tokens). Max/mean and CV (population std/mean) of the tokens the router sends "
        "to each expert (before dropping) over the held-out windows, mean over layers; 1 and 0 are "
        "perfect balance. "
        "Same tiny model and data as the experts table. " + _seed_note(aux),
        _with_std(columns, aux),
        [
            {
                "coef": p["config"].model.aux_loss_coef,
                "max_over_mean": p["max_over_mean"],
                "cv": p["cv"],
                "eval_drop": p["eval_drop"],
                "loss": p["loss"],
                "loss_std": p["loss_std"],
            }
            for p in aux
        ],
    )


def trained_figures(records: Sequence[RunRecord]) -> list[Figure]:
    """Held-out loss curves of the experts sweep (mean over seeds)."""
    points = _mean_over_seeds([r for r in records if isinstance(r.config, TinyTrainConfig)])
    experts = _experts_points(points)
    if not experts:
        return []
    series = [
        Series(
            label="dense" if p["config"].model.dense else f"E = {p['config'].model.num_experts}",
            x=[c["step"] for c in p["curve"]],
            y=[c["loss"] for c in p["curve"]],
            style="line+markers",
        )
        for p in experts
    ]
    return [
        Figure(
            name="experts-curves",
            caption="Held-out loss (nats/byte) during training: dense FFN against top-1 Switch routing over "
            "$E$ experts of the same size, at the same active FLOPs per token and the same batches "
            "(tiny byte-level model trained on a shared 2-core CPU; sizes in the experts table; mean over "
            "seeds).",
            xlabel="training step",
            ylabel="held-out loss (nats/byte)",
            series=tuple(series),
        )
    ]
