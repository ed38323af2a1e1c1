"""``leviathan-table3-analog``: α per drafter against our target at T = 0 and T = 1.

Leviathan et al. 2023 (arXiv 2211.17192), §4.2 and Table 3, measure the acceptance rate α of
approximation models of increasing strength (unigram < bigram < small transformer) for several
targets, with argmax (T = 0) and standard sampling (T = 1). This is the same table for our target:
the count-based ``unigram`` and ``bigram`` drafters, prompt lookup (``ngram``, which they did not
have), self-speculation (``layerskip``) and the trained feature-level head (``eagle``, once its
weights ship), with their published values printed beside ours for the shape.

α is measured by running the engine with γ = 1: every draft is proposed from the true prefix, so
accepted / proposed estimates E[β] over target-generated prefixes, the quantity of their
Corollary 3.6 and Table 3. With γ = 1 the draft is never conditioned on an earlier draft, so
drafters compare like with like (an EAGLE head's α at later draft positions is lower; see
``gamma-sweep``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from experiments.catalog.specdec_runs import (
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
from specdec.summary import Figure, Summary, series_from_points, table_from_rows

__all__ = [
    "PUBLISHED",
    "PAPER_ANALOG",
    "DRAFTERS",
    "AcceptanceConfig",
    "plan",
    "run_acceptance",
    "EXPERIMENT",
]

# Leviathan et al. 2023, Table 3: (target M_p, approximation model M_q) -> (α at T=0, α at T=1).
PUBLISHED: dict[tuple[str, str], tuple[float, float]] = {
    ("GPT-like (97M)", "Unigram"): (0.03, 0.03),
    ("GPT-like (97M)", "Bigram"): (0.05, 0.05),
    ("GPT-like (97M)", "GPT-like (6M)"): (0.88, 0.89),
    ("T5-XXL (EnDe)", "Unigram"): (0.08, 0.07),
    ("T5-XXL (EnDe)", "Bigram"): (0.20, 0.19),
    ("T5-XXL (EnDe)", "T5-small"): (0.75, 0.62),
    ("T5-XXL (EnDe)", "T5-base"): (0.80, 0.68),
    ("T5-XXL (EnDe)", "T5-large"): (0.82, 0.71),
    ("T5-XXL (CNNDM)", "Unigram"): (0.13, 0.08),
    ("T5-XXL (CNNDM)", "Bigram"): (0.23, 0.16),
    ("T5-XXL (CNNDM)", "T5-small"): (0.65, 0.53),
    ("T5-XXL (CNNDM)", "T5-base"): (0.73, 0.55),
    ("T5-XXL (CNNDM)", "T5-large"): (0.74, 0.56),
    ("LaMDA (137B)", "LaMDA (100M)"): (0.61, 0.57),
    ("LaMDA (137B)", "LaMDA (2B)"): (0.71, 0.71),
    ("LaMDA (137B)", "LaMDA (8B)"): (0.75, 0.74),
}
# Our drafter -> its analog in their table: (class label, [(M_p, M_q) shown beside it]).
_SMALL_TRANSFORMER = [
    ("GPT-like (97M)", "GPT-like (6M)"),
    ("T5-XXL (EnDe)", "T5-small"),
    ("T5-XXL (CNNDM)", "T5-small"),
]
PAPER_ANALOG: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "unigram": ("unigram", [(m, "Unigram") for m in ("GPT-like (97M)", "T5-XXL (EnDe)", "T5-XXL (CNNDM)")]),
    "bigram": ("bigram", [(m, "Bigram") for m in ("GPT-like (97M)", "T5-XXL (EnDe)", "T5-XXL (CNNDM)")]),
    "layerskip": ("small transformer", _SMALL_TRANSFORMER),
    "eagle": ("small transformer", _SMALL_TRANSFORMER),
    "ngram": ("(none: prompt lookup)", []),
}
DRAFTERS = ("unigram", "bigram", "ngram", "layerskip", "eagle")
TEMPERATURES = (0.0, 1.0)


@dataclass(frozen=True, kw_only=True)
class AcceptanceConfig(InterleavedRunConfig):
    """One drafter at one temperature: α over ``num_prompts`` prompts per set, with draft length γ."""

    drafter: str = "unigram"
    gamma: int = 1
    prompt_sets: tuple[str, ...] = ("humaneval", "mtbench")
    num_prompts: int = 4
    chat: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.at_least(gamma=1, num_prompts=1)


def plan(*, smoke: bool = False) -> Sweep:
    """Each available drafter at T = 0 and T = 1 (the smoke: tiny random target, a few tokens)."""
    if smoke:
        base = AcceptanceConfig(target=TINY_TARGET, num_prompts=1, max_new_tokens=6, lm_corpus_chars=20_000)
        pairs = [("unigram", 0.0), ("bigram", 1.0), ("ngram", 0.0), ("layerskip", 1.0)]
        return Sweep(base, {"drafter,temperature": pairs})
    base = AcceptanceConfig()
    available, _ = available_drafters(DRAFTERS, base.target)
    return Sweep(base, {"drafter": list(available), "temperature": list(TEMPERATURES)})


def run_acceptance(config: AcceptanceConfig, ctx: RunContext) -> dict:
    """Decode every prompt with the drafter at γ; α pooled over prompts (and per prompt set)."""
    from specdec.metrics import merge_metrics

    method = drafter_method(config, config.drafter, config.gamma)
    results, threads = run_on_prompts(config, ctx, config.prompt_sets, [method])
    m = merge_metrics([r.metrics for r in results[method.label]])
    rows = method_rows(results, config.temperature, config.prompt_sets)
    n = m.num_accepted + m.num_rejections
    return {
        "alpha": m.acceptance_rate,
        "alpha_iid": m.alpha_iid,
        # γ = 1: each proposal is one Bernoulli(β) trial; the standard error of their mean.
        "alpha_se": math.sqrt(m.alpha_iid * (1 - m.alpha_iid) / n) if n else None,
        "tau": m.mean_accepted_tokens,
        "num_proposed": m.num_proposed,
        "num_accepted": m.num_accepted,
        "num_tokens": m.num_generated_tokens,
        "draft_ms_per_token": m.draft_time_per_token_s * 1e3,
        "torch_threads": threads,
        "alpha_by_set": {r["prompt_set"]: r["acceptance_rate"] for r in rows if r["prompt_set"] != "all"},
    }


def _paper_cell(drafter: str, t_index: int) -> str | None:
    pairs = PAPER_ANALOG.get(drafter, ("", []))[1]
    return " / ".join(f"{PUBLISHED[p][t_index]:.2f}" for p in pairs) or None


def summarize(records: Sequence[RunRecord]) -> Summary:
    """One row per drafter: α at T = 0 and 1 (ours), their Table 3 beside; α against T as a figure."""
    by = {(r.config.drafter, r.config.temperature): r for r in records}
    order = [d for d in DRAFTERS if any(k[0] == d for k in by)]
    order += sorted({d for d, _ in by} - set(order))
    targets = sorted({r.config.target for r in records})
    _, pending = available_drafters(DRAFTERS, targets[0]) if targets else ((), [])
    cfg = records[0].config if records else AcceptanceConfig()
    sizes = (
        f"{cfg.num_prompts} prompt(s) each from {', '.join(cfg.prompt_sets)}, "
        f"{cfg.max_new_tokens} new tokens, $\\gamma = {cfg.gamma}$"
    )
    table = table_from_rows(
        "alpha",
        f"Acceptance rate $\\alpha$ per drafter against {', '.join(targets) or 'the target'} at $T=0$ "
        "(argmax) and $T=1$ (standard sampling), as in Leviathan et al.\\ (2023) Table 3, whose values "
        "are shown beside ours as GPT-like (97M) / T5-XXL EnDe / T5-XXL CNNDM targets with unigram, "
        "bigram and small-transformer (GPT-like 6M, T5-small) approximation models. Ours: "
        f"{sizes} (CPU-sized: few prompts; $\\pm$ is one standard error; $n$ = drafts proposed). "
        "Draft cost: ms per drafted token.",
        [
            ("drafter", "Drafter", ""),
            ("analog", "Their analog", ""),
            ("alpha_t0", "$\\alpha$ $T{=}0$", ".3f"),
            ("se_t0", "$\\pm$", ".3f"),
            ("n_t0", "$n$", "d"),
            ("alpha_t1", "$\\alpha$ $T{=}1$", ".3f"),
            ("se_t1", "$\\pm$", ".3f"),
            ("n_t1", "$n$", "d"),
            ("paper_t0", "Paper $T{=}0$", ""),
            ("paper_t1", "Paper $T{=}1$", ""),
            ("draft_ms", "Draft ms", ".2f"),
        ],
        _rows(by, order, pending),
    )
    figure = _alpha_figure(by, order, sizes)
    shape = _shape(by)
    notes = f"Shape unigram < bigram < strongest model drafter: {shape}. " + (
        f"Pending: {'; '.join(pending)}." if pending else ""
    )
    return Summary(
        title="Acceptance rate per drafter (Leviathan et al. 2023, Table 3 analog)",
        tables=(table,),
        figures=(figure,) if figure.series else (),
        notes=notes,
        extra={"shape_holds": shape, "pending": pending},
    )


def _rows(by: dict, order: list[str], pending: list[str]) -> list[dict]:
    """One row per drafter run (α, its standard error and n at T = 0 and 1, the paper's cells), then
    one per drafter not run, with the reason."""
    rows = []
    for drafter in order:
        row = {"drafter": drafter, "analog": PAPER_ANALOG.get(drafter, ("--", []))[0]}
        for t, key in ((0.0, "t0"), (1.0, "t1")):
            rec = by.get((drafter, t))
            if rec is not None:
                row[f"alpha_{key}"] = rec.result["alpha"]
                row[f"se_{key}"] = rec.result["alpha_se"]
                row[f"n_{key}"] = rec.result["num_proposed"]
        row["paper_t0"] = _paper_cell(drafter, 0)
        row["paper_t1"] = _paper_cell(drafter, 1)
        ms = [by[k].result["draft_ms_per_token"] for k in by if k[0] == drafter]
        row["draft_ms"] = sum(ms) / len(ms) if ms else None
        rows.append(row)
    for reason in pending:
        name, _, why = reason.partition(": ")
        rows.append({"drafter": name, "analog": why.split(" (")[0]})  # the short reason; notes keep it all
    return rows


def _alpha_figure(by: dict, order: list[str], sizes: str) -> Figure:
    """α against T per drafter (ours solid, the paper's unigram and bigram on T5-XXL EnDe dashed)."""
    series = []
    for drafter in order:
        points = sorted((t, by[(drafter, t)].result["alpha"]) for (d, t) in by if d == drafter)
        series.append(series_from_points(points, label=drafter, group=drafter))
        paper = PAPER_ANALOG.get(drafter, ("", []))[1]
        if drafter in ("unigram", "bigram") and paper:
            points = list(zip((0.0, 1.0), PUBLISHED[paper[1]], strict=True))
            label = f"{drafter} (paper, T5-XXL EnDe)"
            series.append(series_from_points(points, label=label, style="dashed", group=drafter))
    return Figure(
        name="alpha-vs-temperature",
        caption="$\\alpha$ per drafter at $T=0$ and $T=1$ (solid, ours) and Leviathan et al.'s unigram and "
        f"bigram on T5-XXL EnDe (dashed). {sizes}.",
        xlabel="temperature $T$",
        ylabel="acceptance rate $\\alpha$",
        series=tuple(series),
        ymin=0.0,
    )


def _shape(by: dict) -> dict[str, bool | None]:
    """Per temperature: does unigram < bigram < the best model-based drafter (layerskip, eagle) hold?"""
    out: dict[str, bool | None] = {}
    for t in TEMPERATURES:
        alpha = {d: r.result["alpha"] for (d, tt), r in by.items() if tt == t}
        models = [alpha[d] for d in ("layerskip", "eagle") if d in alpha]
        if "unigram" in alpha and "bigram" in alpha and models:
            out[f"T={t:g}"] = alpha["unigram"] < alpha["bigram"] < max(models)
        else:
            out[f"T={t:g}"] = None
    return out


EXPERIMENT = Experiment(
    name="leviathan-table3-analog",
    description="alpha of unigram, bigram, ngram, layerskip and eagle drafters vs the target at T=0 and T=1, "
    "Leviathan et al. 2023 Table 3 beside",
    plan=plan,
    runners={AcceptanceConfig: run_acceptance},
    summarize=summarize,
)
