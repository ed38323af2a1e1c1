"""``batch-sweep``: throughput and per-token latency against batch size, plain against speculative.

Speculative decoding spends spare compute to cut latency: a verify call runs γ+1 tokens per row.
At batch size 1 a decode step is memory-bound and the extra tokens are nearly free; as the batch
grows the step becomes compute-bound, the γ+1 tokens per row cost real time, and speculation stops
paying. vLLM's measurements show this ("speculation loses at high load"; see the vLLM
speculative-decoding docs and Spec-Bench, arXiv 2401.07851). This experiment measures, per batch
size, the total decode throughput (tokens of all rows per second, prefill excluded: it is the same
for both methods) and the P50/P99 per-token latency of plain decoding and of speculative decoding
with one drafter, in the same run on the same prompts, and locates the crossover batch size where
the speedup falls below 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from experiments.catalog.specdec_runs import (
    TINY_TARGET,
    category_prompts,
    check_placement,
    drafter_options,
    encode,
    open_run_target,
    torch_threads,
)
from experiments.config import validate_config
from experiments.experiment import Experiment
from experiments.runner import RunContext
from experiments.store import RunRecord
from experiments.sweep import Sweep
from specdec.summary import Figure, Series, Summary, series_from_rows, table_from_rows

__all__ = ["BATCH_SIZES", "BatchConfig", "plan", "run_batch", "crossover", "EXPERIMENT"]

BATCH_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """One batch size: plain and speculative decoding of the same B prompts, ``repeats`` times each."""

    target: str = "smollm2-135m"
    device: str = "cpu"
    """torch device the target (and any draft head or model, which follow it) runs on: cpu, cuda, cuda:1"""
    dtype: str | None = None
    """the target's compute dtype (float32, bfloat16, float16); None: its weights format's own"""
    batch_size: int = 1
    drafter: str = "ngram"
    gamma: int = 4
    temperature: float = 0.0
    prompt_sets: tuple[str, ...] = ("humaneval", "mtbench")
    max_prompt_tokens: int = 64
    max_new_tokens: int = 64
    repeats: int = 2
    chat: bool = True
    seed: int = 0
    lm_corpus_chars: int = 1_500_000
    num_threads: int = 1

    def __post_init__(self) -> None:
        validate_config(self)
        check_placement(self)
        for name in ("batch_size", "gamma", "max_prompt_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"BatchConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_new_tokens < 2:
            raise ValueError(f"BatchConfig.max_new_tokens must be >= 2, got {self.max_new_tokens}")


def plan(*, smoke: bool = False) -> Sweep:
    """Batch sizes 1 to 32 (smoke: 1 and 4 on the tiny target)."""
    if smoke:
        base = BatchConfig(target=TINY_TARGET, max_prompt_tokens=16, max_new_tokens=6)
        return Sweep(base, {"batch_size": [1, 4]})
    return Sweep(BatchConfig(), {"batch_size": list(BATCH_SIZES)})


def _batch_prompts(target, config: BatchConfig) -> list[list[int]]:
    """B prompts taken in turn from each prompt set (evenly spaced within a set), each cut to its
    last ``max_prompt_tokens`` tokens (bounded prefill; the decode phase is what is compared)."""
    per_set = math.ceil(config.batch_size / len(config.prompt_sets))
    by_set = [[(s, t) for t in category_prompts(s, per_set)] for s in config.prompt_sets]
    ordered = [x for j in range(per_set) for texts in by_set if j < len(texts) for x in [texts[j]]]
    ids = [encode(target, s, t, chat=config.chat)[-config.max_prompt_tokens :] for s, t in ordered]
    ids = [ids[i % len(ids)] for i in range(config.batch_size)]  # repeat if the sets ran short
    return ids


def _method_result(metrics: list, batch_size: int) -> dict:
    from specdec.metrics import merge_metrics

    m = merge_metrics(metrics)
    decode_time = m.total_time_s - sum(x.ttft_s for x in metrics)
    decode_tokens = m.num_generated_tokens - batch_size * len(metrics)  # the first token is in TTFT
    return {
        "tokens_per_second": m.tokens_per_second,
        "decode_tokens_per_second": decode_tokens / decode_time if decode_time > 0 else None,
        "latency_p50_ms": m.latency_p50_s * 1e3,
        "latency_p99_ms": m.latency_p99_s * 1e3,
        "tpot_ms": m.tpot_s * 1e3,
        "ttft_ms": sum(x.ttft_s for x in metrics) / len(metrics) * 1e3,
        "tau": m.mean_accepted_tokens,
        "alpha": m.acceptance_rate,
        "num_tokens": m.num_generated_tokens,
        "time_s": m.total_time_s,
    }


def run_batch(config: BatchConfig, ctx: RunContext) -> dict:
    """Plain, then speculative, decoding of one batch, alternating, ``repeats`` times (EOS ignored)."""
    import specdec
    from specdec.registry import create_drafter

    target = open_run_target(config, ctx)
    prompts = _batch_prompts(target, config)
    options = drafter_options(config.drafter, lm_corpus_chars=config.lm_corpus_chars)
    methods = {
        "plain": (create_drafter("none", target), 0),
        "speculative": (create_drafter(config.drafter, target, **options), config.gamma),
    }

    def generate(name: str, rows: list[list[int]], max_new_tokens: int, seed: int):
        drafter, gamma = methods[name]
        return specdec.generate(
            target,
            rows,
            drafter=drafter,
            gamma=gamma,
            temperature=config.temperature,
            max_new_tokens=max_new_tokens,
            seed=seed,
            ignore_eos=True,
        )

    metrics: dict[str, list] = {name: [] for name in methods}
    with torch_threads(config.num_threads) as threads:
        if not ctx.smoke:  # untimed warm-up at this batch size (allocations, weight packing)
            for name in methods:
                generate(name, prompts, 4, config.seed)
        for r in range(config.repeats):
            for name in methods:
                out = generate(name, prompts, config.max_new_tokens, config.seed + r)
                metrics[name].append(out.metrics)
                m = out.metrics
                ctx.log(
                    {
                        "method": name,
                        "repeat": r,
                        "tokens_per_second": m.tokens_per_second,
                        "latency_p50_s": m.latency_p50_s,
                        "latency_p99_s": m.latency_p99_s,
                        "tau": m.mean_accepted_tokens,
                    }
                )
    result = {name: _method_result(ms, config.batch_size) for name, ms in metrics.items()}
    plain, spec = (
        result["plain"]["decode_tokens_per_second"],
        result["speculative"]["decode_tokens_per_second"],
    )
    result["speedup"] = spec / plain if plain and spec else None
    result["torch_threads"] = threads
    return result


def crossover(points: Sequence[tuple[int, float]]) -> float | None:
    """Batch size where the speedup first falls below 1, interpolated linearly in log2(B) between the
    last batch size with speedup ≥ 1 and the next one; None when it never does (or is below 1 at
    the smallest B, returned as that B)."""
    points = sorted(points)
    for (b0, s0), (b1, s1) in zip(points, points[1:], strict=False):
        if s0 >= 1.0 > s1:
            w = (s0 - 1.0) / (s0 - s1)
            return 2 ** (math.log2(b0) + w * (math.log2(b1) - math.log2(b0)))
    if points and points[0][1] < 1.0:
        return float(points[0][0])
    return None


def _row(rec: RunRecord) -> dict:
    p, s = rec.result["plain"], rec.result["speculative"]
    return {
        "batch": rec.config.batch_size,
        "plain_tps": p["decode_tokens_per_second"],
        "spec_tps": s["decode_tokens_per_second"],
        "speedup": rec.result["speedup"],
        "tau": s["tau"],
        "plain_p50": p["latency_p50_ms"],
        "plain_p99": p["latency_p99_ms"],
        "spec_p50": s["latency_p50_ms"],
        "spec_p99": s["latency_p99_ms"],
    }


def summarize(records: Sequence[RunRecord]) -> Summary:
    """Table per batch size; throughput, latency and speedup figures; the crossover batch size."""
    records = sorted(records, key=lambda r: r.config.batch_size)
    rows = [_row(rec) for rec in records]
    cross = crossover([(r["batch"], r["speedup"]) for r in rows if r["speedup"] is not None])
    cfg = records[0].config if records else BatchConfig()
    cross_tex = (
        "speculation pays at every batch size measured"
        if cross is None
        else f"speculation stops paying at $B \\approx {cross:.1f}$ (log-linear interpolation)"
    )
    sizes = (
        f"{cfg.drafter}, $\\gamma={cfg.gamma}$, $T={cfg.temperature:g}$, prompts from "
        f"{', '.join(cfg.prompt_sets)} cut to their last {cfg.max_prompt_tokens} tokens, "
        f"{cfg.max_new_tokens} new tokens per row (EOS ignored), {cfg.repeats} repeat(s), "
        f"{cfg.num_threads} torch thread(s); CPU-sized"
    )
    table = table_from_rows(
        "batch",
        f"Decode throughput (tokens of all rows per second, prefill excluded) and per-token latency "
        f"(P50/P99, ms) against batch size $B$ on {cfg.target}, plain decoding against speculative "
        f"decoding ({sizes}), measured in the same run; {cross_tex}.",
        [
            ("batch", "$B$", "d"),
            ("plain_tps", "Plain tok/s", ".1f"),
            ("spec_tps", "Spec. tok/s", ".1f"),
            ("speedup", "Speedup", ".2f"),
            ("tau", "$\\tau$", ".2f"),
            ("plain_p50", "Plain P50", ".1f"),
            ("plain_p99", "Plain P99", ".1f"),
            ("spec_p50", "Spec. P50", ".1f"),
            ("spec_p99", "Spec. P99", ".1f"),
        ],
        rows,
    )
    return Summary(
        title="Throughput and latency under concurrency: where speculation stops paying",
        tables=(table,),
        figures=_figures(rows, sizes, cross_tex) if rows else (),
        notes=f"crossover batch size: {cross}",
        extra={"crossover_batch_size": cross},
    )


def _figures(rows: list[dict], sizes: str, cross_tex: str) -> tuple[Figure, ...]:
    batches = [r["batch"] for r in rows]

    def series(key: str, label: str, style: str, group: str) -> Series:
        return series_from_rows(rows, "batch", key, label=label, style=style, group=group)

    return (
        Figure(
            name="throughput",
            caption=f"Decode throughput against batch size, plain and speculative ({sizes}).",
            xlabel="batch size $B$",
            ylabel="tokens/s (all rows)",
            logx=True,
            series=(
                series("plain_tps", "plain", "line+markers", "plain"),
                series("spec_tps", "speculative", "line+markers", "speculative"),
            ),
        ),
        Figure(
            name="latency",
            caption=f"Per-token latency (P50 solid, P99 dashed) against batch size ({sizes}).",
            xlabel="batch size $B$",
            ylabel="per-token latency (ms)",
            logx=True,
            logy=True,
            series=(
                series("plain_p50", "plain P50", "line+markers", "plain"),
                series("plain_p99", "plain P99", "dashed", "plain"),
                series("spec_p50", "speculative P50", "line+markers", "speculative"),
                series("spec_p99", "speculative P99", "dashed", "speculative"),
            ),
        ),
        Figure(
            name="speedup",
            caption=f"Speedup of speculative over plain decoding against batch size; {cross_tex} ({sizes}).",
            xlabel="batch size $B$",
            ylabel="speedup",
            logx=True,
            series=(
                series("speedup", "speculative / plain", "line+markers", "speculative"),
                Series(label="break-even", x=batches, y=[1.0] * len(batches), style="dashed", group="plain"),
            ),
        ),
    )


EXPERIMENT = Experiment(
    name="batch-sweep",
    description="decode tokens/s and P50/P99 per-token latency vs batch size 1-32, plain vs speculative, "
    "and the crossover where speculation stops paying",
    plan=plan,
    runners={BatchConfig: run_batch},
    summarize=summarize,
)
