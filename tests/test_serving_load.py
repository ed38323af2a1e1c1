"""``serving-load``: its plan (the ``none`` server once), config checks, the figures it keeps from a
bench-serve level, and the summary's speedup over ``none`` at the same rate (with missing points).
No server starts here: the smoke run in ``test_experiments_smoke.py`` starts two."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("httpx", reason="serving-load loads the server through bench-serve's httpx client")

from experiments.catalog import serving_load as sl  # noqa: E402
from experiments.runner import plan_configs  # noqa: E402
from experiments.store import RunRecord  # noqa: E402
from specdec.bench.serve_load import LevelRun, RequestResult  # noqa: E402
from specdec.bench.serve_report import level_figures, parse_goodput  # noqa: E402


def level(rate: float, tps: float | None, tpot_ms: float | None, **extra) -> dict:
    """A stored point: the figures the summary reads, the others left unset."""
    point = {
        f"{n}_{s}_ms": None for n in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "p50", "p90", "p99")
    }
    point |= {
        "request_rate": rate, "completed": 4, "failed": 0, "duration_s": 1.0, "total_output_tokens": 64,
        "request_throughput": 1.0, "output_throughput": tps, "goodput": 1.0, "tpot_p50_ms": tpot_ms,
        "alpha": None, "tau": None, "drafts": 0.0, "drafted": 0.0, "accepted": 0.0, "errors": {},
    }  # fmt: skip
    return point | extra


def record(config: sl.ServingLoadConfig, *points: dict, exit_status: int = 0) -> RunRecord:
    result = {"server": f"ours:{config.drafter}", "server_exit_status": exit_status, "levels": list(points)}
    return RunRecord(run_id=config.drafter, run_dir=Path("."), config=config, result=result)


def test_plan_runs_the_none_server_once():
    full = sl.EXPERIMENT.configs()
    assert len(sl.EXPERIMENT.sweeps()[0]) == 6 and len(full) == 5  # (none, fixed) = (none, auto)
    assert {(c.drafter, c.gamma) for c in full} == {
        ("none", "0"), ("ngram", "fixed"), ("ngram", "auto"), ("default", "fixed"), ("default", "auto"),
    }  # fmt: skip
    assert all(c.request_rates == (0.5, 1.0, 2.0, 4.0) and c.endpoint == "chat" for c in full)
    smoke = sl.EXPERIMENT.configs(smoke=True)
    assert [c.drafter for c in smoke] == ["none", "ngram"] and smoke[0].target == "tiny-random"
    # what docs/experiments.md's small run passes with --config
    small = plan_configs(
        sl.EXPERIMENT,
        base_overrides={"request_rates": [0.5, 2], "num_prompts": 4, "max_tokens": 64},
        axis_overrides={"drafter": ["none", "default"], "gamma": ["auto"]},
    )
    assert [(c.drafter, c.gamma, c.request_rates) for c in small] == [
        ("none", "0", (0.5, 2.0)), ("default", "auto", (0.5, 2.0)),
    ]  # fmt: skip


def test_config_checks_name_the_field():
    none = sl.ServingLoadConfig(drafter="none", gamma="fixed", gamma_options=("gamma=6",))
    assert (none.gamma, none.gamma_options) == ("0", ())
    with pytest.raises(ValueError, match="gamma '0' drafts nothing"):
        sl.ServingLoadConfig(drafter="ngram", gamma="0")
    for bad in ((), (1.0, -2.0)):
        with pytest.raises(ValueError, match="request_rates must be rates > 0"):
            sl.ServingLoadConfig(request_rates=bad)
    with pytest.raises(ValueError, match="repeats a rate"):
        sl.ServingLoadConfig(request_rates=(1, 1.0))
    with pytest.raises(ValueError, match="ServingLoadConfig.request_rates"):
        sl.ServingLoadConfig(request_rates=(float("inf"),))
    with pytest.raises(ValueError, match="--endpoint"):
        sl.ServingLoadConfig(endpoint="embeddings")
    with pytest.raises(ValueError, match="--goodput"):
        sl.ServingLoadConfig(goodput=("latency:5",))
    with pytest.raises(ValueError, match="max_num_seqs"):
        sl.ServingLoadConfig(max_num_seqs=0)


def test_a_point_keeps_bench_serves_level_figures():
    results = [
        RequestResult(index=0, ok=True, ttft_s=0.1, e2el_s=0.5, itl_s=[0.1] * 4, output_tokens=5),
        RequestResult(index=1, ok=False, error="HTTP 503: busy"),
    ]
    figures = level_figures(LevelRun(results, duration_s=2.0), parse_goodput(["ttft:200"]))
    acceptance = {"drafts": 4.0, "drafted": 8.0, "accepted": 6.0, "alpha": 0.75, "tau": 2.5}
    point = sl._point({"mode": "rate", "request_rate": 2.0, **figures, "acceptance": acceptance})
    assert point["request_rate"] == 2.0 and (point["completed"], point["failed"]) == (1, 1)
    assert point["output_throughput"] == pytest.approx(2.5) and point["goodput"] == pytest.approx(0.5)
    assert point["tpot_p50_ms"] == pytest.approx(100.0) and point["ttft_p99_ms"] == pytest.approx(100.0)
    assert (point["alpha"], point["tau"], point["drafted"]) == (0.75, 2.5, 8.0)
    assert point["errors"] == {"HTTP 503: busy": 1}
    bare = sl._point({"request_rate": 1.0, **figures, "acceptance": None})  # a server without /metrics
    assert bare["alpha"] is None and bare["drafts"] is None


def test_speedup_is_against_none_at_the_same_rate_and_setting():
    none = sl.ServingLoadConfig(drafter="none", request_rates=(1.0, 2.0))
    ngram = sl.ServingLoadConfig(drafter="ngram", gamma="fixed", request_rates=(1.0, 2.0, 4.0))
    other = sl.ServingLoadConfig(drafter="ngram", gamma="auto", request_rates=(1.0,), max_tokens=64)
    records = [
        record(ngram, level(1.0, 15.0, 5.0), level(2.0, 20.0, 25.0), level(4.0, 30.0, 8.0)),
        record(none, level(1.0, 10.0, 10.0), level(2.0, 20.0, 20.0)),
        record(other, level(1.0, 12.0, 4.0)),  # max_tokens differs: no baseline of its own
    ]
    rows = sl.point_rows(records)
    got = [(r["drafter"], r["policy"], r["rate"], r["speedup_tps"], r["speedup_tpot"]) for r in rows]
    assert got == [
        ("none", None, 1.0, 1.0, 1.0),
        ("none", None, 2.0, 1.0, 1.0),
        ("ngram", "auto", 1.0, None, None),
        ("ngram", "fixed", 1.0, 1.5, 2.0),  # 15 / 10 tok/s; none's 10 ms over 5 ms
        ("ngram", "fixed", 2.0, 1.0, 0.8),  # slower per token at this rate
        ("ngram", "fixed", 4.0, None, None),  # none was not loaded at 4 req/s
    ]
    summary = sl.summarize(records)
    assert summary.extra["missing_speedup"] == ["ngram auto at 1 req/s", "ngram fixed at 4 req/s"]
    assert "ngram fixed at 4 req/s" in summary.notes
    speed, latency = summary.tables
    assert [t.name for t in summary.tables] == ["speedup", "latency"] and len(speed.rows) == len(
        latency.rows
    ) == 6
    (figure,) = summary.figures
    curves = {s.label: (s.x, s.y) for s in figure.series}
    assert curves["ngram, fixed (TPOT)"] == ((1.0, 2.0), (2.0, 0.8))
    assert curves["ngram, fixed (tok/s)"] == ((1.0, 2.0), (1.5, 1.0))
    assert "ngram, auto (TPOT)" not in curves  # no point with a speedup: no curve
    assert curves["break-even"] == ((1.0, 2.0, 4.0), (1.0, 1.0, 1.0))


def test_a_point_without_figures_has_no_speedup():
    none = sl.ServingLoadConfig(drafter="none", request_rates=(1.0, 2.0))
    ngram = sl.ServingLoadConfig(drafter="ngram", request_rates=(1.0, 2.0))
    records = [
        record(none, level(1.0, 0.0, None), level(2.0, 20.0, 20.0)),  # nothing answered at 1 req/s
        record(ngram, level(1.0, 12.0, 6.0), level(2.0, None, 10.0), exit_status=-9),
    ]
    rows = {r["rate"]: r for r in sl.point_rows(records) if r["drafter"] == "ngram"}
    assert (rows[1.0]["speedup_tps"], rows[1.0]["speedup_tpot"]) == (None, None)
    assert (rows[2.0]["speedup_tps"], rows[2.0]["speedup_tpot"]) == (None, 2.0)
    summary = sl.summarize(records)
    assert "ours:ngram" in summary.notes and "did not exit 0" in summary.notes
    assert sl.summarize([]).tables[0].rows == () and sl.summarize([]).figures == ()
