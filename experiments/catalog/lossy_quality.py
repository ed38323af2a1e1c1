"""``lossy-quality``: what a lossy acceptance rule buys in speed and costs in quality.

Exact speculative decoding changes nothing but speed. The ``lenient`` verification rule
(:mod:`specdec.verify.lenient`, Leviathan et al. 2023, arXiv 2211.17192, Appendix A.5) accepts more
drafts by scaling the draft probability by a lenience l ≤ 1, and changes the output. This
experiment sweeps l ∈ {1, 0.5, 0.3, 0.1} (their Table 5's values; l = 1 is exact) on HumanEval
problems and reports, against plain decoding in the same run:

- speed: tokens/s over plain decoding, α and τ;
- quality: the mean log-likelihood per generated token under the target's raw distribution
  (T = 1, no top-k/top-p), and pass@1 with our own sandboxed execution harness
  (:mod:`experiments.humaneval`: every completion runs in a subprocess with a timeout);
- for greedy decoding, the exact-match rate against plain greedy output (1 at l = 1).

Their Table 5 (α for T5-XXL EnDe at T = 1) and their greedy numbers (§A.5) are printed beside.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from experiments.catalog.specdec_runs import (
    PLAIN,
    TINY_TARGET,
    InterleavedRunConfig,
    PromptRun,
    available_drafters,
    drafter_method,
    method_rows,
    open_run_target,
    run_methods,
    sequence_log_likelihood,
    torch_threads,
)
from experiments.experiment import Experiment
from experiments.runner import RunContext
from experiments.store import RunRecord
from experiments.sweep import Sweep
from specdec.summary import Figure, Summary, Table, series_from_points, table_from_rows

__all__ = ["PUBLISHED_TABLE5", "PUBLISHED_GREEDY", "LossyQualityConfig", "plan", "run_lossy", "EXPERIMENT"]

# Leviathan et al. 2023, Table 5: α for M_p = T5-XXL on EnDe, T = 1, at l = 1, 0.5, 0.3, 0.1.
PUBLISHED_TABLE5: dict[str, dict[float, float]] = {
    "Unigram": {1.0: 0.07, 0.5: 0.10, 0.3: 0.11, 0.1: 0.16},
    "Bigram": {1.0: 0.19, 0.5: 0.23, 0.3: 0.25, 0.1: 0.32},
    "T5-small": {1.0: 0.62, 0.5: 0.71, 0.3: 0.76, 0.1: 0.84},
    "T5-base": {1.0: 0.68, 0.5: 0.80, 0.3: 0.83, 0.1: 0.90},
}
# Their §A.5, greedy (accept x when p(x) >= l·max p), T5-XXL / T5-small on EnDe.
PUBLISHED_GREEDY: dict[float, float] = {1.0: 0.75, 0.5: 0.75, 0.3: 0.80, 0.1: 0.87}
_ANALOG = {"bigram": "Bigram", "unigram": "Unigram", "eagle": "T5-small", "layerskip": "T5-small"}
DRAFTERS = ("ngram", "bigram", "eagle")
_STYLE_TEX = {
    "instruct": "asked in the chat template for the whole function in a code block (the first block is "
    "tested), ",
    "completion": "raw prompts, completions cut at the Codex stop sequences, ",
}
LENIENCES = (1.0, 0.5, 0.3, 0.1)


@dataclass(frozen=True, kw_only=True)
class LossyQualityConfig(InterleavedRunConfig):
    """One drafter and temperature: plain decoding and the lenient rule at each lenience, same problems."""

    drafter: str = "ngram"
    leniences: tuple[float, ...] = LENIENCES
    gamma: int = 4
    num_problems: int = 12
    prompt_style: str = "instruct"
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        super().__post_init__()
        from experiments.humaneval import PROMPT_STYLES

        if self.prompt_style not in PROMPT_STYLES:
            raise ValueError(
                f"prompt_style must be one of {sorted(PROMPT_STYLES)}, got {self.prompt_style!r}"
            )
        if not self.leniences or not all(0.0 < x <= 1.0 for x in self.leniences):
            raise ValueError(f"leniences must be numbers in (0, 1], got {self.leniences}")
        self.at_least(gamma=1, num_problems=1)
        if not self.timeout_s > 0:
            raise ValueError(f"LossyQualityConfig.timeout_s must be > 0, got {self.timeout_s}")


def plan(*, smoke: bool = False) -> Sweep:
    """ngram and bigram (and eagle once shipped), greedy and T = 1 (smoke: tiny target, 1 problem)."""
    if smoke:
        base = LossyQualityConfig(
            target=TINY_TARGET, leniences=(1.0, 0.3), num_problems=1, max_new_tokens=6, lm_corpus_chars=20_000
        )
        return Sweep(base, {"drafter,temperature": [("bigram", 0.0), ("ngram", 1.0)]})
    base = LossyQualityConfig()
    drafters, _ = available_drafters(DRAFTERS, base.target)
    return Sweep(base, {"drafter": list(drafters), "temperature": [0.0, 1.0]})


def _label(drafter: str, lenience: float) -> str:
    return f"ours/{drafter}/l={lenience:g}"


def run_lossy(config: LossyQualityConfig, ctx: RunContext) -> dict:
    """Generate every problem with each method, then score: log-likelihood under the target, pass@1."""
    from experiments.humaneval import PROMPT_STYLES, check_completion, load_problems, pass_at_1
    from specdec.prompt_sets import encode_prompt

    target = open_run_target(config, ctx)
    style = PROMPT_STYLES[config.prompt_style]
    problems = load_problems(config.num_problems)
    prompts = [
        PromptRun("humaneval", i, encode_prompt(target.tokenizer, style.prompt(p), chat=style.chat))
        for i, p in enumerate(problems)
    ]
    methods = [PLAIN] + [
        drafter_method(
            config,
            config.drafter,
            config.gamma,
            label=_label(config.drafter, lenience),
            verify="lenient",
            verify_options={"lenience": lenience},
        )
        for lenience in config.leniences
    ]
    results, threads = run_methods(
        config, target, prompts, methods, ctx, stop_strings=list(style.stop_strings)
    )
    with torch_threads(config.num_threads):
        rows = {
            r["method"]: r
            for r in method_rows(results, config.temperature, ["humaneval"])
            if r["prompt_set"] == "all"
        }
        out = []
        for method in methods:
            logliks, lengths, checks = [], [], []
            for problem, prompt, res in zip(problems, prompts, results[method.label], strict=True):
                logliks.append(sequence_log_likelihood(target, prompt.ids, res.token_ids))
                lengths.append(len(res.token_ids))
                text = target.tokenizer.decode(res.token_ids, skip_special_tokens=True)
                checks.append(check_completion(problem, style.completion(text), timeout_s=config.timeout_s))
            row = rows[method.label]
            out.append(
                {
                    "method": method.label,
                    "lenience": method.verify_options.get("lenience"),
                    "tokens_per_second": row["tokens_per_second"],
                    "speedup": row.get("speedup"),
                    "alpha": row.get("acceptance_rate"),
                    "tau": row.get("mean_accepted_tokens"),
                    "exact_match_rate": row.get("exact_match_rate"),
                    "loglik_per_token": sum(logliks) / sum(lengths) if sum(lengths) else None,
                    "loglik_se": _ratio_se(logliks, lengths),
                    "num_tokens": sum(lengths),
                    "loglik_by_problem": logliks,
                    "tokens_by_problem": lengths,
                    "pass_at_1": pass_at_1(checks),
                    "passed": [c.task_id for c in checks if c.passed],
                    "statuses": {c.task_id: c.status for c in checks},
                }
            )
    return {"torch_threads": threads, "methods": out}


def _ratio_se(values: Sequence[float], weights: Sequence[int]) -> float | None:
    """Standard error of the ratio estimator Σ values / Σ weights over problems (the spread of the
    per-token log-likelihood from problem to problem, and at T > 0 from sample to sample)."""
    k, total = len(values), sum(weights)
    if k < 2 or total <= 0:
        return None
    r, mean_w = sum(values) / total, total / k
    return (
        sum((v - r * w) ** 2 for v, w in zip(values, weights, strict=True)) / (k * (k - 1))
    ) ** 0.5 / mean_w


def summarize(records: Sequence[RunRecord]) -> Summary:
    """Speed against quality per drafter, temperature and lenience; their α beside."""
    records = sorted(records, key=lambda r: (r.config.temperature, r.config.drafter))
    cfg = records[0].config if records else LossyQualityConfig()
    sizes = (
        f"{cfg.num_problems} HumanEval problems (evenly spaced), {_STYLE_TEX.get(cfg.prompt_style, '')}"
        f"up to {cfg.max_new_tokens} new tokens, $\\gamma={cfg.gamma}$, {cfg.num_threads} torch thread(s); "
        f"CPU-sized, so pass@1 moves in steps of {1 / cfg.num_problems:.3f}"
    )
    return Summary(
        title="Lossy verification: speed against log-likelihood and pass@1",
        tables=(_table([row for rec in records for row in _rows(rec)], cfg, sizes),),
        figures=_figures(records, sizes) if records else (),
        notes="Lossless methods: see tests/statistical (distribution tests) and the exact-match rates in "
        "speedup-table and gamma-sweep.",
    )


def _plain(rec: RunRecord) -> dict:
    return next(m for m in rec.result["methods"] if m["method"] == "ours/none")


def _rows(rec: RunRecord) -> list[dict]:
    """One row per method of one run: speed, α (the paper's beside), log-likelihood, pass@1."""
    cfg, plain, rows = rec.config, _plain(rec), []
    for m in rec.result["methods"]:
        l = m["lenience"]  # noqa: E741 (the paper's symbol)
        analog = _ANALOG.get(cfg.drafter)
        paper = None
        if l is not None and cfg.temperature == 1.0 and analog:
            paper = PUBLISHED_TABLE5[analog].get(l)
        elif l is not None and cfg.temperature == 0.0 and analog == "T5-small":
            paper = PUBLISHED_GREEDY.get(l)
        rows.append(
            {
                "temperature": cfg.temperature,
                "drafter": f"plain ({cfg.drafter} run)" if l is None else cfg.drafter,
                "lenience": l,
                "speedup": m["speedup"],
                "alpha": m["alpha"] if l is not None else None,
                "paper_alpha": paper,
                "tau": m["tau"],
                "loglik": m["loglik_per_token"],
                "loglik_se": m.get("loglik_se"),
                "dloglik": (m["loglik_per_token"] - plain["loglik_per_token"])
                if m["loglik_per_token"] is not None and plain["loglik_per_token"] is not None
                else None,
                "pass1": m["pass_at_1"],
                "exact": m["exact_match_rate"],
            }
        )
    return rows


def _table(rows: list[dict], cfg: LossyQualityConfig, sizes: str) -> Table:
    return table_from_rows(
        "lenience",
        f"Lenient verification (Leviathan et al.\\ 2023, Appendix A.5) on {cfg.target}: speed against "
        f"quality per drafter, temperature and lenience $l$ ($l = 1$ is exact). {sizes}. Speedup over "
        "plain decoding in the same run; LL: mean log-likelihood per generated token under the target "
        "at $T=1$ ($\\pm$: standard error over problems), $\\Delta$ against plain decoding (at $T=1$ the "
        "$l=1$ rows are exact, so their $\\Delta$ is sampling noise: one sample per problem); pass@1 "
        "with our sandboxed subprocess harness; Exact: greedy outputs equal to plain decoding. Paper "
        "$\\alpha$: their Table 5 (T5-XXL EnDe, $T=1$; bigram$\\to$Bigram, model drafters$\\to$T5-small) "
        "and their greedy T5-small numbers (\\S A.5).",
        [
            ("temperature", "$T$", "g"),
            ("drafter", "Drafter", ""),
            ("lenience", "$l$", "g"),
            ("speedup", "Speedup", ".2f"),
            ("alpha", "$\\alpha$", ".3f"),
            ("paper_alpha", "Paper $\\alpha$", ".2f"),
            ("tau", "$\\tau$", ".2f"),
            ("loglik", "LL/token", ".3f"),
            ("loglik_se", "$\\pm$", ".3f"),
            ("dloglik", "$\\Delta$LL", "+.3f"),
            ("pass1", "pass@1", ".3f"),
            ("exact", "Exact", ".2f"),
        ],
        rows,
    )


def _figures(records: Sequence[RunRecord], sizes: str) -> tuple[Figure, ...]:
    """Speedup and Δ log-likelihood against the lenience, one curve per (drafter, temperature)."""
    speed, quality = [], []
    for rec in records:
        plain_ll = _plain(rec)["loglik_per_token"] or 0.0
        lossy = sorted(
            (m for m in rec.result["methods"] if m["lenience"] is not None), key=lambda m: -m["lenience"]
        )
        group = f"{rec.config.drafter}, T={rec.config.temperature:g}"
        speed.append(
            series_from_points(
                [(m["lenience"], m["speedup"] or 0.0) for m in lossy], label=group, group=group
            )
        )
        points = [(m["lenience"], (m["loglik_per_token"] or 0.0) - plain_ll) for m in lossy]
        quality.append(series_from_points(points, label=group, group=group))
    return (
        Figure(
            name="speedup-vs-lenience",
            caption=f"Speedup over plain decoding against the lenience $l$ ($l=1$: exact). {sizes}.",
            xlabel="lenience $l$",
            ylabel="speedup",
            logx=True,
            series=tuple(speed),
        ),
        Figure(
            name="loglik-vs-lenience",
            caption="Change in mean log-likelihood per generated token under the target ($T=1$) against "
            f"plain decoding, per lenience. {sizes}.",
            xlabel="lenience $l$",
            ylabel="$\\Delta$ log-likelihood per token",
            logx=True,
            series=tuple(quality),
        ),
    )


EXPERIMENT = Experiment(
    name="lossy-quality",
    description="lenient verification (Leviathan A.5) l in {1,.5,.3,.1}: speedup vs target log-likelihood "
    "and HumanEval pass@1 (sandboxed subprocess harness)",
    plan=plan,
    runners={LossyQualityConfig: run_lossy},
    summarize=summarize,
)
