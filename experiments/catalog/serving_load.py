"""``serving-load``: the speedup of speculation against request rate, on ``specdec serve`` under load.

Speculative decoding spends spare compute on drafts; a server under load has less to spare, and the
serving engines' users ask for speculation that does not lose at high request rates (vLLM's and
SGLang's speculative-decoding docs; SmartSpec, arXiv 2406.14066, picks the depth by goodput). This
experiment measures it the way the serving engines do: one ``specdec serve`` per (drafter, γ
policy), loaded by ``specdec bench-serve``'s open-loop Poisson client at every request rate, and
compares each point with the server without a drafter (``none``) at the same rate.

One run is one server: started once (:func:`specdec.bench.serve_peers.launch`), one warm-up request,
then every rate of ``request_rates`` against it in the order given
(:func:`specdec.bench.serve_command.run_bench_serve` with ``--base-url``: the same prompts, arrival
times, figures and ``/metrics`` reads as ``specdec bench-serve --request-rate``), then SIGTERM. A run
is finished only when every rate is, so an interrupted sweep loses at most the server in progress.
Per rate: output tokens per second, TTFT / TPOT / ITL / E2EL (mean, P50, P90, P99; vLLM's
definitions, docs/serving.md), goodput under the SLOs of ``goodput``, and α, τ from the server's
``/metrics`` counters. The raw per-request record is ``<run>/bench-serve/bench-serve.json``.

A server without a drafter drafts nothing whatever its depth policy: a ``none`` config is stored at
``gamma="0"`` with no policy options, so the (``none``, policy) points of the grid are one run.

The summary, per (drafter, policy, rate): the speedup over ``none`` at the same rate and with every
other setting equal, as a ratio of output tokens per second and as ``none``'s TPOT P50 over this
point's (both above 1 when speculation wins); a point whose baseline is missing has none. Below
saturation the output tokens per second follow the arrival rate whatever the server's speed, so the
throughput ratio stays near 1 there and the TPOT ratio carries the latency gain; the throughput ratio
tells once the server saturates.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.catalog.specdec_runs import TINY_TARGET, DecodeRunConfig
from experiments.config import config_to_dict
from experiments.experiment import Experiment
from experiments.runner import RunContext
from experiments.store import RunRecord
from experiments.sweep import Sweep
from specdec.summary import Figure, Series, Summary, Table, series_from_points, table_from_rows

__all__ = [
    "BASELINE",
    "DRAFTERS",
    "GAMMA_POLICIES",
    "REQUEST_RATES",
    "ServingLoadConfig",
    "plan",
    "run_serving_load",
    "point_rows",
    "summarize",
    "EXPERIMENT",
]

BASELINE = "none"
"""The drafter every point is compared with: the same server without speculation."""
DRAFTERS = (BASELINE, "ngram", "default")
GAMMA_POLICIES = ("fixed", "auto")
"""``specdec serve --gamma`` values: ``fixed`` drafts γ = 4 every step, ``auto`` (goodput) picks the
depth per step from the measured verify cost and each row's acceptance (docs/serving.md)."""
REQUEST_RATES = (0.5, 1.0, 2.0, 4.0)
SERVE_MODULES = ("fastapi", "uvicorn", "sse_starlette", "prometheus_client", "httpx")
"""What a run imports or starts: the ``[serve]`` extra."""
_LATENCIES = ("ttft", "tpot", "itl", "e2el")
_STATS = ("mean", "p50", "p90", "p99")


@dataclass(frozen=True, kw_only=True)
class ServingLoadConfig(DecodeRunConfig):
    """One server (``specdec serve``: target, drafter, γ policy, slots, threads) loaded at every rate.

    ``seed`` is sent with every request and draws the arrival times."""

    drafter: str = "default"
    """``specdec serve --drafter``; ``none`` is the baseline"""
    gamma: str = "auto"
    """``specdec serve --gamma``: a depth policy (fixed, auto, batch-table, goodput) or a depth"""
    gamma_options: tuple[str, ...] = ()
    """``--gamma-option KEY=VALUE`` items, e.g. ``gamma=6``"""
    request_rates: tuple[float, ...] = REQUEST_RATES
    """open-loop rates in requests per second, loaded in this order"""
    burstiness: float = 1.0
    """gamma shape of the arrival gaps: 1 = Poisson"""
    prompt_sets: tuple[str, ...] = ("humaneval", "mtbench")
    num_prompts: int = 8
    """prompts per set (evenly spaced): each rate sends len(prompt_sets) · num_prompts requests"""
    max_tokens: int = 128
    endpoint: str = "chat"
    """``completions`` or ``chat`` (the target's chat template)"""
    threads: int = 2
    """``specdec serve --threads``"""
    max_num_seqs: int = 8
    """``specdec serve --max-num-seqs``: requests decoding at once"""
    goodput: tuple[str, ...] = ("ttft:1000", "tpot:50")
    """SLOs in ms (``METRIC:MS``, metrics ttft, tpot, e2el): goodput counts requests meeting all"""
    warmup_requests: int = 1
    request_timeout_s: float = 600.0
    startup_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("target", "drafter", "gamma"):
            if not getattr(self, name).strip():
                raise ValueError(f"ServingLoadConfig.{name} must be a non-empty string")
        if self.drafter == BASELINE:  # drafts nothing whatever the policy: one run (module doc)
            object.__setattr__(self, "gamma", "0")
            object.__setattr__(self, "gamma_options", ())
        elif self.gamma.strip() == "0":
            raise ValueError(
                f"ServingLoadConfig.gamma '0' drafts nothing: use drafter {BASELINE!r} for the baseline, "
                f"or a depth >= 1 or a policy name with drafter {self.drafter!r}"
            )
        if not self.request_rates or min(self.request_rates) <= 0:
            raise ValueError(
                f"ServingLoadConfig.request_rates must be rates > 0 (req/s), got {self.request_rates}"
            )
        if len(set(self.request_rates)) != len(self.request_rates):
            raise ValueError(f"ServingLoadConfig.request_rates repeats a rate: {self.request_rates}")
        self.at_least(threads=1, max_num_seqs=1)
        try:  # the load's own checks: endpoint, prompt sets, SLOs, sizes, timeouts
            bench_config(self, "http://127.0.0.1", out=Path("."))
        except ValueError as err:
            raise ValueError(f"ServingLoadConfig: {err}") from None


def bench_config(config: ServingLoadConfig, base_url: str, *, out: Path) -> Any:
    """The ``specdec bench-serve`` config that loads the server at ``base_url`` at every rate: each
    field of it this config has, from the field of its name (not ``gamma``: the server's, on its own
    command line)."""
    import dataclasses

    from specdec.bench.serve_command import BenchServeConfig

    ours = {f.name for f in dataclasses.fields(config)} - {"gamma"}
    names = [f.name for f in dataclasses.fields(BenchServeConfig) if f.name in ours]
    return BenchServeConfig(base_url=base_url, out=str(out), **{n: getattr(config, n) for n in names})


def plan(*, smoke: bool = False) -> Sweep:
    """Drafters none, ngram, default × policies fixed, auto (none once): 5 servers, 4 rates each.
    Smoke: none and ngram (auto) on the tiny random Llama, 2 requests of 8 tokens at 2 rates."""
    if smoke:
        base = ServingLoadConfig(
            target=TINY_TARGET,
            request_rates=(4.0, 16.0),
            prompt_sets=("humaneval", "mtbench"),
            num_prompts=1,
            max_tokens=8,
            threads=1,
            max_num_seqs=2,
            startup_timeout_s=120.0,
            request_timeout_s=60.0,
        )
        return Sweep(base, {"drafter": [BASELINE, "ngram"], "gamma": ["auto"]})
    return Sweep(ServingLoadConfig(), {"drafter": list(DRAFTERS), "gamma": list(GAMMA_POLICIES)})


# --- one run ---------------------------------------------------------------------------------------


def _check_policy(config: ServingLoadConfig) -> None:
    """Build the depth policy here, so a wrong name or option fails before a server starts."""
    from specdec.cli_args import parse_options
    from specdec.engine.depth import make_depth_policy

    gamma: int | str = int(config.gamma) if config.gamma.strip().isdigit() else config.gamma
    make_depth_policy(gamma, parse_options(config.gamma_options, "ServingLoadConfig.gamma_options"))


def _point(level: Mapping[str, Any]) -> dict[str, Any]:
    """One rate's figures as stored in ``result.json`` (bench-serve's level, less its requests)."""
    acc = level.get("acceptance") or {}
    return {
        "request_rate": level["request_rate"],
        **{k: level[k] for k in ("completed", "failed", "duration_s", "total_output_tokens")},
        **{k: level[k] for k in ("request_throughput", "output_throughput", "goodput")},
        **{f"{n}_{s}_ms": level[f"{n}_{s}_ms"] for n in _LATENCIES for s in _STATS},
        **{k: acc.get(k) for k in ("alpha", "tau", "drafts", "drafted", "accepted")},
        "errors": level["errors"],
    }


def run_serving_load(config: ServingLoadConfig, ctx: RunContext) -> dict:
    """Start the server, load it at every rate (one ``ctx.log`` step per rate), stop it."""
    missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"serving-load needs {', '.join(missing)}: pip install -e '.[serve]'")
    from experiments.catalog.specdec_runs import tiny_checkpoint
    from specdec.bench import serve_peers as peers
    from specdec.bench.serve_command import run_bench_serve
    from specdec.bench.serve_report import machine

    _check_policy(config)
    target = str(tiny_checkpoint()) if config.target == TINY_TARGET else config.target
    port = peers.free_port()
    command = peers.ours_command(
        config.drafter, target=target, threads=config.threads, max_num_seqs=config.max_num_seqs, port=port
    )
    command += ["--gamma", config.gamma, "--device", config.device]
    if config.dtype is not None:
        command += ["--dtype", config.dtype]
    ctx.record_env({"device": config.device, "dtype": config.dtype})  # where the server was asked to run
    for option in config.gamma_options:
        command += ["--gamma-option", option]
    name = f"ours:{config.drafter}" + ("" if config.drafter == BASELINE else f"@{config.gamma}")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    server = peers.launch(
        name,
        command,
        ctx.run_dir / "server.log",
        port=port,
        startup_timeout_s=config.startup_timeout_s,
        env=env,
    )
    try:
        print(f"    {name}: {' '.join(command)}", flush=True)
        record = run_bench_serve(
            bench_config(config, server.base_url, out=ctx.run_dir / "bench-serve"),
            command=f"python -m experiments run serving-load ({ctx.run_id})",
            echo=lambda line: print(f"    {line}", flush=True),
        )
    finally:
        exit_status = server.stop(timeout_s=60.0)
    (entry,) = record["servers"]
    points = []
    for step, level in enumerate(entry["levels"]):
        point = _point(level)
        ctx.log({k: v for k, v in point.items() if k != "errors"}, step=step)
        points.append(point)
    env_record = record["environment"]
    return {
        "server": name,
        "launch": " ".join(command),
        "server_exit_status": exit_status,
        "model": entry.get("model"),
        "warmup_failed": entry.get("warmup_failed"),
        "num_requests": record["num_requests"],
        "cpu": env_record.get("cpu"),
        "isa": env_record.get("isa"),
        "machine": machine(record),
        "levels": points,
    }


# --- summary ---------------------------------------------------------------------------------------


def _setting(config: ServingLoadConfig) -> str:
    """Everything a point shares with its baseline: the config less drafter, policy and rates."""
    fields = config_to_dict(config)
    for name in ("drafter", "gamma", "gamma_options", "request_rates"):
        fields.pop(name)
    return json.dumps(fields, sort_keys=True)


def _policy(config: ServingLoadConfig) -> str | None:
    if config.drafter == BASELINE:
        return None
    return config.gamma + (f" ({', '.join(config.gamma_options)})" if config.gamma_options else "")


def _ratio(numerator: Any, denominator: Any) -> float | None:
    if numerator is None or denominator is None or numerator <= 0 or denominator <= 0:
        return None
    return numerator / denominator


def point_rows(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """A row per (run, rate): its figures, and the speedups over the ``none`` run of the same setting
    at the same rate (``speedup_tps`` = tok/s over none's, ``speedup_tpot`` = none's TPOT P50 over
    this one's; None without that baseline point or without both figures)."""
    baseline: dict[tuple[str, float], Mapping[str, Any]] = {}
    for rec in records:
        if rec.config.drafter == BASELINE:
            for point in rec.result["levels"]:
                baseline[(_setting(rec.config), point["request_rate"])] = point
    order = {d: i for i, d in enumerate(DRAFTERS)}
    rows = []
    for rec in records:
        setting = _setting(rec.config)
        for point in rec.result["levels"]:
            base = baseline.get((setting, point["request_rate"]))
            row = {
                "drafter": rec.config.drafter,
                "policy": _policy(rec.config),
                "rate": point["request_rate"],
                **{k: v for k, v in point.items() if k not in ("request_rate", "errors")},
                "speedup_tps": _ratio(point["output_throughput"], base and base["output_throughput"]),
                "speedup_tpot": _ratio(base and base["tpot_p50_ms"], point["tpot_p50_ms"]),
            }
            rows.append(row)
    return sorted(
        rows, key=lambda r: (order.get(r["drafter"], len(order)), r["drafter"], r["policy"] or "", r["rate"])
    )


def _sizes(records: Sequence[RunRecord]) -> str:
    cfg = records[0].config if records else ServingLoadConfig()
    cpu = {(r.result.get("cpu"), r.result.get("isa")) for r in records}
    machine = "; ".join(f"{c} ({isa} kernels)" for c, isa in sorted(cpu, key=str))
    slos = ", ".join(cfg.goodput) or "none"
    return (
        f"{cfg.target}, {len(cfg.prompt_sets) * cfg.num_prompts} streamed {cfg.endpoint} requests per rate "
        f"({cfg.num_prompts} each from {', '.join(cfg.prompt_sets)}), at most {cfg.max_tokens} tokens, "
        f"$T={cfg.temperature:g}$, arrivals Poisson"
        + ("" if cfg.burstiness == 1.0 else f" (burstiness {cfg.burstiness:g})")
        + f"; servers on {cfg.threads} thread(s) with {cfg.max_num_seqs} slots"
        + (f", {machine}" if machine else "")
        + f"; goodput SLOs (ms) {slos}"
    )


def _tables(rows: list[dict[str, Any]], sizes: str) -> tuple[Table, Table]:
    speed = table_from_rows(
        "speedup",
        "Speculation under load on \\texttt{specdec serve}: per drafter, $\\gamma$ policy and offered "
        "request rate, output tokens/s and TPOT P50 (ms), and the speedup over the server without a "
        "drafter at the same rate: $\\times$tok/s = tok/s over none's, $\\times$TPOT = none's TPOT P50 "
        "over this one's (above 1: speculation wins). Below saturation tok/s follows the arrival rate, "
        "so $\\times$tok/s stays near 1 and $\\times$TPOT carries the gain. $\\alpha$, $\\tau$ from the "
        f"server's /metrics over the rate's requests. {sizes}.",
        [
            ("drafter", "Drafter", ""),
            ("policy", "$\\gamma$ policy", ""),
            ("rate", "req/s", "g"),
            ("output_throughput", "tok/s", ".1f"),
            ("speedup_tps", "$\\times$tok/s", ".2f"),
            ("tpot_p50_ms", "TPOT P50", ".1f"),
            ("speedup_tpot", "$\\times$TPOT", ".2f"),
            ("goodput", "Goodput", ".2f"),
            ("alpha", "$\\alpha$", ".2f"),
            ("tau", "$\\tau$", ".2f"),
        ],
        rows,
    )
    latency = table_from_rows(
        "latency",
        "Latency percentiles at the client (ms, vLLM's definitions: TTFT to the first token, TPOT = "
        "(E2EL $-$ TTFT) / (tokens $-$ 1), ITL between streamed chunks, so a draft block accepted at "
        f"once is one gap) per drafter, $\\gamma$ policy and request rate; requests answered and failed. "
        f"{sizes}.",
        [
            ("drafter", "Drafter", ""),
            ("policy", "$\\gamma$ policy", ""),
            ("rate", "req/s", "g"),
            ("completed", "ok", "d"),
            ("failed", "failed", "d"),
            ("ttft_p50_ms", "TTFT P50", ".0f"),
            ("ttft_p99_ms", "TTFT P99", ".0f"),
            ("tpot_p50_ms", "TPOT P50", ".1f"),
            ("tpot_p99_ms", "TPOT P99", ".1f"),
            ("itl_p50_ms", "ITL P50", ".1f"),
            ("itl_p99_ms", "ITL P99", ".1f"),
        ],
        rows,
    )
    return speed, latency


def _figure(rows: list[dict[str, Any]], sizes: str) -> Figure:
    """Speedup against request rate: per (drafter, policy) the TPOT ratio (solid) and the tok/s ratio
    (dashed) in one colour, and the break-even line."""
    series: list[Series] = []
    lines = sorted({(r["drafter"], r["policy"]) for r in rows if r["drafter"] != BASELINE}, key=str)
    for drafter, policy in lines:
        mine = [r for r in rows if (r["drafter"], r["policy"]) == (drafter, policy)]
        label = f"{drafter}, {policy}"
        for key, what, style in (
            ("speedup_tpot", "TPOT", "line+markers"),
            ("speedup_tps", "tok/s", "dashed"),
        ):
            points = [(r["rate"], r[key]) for r in mine if r[key] is not None]
            if points:
                series.append(series_from_points(points, label=f"{label} ({what})", style=style, group=label))
    rates = sorted({r["rate"] for r in rows})
    if rates:
        series.append(Series(label="break-even", x=rates, y=[1.0] * len(rates), style="dashed", group="none"))
    return Figure(
        name="speedup-vs-rate",
        caption="Speedup of speculation over the server without a drafter against the offered request "
        "rate, per drafter and $\\gamma$ policy: none's TPOT P50 over this one's (solid) and output "
        f"tokens/s over none's (dashed), at the same rate. {sizes}.",
        xlabel="request rate (req/s)",
        ylabel="speedup over no drafter",
        series=tuple(series),
        ymin=0.0,
    )


def summarize(records: Sequence[RunRecord]) -> Summary:
    """Two tables (speedup, latency) with a row per (drafter, policy, rate), and the speedup figure."""
    rows = point_rows(records)
    sizes = _sizes(records)
    missing = [
        f"{r['drafter']} {r['policy']} at {r['rate']:g} req/s"
        for r in rows
        if r["speedup_tps"] is None or r["speedup_tpot"] is None
    ]
    notes = []
    if missing:
        why = f"no {BASELINE} point at that rate and setting, or a figure missing"
        notes.append(f"points without a speedup ({why}): " + "; ".join(missing) + ".")
    failed = [r.result["server"] for r in records if r.result.get("server_exit_status") != 0]
    if failed:
        notes.append("server(s) that did not exit 0 after SIGTERM: " + ", ".join(failed) + ".")
    return Summary(
        title="Speculation under load: speedup against request rate",
        tables=_tables(rows, sizes),
        figures=(_figure(rows, sizes),) if rows else (),
        notes=" ".join(notes),
        extra={"missing_speedup": missing},
    )


EXPERIMENT = Experiment(
    name="serving-load",
    description="specdec serve under open-loop Poisson load: drafter x gamma policy x request rate, tok/s, "
    "TTFT/TPOT/ITL P50/P99, goodput, alpha/tau, and the speedup over no drafter at the same rate",
    plan=plan,
    runners={ServingLoadConfig: run_serving_load},
    summarize=summarize,
)
