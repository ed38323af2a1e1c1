"""``specdec bench`` results: per-prompt records, the summary rows, and the JSON / Markdown files.

:func:`summarize` turns runs (one per method and temperature, each a list of :class:`PromptResult`)
into one row per (prompt set, temperature, method) plus the pooled set ``all``: tok/s, speedup over
``ours/none``, α, τ, the predicted speedup from the run's own α and measured costs
(:func:`specdec.metrics.predicted_speedup_from_metrics`), measured / predicted, and for greedy runs
the exact-match rate against ``ours/none``. ``experiments`` reuses it for its decoding experiments.
With ``--peers llama.cpp``, :func:`llama_bench_rows` puts ``llama-bench``'s figures beside ours in a
second table (:mod:`specdec.bench.llama_bench`).
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.bench.llama_bench import PROMPT_BLOCKS, comparison_markdown, comparison_rows, comparison_table

__all__ = [
    "PromptResult",
    "environment",
    "summarize",
    "markdown_table",
    "pooled_tokens_per_second",
    "write_results",
    "serialise_run",
    "header",
    "bench_document",
    "benchmark_document",
    "machine_line",
    "llama_bench_rows",
    "BENCH_COLUMNS",
]

BENCH_COLUMNS = (
    ("prompt_set", "Prompts", ""),
    ("temperature", "$T$", "g"),
    ("method", "Method", ""),
    ("tokens_per_second", "tok/s", ".1f"),
    ("speedup", "Speedup", ".2f"),
    ("acceptance_rate", "$\\alpha$", ".2f"),
    ("mean_accepted_tokens", "$\\tau$", ".2f"),
    ("predicted_speedup", "Pred.", ".2f"),
    ("exact_match_rate", "Exact", ".2f"),
)
"""The table of ``bench.json`` (key, LaTeX label, format): a subset of each summary row's fields."""


@dataclass
@dataclass
class PromptResult:
    """One prompt through one method."""

    set: str
    index: int
    token_ids: list[int]
    time_s: float
    metrics: Any = None  # SpecMetrics for our runs


def summarize(runs: list[dict], prompt_sets: Sequence[str]) -> list[dict]:
    """One row per (prompt set, temperature, method), plus the pooled set ``all``."""
    from specdec.metrics import merge_metrics, predicted_speedup_from_metrics

    rows = []
    for set_name in [*prompt_sets, "all"]:
        for temperature in sorted({r["temperature"] for r in runs}):
            same_t = [r for r in runs if r["temperature"] == temperature]
            picked = {
                r["method"]: [x for x in r["results"] if set_name == "all" or x.set == set_name]
                for r in same_t
            }
            base = picked.get("ours/none")
            base_tps = pooled_tokens_per_second(base) if base else None
            base_metrics = merge_metrics([x.metrics for x in base]) if base else None
            t_target = (base_metrics.verify_time_by_block.get(1) if base_metrics else None) or None
            for method, results in picked.items():
                if not results:
                    continue
                tps = pooled_tokens_per_second(results)
                row: dict[str, Any] = {
                    "prompt_set": set_name,
                    "temperature": temperature,
                    "method": method,
                    "num_prompts": len(results),
                    "num_tokens": sum(len(x.token_ids) for x in results),
                    "time_s": sum(x.time_s for x in results),
                    "tokens_per_second": tps,
                    "speedup": tps / base_tps if base_tps else None,
                }
                if results[0].metrics is not None:
                    m = merge_metrics([x.metrics for x in results])
                    predicted = predicted_speedup_from_metrics(m, t_target) if t_target else 0.0
                    row.update(
                        acceptance_rate=m.acceptance_rate,
                        alpha_iid=m.alpha_iid,
                        mean_accepted_tokens=m.mean_accepted_tokens,
                        acceptance_histogram=m.acceptance_histogram,
                        predicted_speedup=predicted or None,
                        measured_over_predicted=(row["speedup"] / predicted)
                        if predicted and row["speedup"]
                        else None,
                        draft_ms_per_token=m.draft_time_per_token_s * 1e3,
                        check_us_per_step=m.check_time_s / max(1, m.num_steps) * 1e6,
                        check_share=m.check_time_s / m.total_time_s if m.total_time_s > 0 else 0.0,
                        verify_ms_by_block={str(k): v * 1e3 for k, v in m.verify_time_by_block.items()},
                        target_time_s=m.target_time_s,
                        draft_time_s=m.draft_time_s,
                        overhead_time_s=m.overhead_time_s,
                        ttft_s=m.ttft_s,
                        tpot_s=m.tpot_s,
                        latency_p50_s=m.latency_p50_s,
                        latency_p99_s=m.latency_p99_s,
                    )
                if temperature == 0 and base and method != "ours/none":
                    ref = {(x.set, x.index): x.token_ids for x in base}
                    same = sum(1 for x in results if ref.get((x.set, x.index)) == x.token_ids)
                    row["exact_match_rate"] = same / len(results)
                rows.append(row)
    return rows


def pooled_tokens_per_second(results: list[PromptResult]) -> float:
    """Pooled tokens over pooled time."""
    t = sum(x.time_s for x in results)
    return sum(len(x.token_ids) for x in results) / t if t > 0 else 0.0


def _fmt(v: Any, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def markdown_table(rows: list[dict]) -> str:
    """The summary rows as a Markdown table."""
    head = (
        "| prompts | T | method | tok/s | speedup | α | τ | predicted | measured/predicted | exact match "
        "| checks µs/step |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        lines.append(
            f"| {r['prompt_set']} | {r['temperature']:g} | {r['method']} | {r['tokens_per_second']:.1f} | "
            f"{_fmt(r.get('speedup'), '.2f')}× | {_fmt(r.get('acceptance_rate'), '.2f')} | "
            f"{_fmt(r.get('mean_accepted_tokens'), '.2f')} | {_fmt(r.get('predicted_speedup'), '.2f')} | "
            f"{_fmt(r.get('measured_over_predicted'), '.2f')} | {_fmt(r.get('exact_match_rate'), '.0%')} | "
            f"{_fmt(r.get('check_us_per_step'), '.0f')} |"
        )
    return head + "\n".join(lines) + "\n"


def llama_bench_rows(payload: dict) -> list[dict]:
    """``llama-bench``'s figures (``payload["llama_bench"]``) beside each of our methods' pooled
    (``all``) rows, per temperature: its tok/s beside ``tg128`` and, for each block length T its
    verify calls had, T / the mean T-token verify time beside ``ppT``."""
    ours = {}
    for row in payload["summary"]:
        if row["prompt_set"] != "all" or row.get("tokens_per_second") is None:
            continue
        ms = {int(T): v for T, v in (row.get("verify_ms_by_block") or {}).items()}
        figures = {"tg": row["tokens_per_second"]}
        figures |= {f"pp{T}": 1e3 * T / ms[T] for T in PROMPT_BLOCKS if ms.get(T)}
        ours[f"{row['method']} (temperature {row['temperature']:g})"] = figures
    return comparison_rows(payload["llama_bench"], ours)


def command_line(prog: str, argv: Sequence[str] | None = None) -> str:
    """The command a results file records, as a user types it: ``prog`` (``python -m specdec.bench.x``)
    and the arguments (``argv``, default this process's)."""
    import sys

    return " ".join([prog, *(argv if argv is not None else sys.argv[1:])])


def environment() -> dict[str, Any]:
    """Versions, platform and thread count of this process, for the results file."""
    import torch
    import transformers

    from kernels.native import cpu_isa, cpu_model

    return {
        "cpu": cpu_model(),
        "isa": cpu_isa(),
        "commit": _commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _commit() -> str | None:
    """The git commit of the checkout this runs from (None outside one)."""
    import subprocess

    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except OSError:
        return None
    return done.stdout.strip() or None


def machine_line(env: dict) -> str:
    """The machine of an :func:`environment`: CPU, the kernels' ISA path, threads, torch."""
    return (
        f"CPU: {env.get('cpu')} (kernels: {env.get('isa')} path), {env.get('torch_threads')} threads, "
        f"torch {env.get('torch')}"
    )


def benchmark_document(
    record: dict,
    *,
    experiment: str,
    summarize: Callable[[dict], Any],
    description: str,
    created_at: str | None = None,
) -> dict:
    """A benchmark's results file: the ``specdec.summary/1`` part (``summarize(record)``'s tables, the
    machine and commit of the record's :func:`environment` (its ``environment`` or ``env`` field),
    ``record["command"]``) with the raw ``record`` beside it. ``summarize`` reads the record as the
    file holds it (JSON: string keys), so a file already written converts the same way."""
    from specdec.summary import summary_document

    record = json.loads(json.dumps(record, default=str))
    env = record.get("environment") or record["env"]
    env["git_commit"] = env.get("commit")
    document = summary_document(
        experiment=experiment,
        summary=summarize(record),
        command=record.get("command", ""),
        machine=machine_line(env),
        env=env,
        description=description,
        created_at=created_at,
    )
    return {**document, **record}


def header(payload: dict) -> str:
    """One line naming the machine, the ISA path, threads, weights and commit of a results payload."""
    env = payload.get("environment", {})
    return (
        f"CPU: {env.get('cpu')} (kernels: {env.get('isa')} path), {env.get('torch_threads')} threads, "
        f"weights: {env.get('weights')}, commit {env.get('commit')}, torch {env.get('torch')}"
    )


def bench_document(
    payload: dict, name: str, *, complete_temperatures: int | None = None, created_at: str | None = None
) -> dict:
    """``bench.json``'s ``specdec.summary/1`` part for a results ``payload`` (config, environment,
    summary rows): one table of the summary rows (:data:`BENCH_COLUMNS`), the machine line of
    :func:`header`, and as runs the temperatures swept (``complete_temperatures`` of them finished;
    default all). The raw payload goes beside it in the same file."""
    from specdec.summary import Summary, summary_document, table_from_rows

    cfg, env = payload["config"], payload["environment"]
    temperatures = len(cfg["temperatures"])
    done = temperatures if complete_temperatures is None else complete_temperatures
    sizes = (
        f"{cfg['num_prompts']} prompt(s) per set ({', '.join(cfg['prompt_sets'])}"
        f"{', chat template' if cfg.get('chat') else ''}), {cfg['max_new_tokens']} new tokens, "
        f"$\\gamma = {cfg['gamma']}$ ({cfg.get('gamma_policy', 'fixed')})"
    )
    caption = (
        f"\\texttt{{specdec bench}} on {cfg['target']}: {sizes}. Speedup over \\texttt{{ours/none}} "
        "measured in the same interleaved run; $\\alpha$ = accepted/proposed; $\\tau$ = tokens per "
        "target call; Pred.: from the run's own $\\alpha$ and measured costs; Exact: greedy outputs "
        "equal to \\texttt{ours/none}; the set \\texttt{all} pools every prompt."
    )
    rows = [{k: row.get(k) for k, _, _ in BENCH_COLUMNS} for row in payload["summary"]]
    tables = [table_from_rows("speedup", caption, BENCH_COLUMNS, rows)]
    if isinstance(payload.get("llama_bench"), dict):  # where it did not run, the notes say why
        what = "Each method's tok/s on the prompts (all sets pooled) and its verify blocks"
        tables.append(comparison_table(payload["llama_bench"], llama_bench_rows(payload), what))
    summary = Summary(title=f"specdec bench: {cfg['target']}", tables=tuple(tables))
    return summary_document(
        experiment=name,
        summary=summary,
        command=payload["command"],
        machine=header(payload),
        env={**env, "git_commit": env.get("commit")},
        description="Every method on the same prompts, interleaved (specdec bench)",
        num_runs=done,
        num_planned_runs=temperatures,
        missing_run_ids=[f"T={t:g}" for t in cfg["temperatures"][done:]],
        created_at=created_at,
    )


def write_results(out_dir: Path, payload: dict, command: str) -> None:
    """Write ``bench.json`` (atomically) and ``bench.md`` to ``out_dir``."""
    from specdec.summary import write_results

    notes = "".join(f"- {n}\n" for n in payload["notes"])
    peer_line = ""
    if payload.get("llama_bench"):
        peer_line = "\n" + comparison_markdown(payload["llama_bench"], llama_bench_rows(payload))
    table = markdown_table(payload["summary"])
    md = f"# specdec bench\n\n{header(payload)}\n\nCommand: `{command}`\n\n{table}{peer_line}"
    write_results(out_dir / "bench.json", payload, md + (f"\nNotes:\n{notes}" if notes else ""))


def serialise_run(run: dict) -> dict:
    """One run (method, temperature, per-prompt results) as JSON-ready data."""
    return {
        "method": run["method"],
        "temperature": run["temperature"],
        "prompts": [
            {
                "set": x.set,
                "index": x.index,
                "num_tokens": len(x.token_ids),
                "time_s": x.time_s,
                "token_ids": x.token_ids,
                "metrics": x.metrics.to_dict() if x.metrics is not None else None,
            }
            for x in run["results"]
        ],
    }
