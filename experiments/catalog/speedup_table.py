"""``speedup-table``: Spec-Bench-style speedup and τ per drafter and prompt category.

Spec-Bench (Xia et al. 2024, arXiv 2401.07851) reports, per method and task category, the walltime
speedup over plain autoregressive decoding on the same hardware and the mean accepted tokens per
target call τ, greedy. Here the categories are HumanEval (code completion) and the eight MT-Bench
question categories; the methods are our drafters, each against our plain decode (the ``none``
drafter through the same engine) measured in the same run on the same prompts, prompt by prompt in
turn. Greedy speculative output must equal plain greedy output token for token, so each run also
records the exact-match rate: the lossless check at the level of whole generations (the
distribution tests in ``tests/statistical`` check sampling).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from experiments.catalog.specdec_runs import (
    CATEGORIES,
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

__all__ = ["DRAFTERS", "SpeedupConfig", "plan", "run_speedup", "EXPERIMENT"]

DRAFTERS = ("ngram", "bigram", "layerskip", "eagle", "eagle-tree", "ngram-eagle")


@dataclass(frozen=True, kw_only=True)
class SpeedupConfig(InterleavedRunConfig):
    """One prompt category: plain decoding and every drafter on the same prompts, in one run."""

    category: str = "humaneval"
    drafters: tuple[str, ...] = ("ngram", "bigram", "layerskip")
    gamma: int = 4
    num_prompts: int = 2
    chat: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.drafters or "none" in self.drafters:
            raise ValueError(
                f"drafters must be a non-empty list without 'none' (the baseline), got {self.drafters}"
            )
        self.at_least(gamma=1, num_prompts=1)


def plan(*, smoke: bool = False) -> Sweep:
    """One run per category (HumanEval + 8 MT-Bench categories); every available drafter inside it."""
    if smoke:
        base = SpeedupConfig(
            target=TINY_TARGET, drafters=("ngram", "bigram"), max_new_tokens=6, lm_corpus_chars=20_000
        )
        return Sweep(base, {"category": ["humaneval", "mtbench/coding"]})
    drafters, _ = available_drafters(DRAFTERS, "smollm2-135m")
    return Sweep(SpeedupConfig(drafters=drafters), {"category": list(CATEGORIES)})


def run_speedup(config: SpeedupConfig, ctx: RunContext) -> dict:
    """Plain decoding and each drafter on the category's prompts; bench-style rows per method."""
    methods = [PLAIN] + [drafter_method(config, d, config.gamma) for d in config.drafters]
    results, threads = run_on_prompts(config, ctx, [config.category], methods)
    rows = [
        r for r in method_rows(results, config.temperature, [config.category]) if r["prompt_set"] == "all"
    ]
    return {"torch_threads": threads, "methods": rows}


def _pooled(records: Sequence[RunRecord], method: str) -> dict:
    """Pool one method over categories: total tokens / total time, against the pooled plain decode."""
    rows = [r for rec in records for r in rec.result["methods"] if r["method"] == method]
    base = [r for rec in records for r in rec.result["methods"] if r["method"] == "ours/none"]
    tokens, time_s = sum(r["num_tokens"] for r in rows), sum(r["time_s"] for r in rows)
    base_tps = sum(r["num_tokens"] for r in base) / sum(r["time_s"] for r in base) if base else None
    tps = tokens / time_s if time_s else None
    out = {"tokens_per_second": tps, "speedup": tps / base_tps if tps and base_tps else None}
    if method != "ours/none":
        n = sum(r["num_prompts"] for r in rows)
        # τ and α pooled over calls: weight each category by its verify calls (tokens / τ).
        calls = [r["num_tokens"] / r["mean_accepted_tokens"] for r in rows if r.get("mean_accepted_tokens")]
        out["tau"] = (
            sum(r["num_tokens"] for r in rows if r.get("mean_accepted_tokens")) / sum(calls)
            if calls
            else None
        )
        out["exact_match_rate"] = (
            sum(
                r["exact_match_rate"] * r["num_prompts"]
                for r in rows
                if r.get("exact_match_rate") is not None
            )
            / n
            if all(r.get("exact_match_rate") is not None for r in rows) and n
            else None
        )
        preds = [r["measured_over_predicted"] for r in rows if r.get("measured_over_predicted")]
        out["measured_over_predicted"] = sum(preds) / len(preds) if preds else None
    return out


def summarize(records: Sequence[RunRecord]) -> Summary:
    """Speedup and τ per category and drafter; the pooled row; the acceptance profile per drafter."""
    records = sorted(
        records, key=lambda r: CATEGORIES.index(r.config.category) if r.config.category in CATEGORIES else 99
    )
    drafters = list(dict.fromkeys(d for r in records for d in r.config.drafters))
    cfg = records[0].config if records else SpeedupConfig()
    _, pending = available_drafters(DRAFTERS, cfg.target)
    sizes = (
        f"{cfg.num_prompts} prompt(s) per category, {cfg.max_new_tokens} new tokens, greedy, "
        f"$\\gamma = {cfg.gamma}$, {cfg.num_threads} torch thread(s); "
        "CPU-sized, so each cell is one or a few generations"
    )
    summary_rows = [{"drafter": d, **_pooled(records, f"ours/{d}")} for d in drafters]
    figure = _acceptance_figure(records, drafters, sizes)
    exact = [r.get("exact_match_rate") for r in summary_rows if r.get("exact_match_rate") is not None]
    return Summary(
        title="Speedup per drafter and prompt category (Spec-Bench style)",
        tables=(_category_table(records, drafters, cfg, sizes, pending), _overall_table(summary_rows)),
        figures=(figure,) if figure.series else (),
        notes=f"Exact-match rate of greedy outputs vs plain decode: min {min(exact):.3f}." if exact else "",
        extra={"pending": pending},
    )


def _category_table(
    records: Sequence[RunRecord], drafters: list[str], cfg: SpeedupConfig, sizes: str, pending: list[str]
) -> Table:
    """One row per category (and the pooled ``overall``): speedup and τ per drafter, plain tok/s."""
    columns = [("category", "Category", "")]
    for d in drafters:
        columns += [(f"{d}__speedup", f"{d} $\\times$", ".2f"), (f"{d}__tau", f"{d} $\\tau$", ".2f")]
    columns.append(("plain_tps", "Plain tok/s", ".1f"))
    rows = []
    for rec in records:
        by = {r["method"]: r for r in rec.result["methods"]}
        row = {"category": rec.config.category}
        for d in drafters:
            r = by.get(f"ours/{d}")
            if r:
                row[f"{d}__speedup"] = r.get("speedup")
                row[f"{d}__tau"] = r.get("mean_accepted_tokens")
        row["plain_tps"] = by.get("ours/none", {}).get("tokens_per_second")
        rows.append(row)
    overall = {"category": "overall"}
    for d in drafters:
        pooled = _pooled(records, f"ours/{d}")
        overall[f"{d}__speedup"], overall[f"{d}__tau"] = pooled["speedup"], pooled.get("tau")
    overall["plain_tps"] = _pooled(records, "ours/none")["tokens_per_second"]
    rows.append(overall)
    held, total = _eagle_heldout(sorted({r.config.category for r in records}), cfg.num_prompts)
    contamination = (
        f" EAGLE's head was trained on some of these prompts: {held} of {total} are in its held-out split, "
        "so its cells are optimistic (\\texttt{specdec bench} uses held-out prompts only)."
        if total and held < total and any("eagle" in d for d in drafters)
        else ""
    )
    return table_from_rows(
        "by-category",
        f"Spec-Bench-style speedup over our plain decode ($\\times$, measured in the same run on the same "
        f"prompts) and mean accepted tokens per target call $\\tau$, per drafter and prompt category "
        f"(HumanEval and the MT-Bench categories, MT-Bench in the chat template) on {cfg.target}: {sizes}. "
        "Overall: pooled tokens over pooled time."
        + contamination
        + (f" Not run: {'; '.join(r.split(' (')[0] for r in pending)}." if pending else ""),
        columns,
        rows,
    )


def _overall_table(summary_rows: list[dict]) -> Table:
    return table_from_rows(
        "overall",
        "Per drafter over all categories: tokens/s, speedup over plain decoding, $\\tau$, the mean ratio of "
        "measured to predicted speedup (prediction from the run's own $\\alpha$ and measured draft and "
        "verify costs, \\texttt{specdec.metrics.predicted\\_speedup\\_from\\_metrics}), and the exact-match "
        "rate of greedy outputs against plain greedy decoding (lossless methods must give 1).",
        [
            ("drafter", "Drafter", ""),
            ("tokens_per_second", "tok/s", ".1f"),
            ("speedup", "Speedup", ".2f"),
            ("tau", "$\\tau$", ".2f"),
            ("measured_over_predicted", "Meas./pred.", ".2f"),
            ("exact_match_rate", "Exact match", ".2f"),
        ],
        summary_rows,
    )


def _acceptance_figure(records: Sequence[RunRecord], drafters: list[str], sizes: str) -> Figure:
    """P(accepted | proposed) by draft position per drafter, the mean over categories."""
    series = []
    for d in drafters:
        prop = [0] * 16
        acc = [0] * 16
        for rec in records:
            for r in rec.result["methods"]:
                if r["method"] == f"ours/{d}":
                    for k, p in enumerate(r.get("acceptance_histogram") or []):
                        prop[k] += 1
                        acc[k] += p
        points = [(k + 1, acc[k] / prop[k]) for k in range(16) if prop[k]]
        if points:
            series.append(series_from_points(points, label=d))
    return Figure(
        name="acceptance-by-position",
        caption="Probability that the draft token at position $k$ is accepted given it was proposed, per "
        f"drafter (mean over categories). {sizes}.",
        xlabel="draft position $k$",
        ylabel="P(accepted)",
        series=tuple(series),
        ymin=0.0,
        ymax=1.0,
    )


EXPERIMENT = Experiment(
    name="speedup-table",
    description="Spec-Bench-style greedy speedup and tau per drafter per prompt category "
    "(HumanEval, MT-Bench), with the exact-match rate against plain decoding",
    plan=plan,
    runners={SpeedupConfig: run_speedup},
    summarize=summarize,
)


def _eagle_heldout(categories: Sequence[str], num_prompts: int) -> tuple[int, int]:
    """How many of the prompts these categories use are held out from the EAGLE head's training
    data (``specdec.drafters.eagle.train.sources.is_heldout``), and how many there are."""
    from experiments.catalog.specdec_runs import category_prompts
    from specdec.drafters.eagle.train.sources import is_heldout
    from specdec.prompt_sets import humaneval_prompts, mtbench_questions

    index = {("humaneval", t): i for i, t in enumerate(humaneval_prompts())}
    index.update({("mtbench", q["turns"][0]): i for i, q in enumerate(mtbench_questions())})
    held = total = 0
    for category in categories:
        source = "humaneval" if category == "humaneval" else "mtbench"
        for text in category_prompts(category, num_prompts):
            total += 1
            held += is_heldout(source, index[(source, text)])
    return held, total
