"""Speculation under load: the engine at several concurrencies, every drafter, one interleaved run.

``specdec bench --concurrency 1,2,4,8 --drafters none,ngram,eagle,default`` (or ``python -m
specdec.bench.concurrency``). For every concurrency c and drafter, interleaved in that order:

- ``engine/together``: c requests arrive at once, the next c when all have finished;
- ``engine/staggered``: a closed loop that keeps c requests in flight (a new one joins the step
  after one leaves, so requests arrive and leave at different steps).

(``specdec.generate`` on c prompts is the engine with c requests arriving together; the static-batch
loop it replaced, measured against the engine before its removal, is in docs/engine.md.)

Speculation spends spare compute to cut latency: a verify call runs γ+1 tokens per row, nearly free
while a step is memory-bound, not once the batch makes it compute-bound (Spec-Bench, arXiv
2401.07851). So the summary (the paper's table and figures) gives each drafter's throughput against
no drafter's on the same path at every c, and the concurrency where that ratio falls below 1
(:func:`crossover`).

Per row: system tokens per second (every generated token / wall time of the level, prefill
included), per-request TPOT P50 / P99 (``(last token − first token) / (tokens − 1)``), α and τ pooled
over the level's requests, for greedy runs the share of engine requests whose tokens equal the
same prompt decoded alone (``= solo``), and the scheduler's share of the engine's step time
(:func:`specdec.engine.engine.scheduler_seconds`: outside the target's forwards, the drafters and the
verification rule), and the drafters' time per engine step (``draft_s`` / ``steps``), with each
drafter's ratio between the highest and the lowest concurrency (:func:`draft_scaling`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.percentile import percentile

__all__ = [
    "run_concurrency",
    "add_concurrency_arguments",
    "from_bench_args",
    "summarize",
    "crossover",
    "draft_scaling",
    "main",
]


def level(
    engine: Any, prompts: list[list[int]], c: int, arrival: str, params: dict[str, Any], seed: int
) -> dict:
    """Run ``prompts`` through ``engine`` at concurrency ``c`` (:func:`specdec.loop.drive`, the one
    driver); returns the level's figures and tokens."""
    from specdec.engine.engine import scheduler_seconds
    from specdec.loop import drive

    engine.reset_target()
    out = drive(engine, prompts, params, seeds=[seed] * len(prompts), concurrency=c, arrival=arrival)
    delta = out.engine_stats
    wall = out.metrics.total_time_s
    metrics = [m for m in out.requests if m is not None]
    tokens = sum(len(t) for t in out.token_ids)
    tpots = [m.tpot_s for m in metrics if m.tpot_s is not None]
    drafted = sum(m.num_drafted for m in metrics)
    accepted = sum(m.num_accepted for m in metrics)
    steps = sum(m.num_steps for m in metrics)
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_second": tokens / wall,
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p99_s": percentile(tpots, 99),
        "alpha": accepted / drafted if drafted else 0.0,
        "tau": (accepted + steps) / steps if steps else 1.0,
        "depth_changes_per_request": sum(m.depth_changes for m in metrics) / len(metrics),
        "scheduler_share": scheduler_seconds(delta) / delta["total_s"] if delta["total_s"] else None,
        "draft_ms_per_step": 1e3 * delta["draft_s"] / delta["steps"] if delta["steps"] else None,
        # without the catch-up owed once per request (its prompt's): what drafting costs a step
        "drafting_ms_per_step": (
            1e3 * (delta["draft_s"] - delta.get("owed_s", 0.0)) / delta["steps"] if delta["steps"] else None
        ),
        "token_ids": dict(enumerate(out.token_ids)),
    }


def run_concurrency(args: argparse.Namespace, console: Any = None) -> dict[str, Any]:
    """The benchmark (module doc); writes ``concurrency.json`` and ``concurrency.md`` under ``--out``
    after every level, so an interrupted run keeps what finished."""
    import torch

    from specdec.bench.report import environment
    from specdec.engine import Engine
    from specdec.loop import ARRIVALS
    from specdec.prompt_sets import encode_prompt, load_prompts
    from specdec.targets import open_target_from

    levels = list(args.concurrency)
    target = open_target_from(args)
    prompts: list[list[int]] = []
    for name in args.prompt_set:
        texts = load_prompts(name, args.num_prompts)
        prompts += [encode_prompt(target.tokenizer, t, chat=args.chat) for t in texts]
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "ignore_eos": False}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    engines = {
        d: Engine(target, drafter=d, max_num_seqs=max(levels), gamma=args.engine_gamma, max_model_len=1024)
        for d in args.drafters
    }
    solo: dict[str, dict[int, list[int]]] = {}
    rows: list[dict[str, Any]] = []
    payload: dict[str, Any] = {
        "command": args.command,
        "environment": environment(),
        "levels": levels,
        "num_requests": len(prompts),
        "rows": rows,
        "cost_models": {d: (e.cost.to_dict() if e.cost else None) for d, e in engines.items()},
    }
    repeats = getattr(args, "repeats", 1)
    for rep, c in ((rep, c) for rep in range(repeats) for c in levels):
        for d, engine in engines.items():
            for arrival in ARRIVALS:
                path = f"engine/{arrival}"
                with torch.inference_mode():
                    figures = level(engine, prompts, c, arrival, params, args.seed)
                ids = figures.pop("token_ids")
                if path == "engine/together" and c == levels[0]:
                    solo.setdefault(d, ids)
                same = None
                if args.temperature == 0 and d in solo:
                    same = sum(ids[i] == solo[d][i] for i in ids) / len(ids)
                row = {"concurrency": c, "drafter": d, "path": path, "equal_solo": same, **figures}
                if repeats > 1:
                    row["repeat"] = rep
                rows.append(row)
                if console is not None:
                    console.print(
                        ("" if repeats == 1 else f"[{rep + 1}/{repeats}] ")
                        + f"c={c} {d:>8} {path:<17} {row['tokens_per_second']:7.1f} tok/s  "
                        f"tau {row['tau']:.2f}  = solo {same if same is None else f'{same:.0%}'}"
                        + ("" if row["scheduler_share"] is None else f"  sched {row['scheduler_share']:.1%}")
                        + (
                            ""
                            if row["draft_ms_per_step"] is None
                            else f"  draft {row['draft_ms_per_step']:.2f} ms/step"
                            f" ({row['drafting_ms_per_step']:.2f} without owed catch-up)"
                        )
                    )
                _write(out_dir, payload)
    if console is not None:
        for line in draft_scaling(median_rows(rows)) + ratio_lines(rows):
            console.print(line)
    return payload


def median_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (concurrency, drafter, path): of a run with ``--repeats``, the repeat of median
    throughput (the lower middle one of an even count); rows without repeats as they are."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["concurrency"], r["drafter"], r["path"]), []).append(r)
    picked = []
    for group in groups.values():
        ordered = sorted(group, key=lambda r: r["tokens_per_second"])
        picked.append({**ordered[(len(ordered) - 1) // 2], "repeats": len(group)})
    return picked


def ratio_lines(rows: list[dict[str, Any]], base: str = "none") -> list[str]:
    """Per drafter and path: its throughput over ``base``'s at each concurrency, the median over
    repeats of the ratio within each repeat (an alternation: both measured back to back)."""
    by_key = {
        (r["concurrency"], r["drafter"], r["path"], r.get("repeat", 0)): r["tokens_per_second"] for r in rows
    }
    lines = []
    for d, path in dict.fromkeys((r["drafter"], r["path"]) for r in rows if r["drafter"] != base):
        parts = []
        for c in dict.fromkeys(r["concurrency"] for r in rows):
            ratios = sorted(
                v / by_key[(c, base, path, rep)]
                for (cc, dd, pp, rep), v in by_key.items()
                if (cc, dd, pp) == (c, d, path) and (c, base, path, rep) in by_key
            )
            if ratios:
                parts.append(f"c={c} {statistics.median(ratios):.2f}x")
        if parts:
            lines.append(f"{d} / {base} ({path}, median of repeats): " + ", ".join(parts))
    return lines


def draft_scaling(rows: list[dict[str, Any]], path: str = "engine/staggered") -> list[str]:
    """One line per drafter: its time per engine step at the lowest and the highest concurrency of the
    run and their ratio (how the drafter's cost grows with the rows it drafts; 1 would be free rows):
    ``Engine.stats``' ``draft_s`` (propose, begin and observe) without ``owed_s`` (the catch-up owed
    once per request, such as its prompt's: more of a step's share at high concurrency, whatever the
    batching), over ``steps``; the total with it in parentheses."""
    lines = []
    for d in dict.fromkeys(r["drafter"] for r in rows if r["drafter"] != "none"):
        mine = sorted(
            (r for r in rows if r["drafter"] == d and r["path"] == path), key=lambda r: r["concurrency"]
        )
        key = (
            "drafting_ms_per_step"
            if all(r.get("drafting_ms_per_step") for r in mine)
            else "draft_ms_per_step"
        )
        if len(mine) < 2 or not mine[0][key]:
            continue
        lo, hi = mine[0], mine[-1]
        lines.append(
            f"{d} drafting ms/step ({path}): c={lo['concurrency']} {lo[key]:.2f} "
            f"({lo['draft_ms_per_step']:.2f}), c={hi['concurrency']} {hi[key]:.2f} "
            f"({hi['draft_ms_per_step']:.2f}), ratio {hi[key] / lo[key]:.2f}x"
        )
    return lines


def summarize(record: dict[str, Any]) -> Any:
    """The results-schema summary of a record: one table, a row per (concurrency, drafter, path)."""
    from specdec.summary import Summary, table_from_rows

    picked = median_rows(record["rows"])
    base = {(r["concurrency"], r["path"]): r["tokens_per_second"] for r in picked if r["drafter"] == "none"}
    rows = []
    for r in picked:
        ref = base.get((r["concurrency"], r["path"]))
        rows.append(
            {
                "concurrency": r["concurrency"],
                "drafter": r["drafter"],
                "path": r["path"],
                "tokens_per_second": r["tokens_per_second"],
                "x_none": r["tokens_per_second"] / ref if ref else None,
                "tpot_p50_ms": None if r["tpot_p50_s"] is None else 1e3 * r["tpot_p50_s"],
                "tpot_p99_ms": None if r["tpot_p99_s"] is None else 1e3 * r["tpot_p99_s"],
                "alpha": r["alpha"],
                "tau": r["tau"],
                "equal_solo": r["equal_solo"],
            }
        )
        if "scheduler_share" in r:  # records before the column have none
            share = r["scheduler_share"]
            rows[-1]["scheduler_pct"] = None if share is None else 100 * share
    columns = [
        ("concurrency", "c", "d"),
        ("drafter", "drafter", ""),
        ("path", "path", ""),
        ("tokens_per_second", "tok/s", ".1f"),
        ("x_none", "x none", ".2f"),
        ("tpot_p50_ms", "TPOT P50 ms", ".1f"),
        ("tpot_p99_ms", "TPOT P99 ms", ".1f"),
        ("alpha", "alpha", ".2f"),
        ("tau", "tau", ".2f"),
        ("equal_solo", "= solo", ".2f"),
    ]
    if any("scheduler_share" in r for r in picked):  # records before the column have none
        columns.append(("scheduler_pct", "sched %", ".1f"))
    # records measured before the static-batch path was removed compare against it
    against = " against the static batch" if any(r["path"] == "static" for r in picked) else ""
    curves = _curves(rows)
    crossovers = {
        f"{d} {path}": crossover([(r["concurrency"], r["x_none"]) for r in curve])
        for (d, path), curve in curves.items()
        if d != "none"
    }
    pays = "; ".join(
        f"{key}: " + ("never" if c is None else rf"$c \approx {c:.1f}$") for key, c in crossovers.items()
    )
    caption = (
        f"The engine under load{against} ({record['num_requests']} requests per level). Where a "
        f"drafter's throughput first falls below no drafter's (log-linear interpolation): {pays}."
    )
    return Summary(
        title="Speculation under load",
        tables=(table_from_rows("engine-concurrency", caption, columns, rows),),
        figures=_figures(curves),
        notes=f"crossover concurrency: {crossovers}",
        extra={"crossover_concurrency": crossovers},
    )


def _curves(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The summary rows by (drafter, path), each in level order."""
    curves: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        curves.setdefault((r["drafter"], r["path"]), []).append(r)
    return curves


def _figures(curves: dict[tuple[str, str], list[dict[str, Any]]]) -> tuple[Any, ...]:
    """System tok/s and each drafter's ratio to no drafter against c, a curve per drafter and path."""
    from specdec.summary import Figure, Series, series_from_rows

    levels = sorted({r["concurrency"] for curve in curves.values() for r in curve})

    def series(y: str, skip_none: bool) -> tuple[Series, ...]:
        return tuple(
            series_from_rows(
                curve,
                "concurrency",
                y,
                label=f"{d} ({path.removeprefix('engine/')})",
                style="dashed" if path == "engine/staggered" else "line+markers",
                group=d,
            )
            for (d, path), curve in curves.items()
            if not (skip_none and d == "none")
        )

    return (
        Figure(
            name="throughput",
            caption="System tokens per second against concurrency (together solid, staggered dashed).",
            xlabel="concurrency $c$",
            ylabel="tokens/s (all requests)",
            series=series("tokens_per_second", skip_none=False),
        ),
        Figure(
            name="speedup",
            caption="Throughput of each drafter over no drafter on the same path against concurrency.",
            xlabel="concurrency $c$",
            ylabel="x none",
            series=(
                *series("x_none", skip_none=True),
                Series(label="break-even", x=levels, y=[1.0] * len(levels), style="dashed", group="none"),
            ),
        ),
    )


def crossover(points: Sequence[tuple[int, float | None]]) -> float | None:
    """Where a speedup first falls below 1: the smallest c if it is below 1 there, else interpolated
    linearly in log2(c) between the last level with speedup >= 1 and the next one; None when it never
    does. Points without a speedup are skipped."""
    points = sorted((c, s) for c, s in points if s is not None)
    if points and points[0][1] < 1.0:
        return float(points[0][0])
    for (c0, s0), (c1, s1) in zip(points, points[1:], strict=False):
        if s0 >= 1.0 > s1:
            w = (s0 - 1.0) / (s0 - s1)
            return 2 ** (math.log2(c0) + w * (math.log2(c1) - math.log2(c0)))
    return None


def _write(out_dir: Path, payload: dict[str, Any]) -> None:
    from specdec.bench.report import benchmark_document
    from specdec.summary import write_results

    document = benchmark_document(
        payload, experiment="engine-concurrency", summarize=summarize, description=__doc__.split("\n\n")[0]
    )
    env = payload["environment"]
    lines = [
        f"# Speculation under load ({env['cpu']}, ISA path {env['isa']}, {env['torch_threads']} threads, "
        f"commit {env['commit']})",
        "",
        f"`{payload['command']}`; {payload['num_requests']} requests per level.",
        "",
        "| c | drafter | path | tok/s | × none (same path) | TPOT P50 ms | TPOT P99 ms | α | τ | = solo "
        "| depth changes / request | scheduler % of step | draft ms/step (without owed catch-up) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    picked = median_rows(payload["rows"])
    if any(r["repeats"] > 1 for r in picked):
        ratios = "".join(f"; {line}" for line in ratio_lines(payload["rows"]))
        lines[2] += f" Each row: the repeat of median throughput{ratios}."
    base = {(r["concurrency"], r["path"]): r["tokens_per_second"] for r in picked if r["drafter"] == "none"}
    for r in picked:
        ref = base.get((r["concurrency"], r["path"]))
        ratio = f"{r['tokens_per_second'] / ref:.2f}" if ref else "–"
        p50 = "–" if r["tpot_p50_s"] is None else f"{1e3 * r['tpot_p50_s']:.1f}"
        p99 = "–" if r["tpot_p99_s"] is None else f"{1e3 * r['tpot_p99_s']:.1f}"
        same = "–" if r["equal_solo"] is None else f"{r['equal_solo']:.0%}"
        changes = (
            "–" if r.get("depth_changes_per_request") is None else f"{r['depth_changes_per_request']:.1f}"
        )
        sched = "–" if r.get("scheduler_share") is None else f"{100 * r['scheduler_share']:.1f}"
        draft = "–" if r.get("draft_ms_per_step") is None else f"{r['draft_ms_per_step']:.2f}"
        if r.get("drafting_ms_per_step") is not None:
            draft += f" ({r['drafting_ms_per_step']:.2f})"
        lines.append(
            f"| {r['concurrency']} | {r['drafter']} | {r['path']} | {r['tokens_per_second']:.1f} | {ratio} | "
            f"{p50} | {p99} | {r['alpha']:.2f} | {r['tau']:.2f} | {same} | {changes} | {sched} | {draft} |"
        )
    write_results(out_dir / "concurrency.json", document, "\n".join(lines))


def add_concurrency_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.cli_args import add_engine_arguments, csv, positive_int, seed_int

    add_engine_arguments(p, drafter=None, gamma=None, verify=False)
    p.set_defaults(command="python -m specdec.bench.concurrency")  # the results' command (main: in full)
    p.add_argument("--prompt-set", type=csv(str), default=("humaneval", "mtbench"))
    p.add_argument("--num-prompts", type=positive_int, default=8, help="per prompt set")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--drafters", type=csv(str), default=("none", "ngram", "eagle", "default"))
    p.add_argument("--concurrency", type=csv(positive_int), default=(1, 2, 4, 8))
    p.add_argument("--engine-gamma", default="auto", help="the engine's depth policy (auto, fixed, ...)")
    p.add_argument("--out", default="results/concurrency")
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="alternations of the whole run in one process; tables give the median repeat",
    )


def from_bench_args(args: argparse.Namespace) -> argparse.Namespace:
    """``specdec bench --concurrency ...``: this benchmark's options from the bench's (the first
    temperature; the engine's ``auto`` depth policy; results under ``--out``)."""
    from specdec.bench.report import command_line

    return argparse.Namespace(
        target=args.target,
        backend=args.backend,
        weights=args.weights,
        device=args.device,
        dtype=args.dtype,
        compile=args.compile,
        prompt_set=args.prompt_set,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperatures[0],
        seed=args.seed,
        chat=args.chat,
        drafters=args.drafters,
        concurrency=args.concurrency,
        engine_gamma="auto",
        out=args.out,
        repeats=getattr(args, "repeats", 1),
        command=command_line("specdec"),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specdec.bench.concurrency``."""
    from rich.console import Console

    from specdec.bench.report import command_line

    parser = argparse.ArgumentParser(
        prog="python -m specdec.bench.concurrency", description=__doc__.split("\n\n")[0]
    )
    add_concurrency_arguments(parser)
    args = parser.parse_args(argv)
    args.command = command_line("python -m specdec.bench.concurrency", argv)
    if args.engine_gamma.isdigit():
        args.engine_gamma = int(args.engine_gamma)
    try:
        run_concurrency(args, Console(stderr=True))
    except ValueError as e:
        print(f"python -m specdec.bench.concurrency: error: {e}", file=sys.stderr)
        return 2
    print(
        f"results: {Path(args.out) / 'concurrency.json'}, {Path(args.out) / 'concurrency.md'}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
