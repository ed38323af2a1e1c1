"""The figures, table, plot and results file of ``specdec bench-serve``.

:func:`level_figures` turns one level's requests (:class:`~specdec.bench.serve_load.LevelRun`) into
``vllm bench serve``'s figures: completed and failed requests; request throughput (completed /
duration) and output tokens per second (output tokens of the completed requests / duration), the
duration running from the level's first send to its last request's end; goodput (completed requests
that meet every ``--goodput`` SLO, per second); and mean, P50, P90 and P99 of TTFT, TPOT, ITL and
E2EL in milliseconds (percentiles interpolated linearly, as ``numpy.percentile``; TPOT over requests
of more than one token, ITL pooled over every gap of every completed request).

:func:`write_results` writes, under ``--out``: ``bench-serve.json`` (the ``specdec.summary/1``
schema: a table with a row per server and level, two figures of latency against throughput, and the
raw record beside them: command, CPU, ISA path, per server its launch command and per level its
figures, acceptance and requests), ``bench-serve.md`` (the table as Markdown) and, per server that
ran, ``bench-serve-<server>.png``: TTFT P50 and TPOT P50 against output tokens per second.

Speculation, two ways, side by side in the table: from the server's ``/metrics`` counters over the
level (α, τ, and α at each draft position: accepted at that position / drafts), and from the
responses' own counts, summed over the level (accepted of drafted: ``usage`` for ours, ``timings``
for llama-server); both servers count the same way, so ours and llama.cpp's compare on the same
prompts and head.

Structured output, for a level with requests that carry a JSON schema (``--prompt-set json``): the
counts of :func:`specdec.bench.json_prompts.json_validity`, ``json_valid``, ``json_invalid`` and
``json_length`` in the level's JSON, and one Markdown column, valid / stop / length (stop: the
outputs that ended by themselves, valid or not; length: those cut at ``max_tokens``).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specdec.bench.serve_load import LevelRun
from specdec.percentile import percentile
from specdec.summary import Figure, Summary, series_from_points, table_from_rows

__all__ = [
    "GOODPUT_METRICS",
    "LATENCIES",
    "STATS",
    "parse_goodput",
    "level_figures",
    "level_label",
    "summarize",
    "markdown",
    "plot_server",
    "machine",
    "server_slug",
    "write_results",
]

LATENCIES = ("ttft", "tpot", "itl", "e2el")
"""The latency figures, each as ``<name>_<stat>_ms``."""
STATS = ("mean", "p50", "p90", "p99")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
"""What ``--goodput`` may bound (``vllm bench serve``'s names), in milliseconds."""
EXPERIMENT = "bench-serve"


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` → ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds); anything else
    (an unknown metric, a repeated one, a value that is not a finite number > 0) is a ``ValueError``
    naming ``--goodput``."""
    slos: dict[str, float] = {}
    for item in items:
        name, colon, raw = item.partition(":")
        name = name.strip().lower()
        if not colon or name not in GOODPUT_METRICS:
            raise ValueError(
                f"--goodput expects METRIC:MS with METRIC one of {', '.join(GOODPUT_METRICS)}, got {item!r}"
            )
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"--goodput {name}: expected milliseconds (a number), got {raw!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"--goodput {name}: expected a finite number of milliseconds > 0, got {raw!r}")
        if name in slos:
            raise ValueError(f"--goodput names {name} twice")
        slos[name] = value
    return slos


def _stats(values_ms: Sequence[float]) -> dict[str, float | None]:
    return {
        "mean": sum(values_ms) / len(values_ms) if values_ms else None,
        "p50": percentile(values_ms, 50),
        "p90": percentile(values_ms, 90),
        "p99": percentile(values_ms, 99),
    }


def level_figures(run: LevelRun, goodput_ms: Mapping[str, float] | None = None) -> dict[str, Any]:
    """One level's figures (module doc): ``completed``, ``failed``, ``duration_s``,
    ``request_throughput``, ``output_throughput``, ``total_output_tokens``, ``goodput`` (None without
    SLOs), ``<latency>_<stat>_ms`` for :data:`LATENCIES` × :data:`STATS` (None without values),
    ``errors`` (each distinct error and its count), and ``usage_drafted`` / ``usage_accepted`` (the
    requests' own ``usage`` counts, summed; None unless every completed request reports them).
    A request with one output token has no TPOT and counts as within a TPOT SLO (as vLLM's)."""
    done = [r for r in run.results if r.ok]
    failed = [r for r in run.results if not r.ok]
    duration = run.duration_s
    tokens = sum(r.output_tokens for r in done)
    per_second = (lambda n: n / duration) if duration > 0 else (lambda n: None)
    ms = {
        "ttft": [1e3 * r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [1e3 * r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [1e3 * gap for r in done for gap in r.itl_s],
        "e2el": [1e3 * r.e2el_s for r in done if r.e2el_s is not None],
    }
    figures: dict[str, Any] = {
        "completed": len(done),
        "failed": len(failed),
        "duration_s": duration,
        "total_output_tokens": tokens,
        "request_throughput": per_second(len(done)),
        "output_throughput": per_second(tokens),
        "goodput": None,
    }
    if goodput_ms:
        good = 0
        for r in done:
            values = {"ttft": r.ttft_s, "tpot": r.tpot_s or 0.0, "e2el": r.e2el_s}
            good += all(1e3 * values[k] <= slo for k, slo in goodput_ms.items())
        figures["goodput"] = per_second(good)
    for name in LATENCIES:
        for stat, value in _stats(ms[name]).items():
            figures[f"{name}_{stat}_ms"] = value
    figures["errors"] = dict(Counter(r.error for r in failed))
    reported = done and all(r.draft_tokens is not None and r.accepted_tokens is not None for r in done)
    figures["usage_drafted"] = sum(r.draft_tokens for r in done) if reported else None
    figures["usage_accepted"] = sum(r.accepted_tokens for r in done) if reported else None
    return figures


def level_label(level: Mapping[str, Any]) -> str:
    """``c=4`` for a closed-loop level; ``2 req/s`` (``, burstiness 0.5`` unless 1) for an open one."""
    if level["mode"] == "concurrency":
        return f"c={level['concurrency']}"
    rate = level["request_rate"]
    text = "inf req/s" if rate is None or math.isinf(rate) else f"{rate:g} req/s"
    return text + (f", burstiness {level['burstiness']:g}" if level.get("burstiness", 1.0) != 1.0 else "")


def _acceptance_value(level: Mapping[str, Any], key: str) -> float | None:
    acc = level.get("acceptance")
    return acc.get(key) if acc else None


def _rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for server in record["servers"]:
        for level in server.get("levels", ()):
            row = {"server": server["name"], "load": level_label(level)}
            keys = ("completed", "failed", "request_throughput", "output_throughput", "goodput")
            row |= {k: level.get(k) for k in keys}
            row |= {f"{n}_{s}_ms": level.get(f"{n}_{s}_ms") for n in LATENCIES for s in STATS}
            row |= {"alpha": _acceptance_value(level, "alpha"), "tau": _acceptance_value(level, "tau")}
            by_position = _acceptance_value(level, "per_position")
            row["alpha_per_position"] = " / ".join(f"{a:.2f}" for a in by_position) if by_position else None
            drafted, accepted = level.get("usage_drafted"), level.get("usage_accepted")
            row |= {"response_drafted": drafted, "response_accepted": accepted}
            row["response_alpha"] = accepted / drafted if drafted and accepted is not None else None
            row |= {k: level.get(k) for k in ("json_valid", "json_invalid", "json_length")}
            rows.append(row)
    return rows


_COLUMNS = [
    ("server", "server", ""),
    ("load", "load", ""),
    ("completed", "ok", "d"),
    ("failed", "failed", "d"),
    ("request_throughput", "req/s", ".2f"),
    ("output_throughput", "out tok/s", ".1f"),
    ("goodput", "goodput req/s", ".2f"),
    *(
        (f"{n}_{s}_ms", f"{n.upper()} {s.upper() if s != 'mean' else 'mean'} ms", ".1f")
        for n in LATENCIES
        for s in STATS
    ),
    ("alpha", "$\\alpha$", ".2f"),
    ("tau", "$\\tau$", ".2f"),
    ("alpha_per_position", "$\\alpha$ by position", ""),
    ("response_drafted", "drafted (responses)", "d"),
    ("response_accepted", "accepted (responses)", "d"),
    ("response_alpha", "$\\alpha$ (responses)", ".2f"),
    ("json_valid", "JSON valid", "d"),
    ("json_invalid", "JSON invalid", "d"),
    ("json_length", "JSON at max tokens", "d"),
]


def _points(record: Mapping[str, Any], server: Mapping[str, Any], y: str) -> list[tuple[float, float]]:
    return [
        (lv["output_throughput"], lv[y])
        for lv in server.get("levels", ())
        if lv.get("output_throughput") is not None and lv.get(y) is not None
    ]


def summarize(record: Mapping[str, Any]) -> Summary:
    """The results-schema summary of a record: one table (a row per server and level) and two
    figures (TTFT P50 and TPOT P50 against output tokens per second, a curve per server)."""
    caption = (
        f"Load on OpenAI-compatible servers ({record['num_requests']} streamed requests per level, at most "
        f"{record['config']['max_tokens']} tokens each); latencies at the client, in ms, with vllm bench "
        "serve's definitions; $\\alpha$, $\\tau$ (and $\\alpha$ at each draft position) from the server's "
        "/metrics, drafted and accepted tokens from its responses; for requests with a JSON schema, the "
        "outputs that ended by themselves and validate, those that ended by themselves and do not, and "
        "those cut at max tokens"
    )
    figures = tuple(
        Figure(
            name=f"{y}-vs-throughput",
            caption=f"{y.upper()} P50 against output tokens per second, one point per load level",
            xlabel="output tokens / s",
            ylabel=f"{y.upper()} P50 (ms)",
            series=tuple(
                series_from_points(_points(record, s, f"{y}_p50_ms"), label=s["name"])
                for s in record["servers"]
                if s.get("levels")
            ),
        )
        for y in ("ttft", "tpot")
    )
    return Summary(
        title="Serving under load",
        tables=(table_from_rows(EXPERIMENT, caption, _COLUMNS, _rows(record)),),
        figures=figures,
    )


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return "–"
    return format(value, spec) if spec else str(value)


def machine(record: Mapping[str, Any]) -> str:
    """One line: the CPU, the ISA path of our kernels, the servers' threads, the commit."""
    env, threads = record["environment"], record["config"]["threads"]
    return (
        f"CPU: {env.get('cpu')} (kernels: {env.get('isa')} path), servers on {threads} "
        f"thread{'s' if threads != 1 else ''}, commit {env.get('commit')}"
    )


def markdown(record: Mapping[str, Any]) -> str:
    """The table as Markdown under the machine, the command and each server's launch command."""
    lines = [f"# Serving under load ({machine(record)})", ""]
    lines += [f"`{record['command']}`", ""] if record.get("command") else []
    for server in record["servers"]:
        how = server.get("skipped") or (
            f"`{server['launch']}`" if server.get("launch") else server["base_url"]
        )
        lines.append(f"- **{server['name']}**: {how}")
    lines += [
        "",
        f"{record['num_requests']} requests per level; latencies in ms at the client (mean / P50 / P90 / "
        "P99), as `vllm bench serve` defines them; α, τ and α by draft position from the server's "
        "`/metrics`; accepted / drafted tokens as its responses count them; JSON valid / stop / length: of "
        "the requests with a JSON schema, the outputs that ended by themselves (finish_reason stop) and "
        "validate, all that ended by themselves, and those cut at max_tokens.",
        "",
        "| server | load | ok | failed | req/s | out tok/s | goodput req/s | TTFT ms | TPOT ms | ITL ms "
        "| E2EL ms | α | τ | α by position | accepted / drafted (responses) | JSON valid / stop / length |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in _rows(record):
        cells = [row["server"], row["load"], _cell(row["completed"], "d"), _cell(row["failed"], "d")]
        cells += [_cell(row["request_throughput"], ".2f"), _cell(row["output_throughput"], ".1f")]
        cells.append(_cell(row["goodput"], ".2f"))
        for n in LATENCIES:
            cells.append(" / ".join(_cell(row[f"{n}_{s}_ms"], ".1f") for s in STATS))
        cells += [_cell(row["alpha"], ".2f"), _cell(row["tau"], ".2f"), _cell(row["alpha_per_position"], "")]
        drafted = row["response_drafted"]
        cells.append(
            "–"
            if drafted is None
            else f"{row['response_accepted']} / {drafted}"
            + ("" if row["response_alpha"] is None else f" ({row['response_alpha']:.2f})")
        )
        valid = row["json_valid"]
        cells.append(
            "–" if valid is None else f"{valid} / {valid + row['json_invalid']} / {row['json_length']}"
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def server_slug(name: str) -> str:
    """A file-name form of a server's name (``ours:default`` → ``ours-default``)."""
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or "server"


def plot_server(record: Mapping[str, Any], server: Mapping[str, Any], path: Path) -> Path | None:
    """``path`` (PNG): TTFT P50 and TPOT P50 against output tokens per second for one server, each
    point labelled with its load level; None (nothing written) when no level has figures."""
    levels = [lv for lv in server.get("levels", ()) if lv.get("output_throughput") is not None]
    if not levels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(5.5, 5.0), dpi=120, sharex=True)
    try:
        for ax, name in zip(axes, ("ttft", "tpot"), strict=True):
            pts = [(lv["output_throughput"], lv[f"{name}_p50_ms"], level_label(lv)) for lv in levels]
            pts = [p for p in pts if p[1] is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linewidth=1.4)
            for x, y, label in pts:
                ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
            ax.set_ylabel(f"{name.upper()} P50 (ms)")
            ax.grid(True, alpha=0.3)
        axes[-1].set_xlabel("output tokens / s")
        axes[0].set_title(f"{server['name']}: {machine(record)}", fontsize=7)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png", metadata={"Software": None})
    finally:
        plt.close(fig)
    return path


def write_results(out_dir: Path, record: Mapping[str, Any], *, plots: bool = True) -> list[Path]:
    """``bench-serve.json``, ``bench-serve.md`` and (``plots``) a plot per server under ``out_dir``
    (module doc); returns the paths written."""
    from specdec.bench.report import benchmark_document
    from specdec.summary import write_results

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    description = (
        "Streamed requests against OpenAI-compatible servers, closed and open loop, timed at the client."
    )
    document = benchmark_document(
        dict(record), experiment=EXPERIMENT, summarize=summarize, description=description
    )
    document["machine"] = machine(record)
    paths = write_results(out_dir / f"{EXPERIMENT}.json", document, markdown(record))
    for server in record["servers"] if plots else ():
        png = plot_server(record, server, out_dir / f"{EXPERIMENT}-{server_slug(server['name'])}.png")
        if png is not None:
            paths.append(png)
    return paths
