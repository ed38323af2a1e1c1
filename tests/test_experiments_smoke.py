"""CI smoke: every registered experiment at its --smoke size, then ``paper build`` on the summaries."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from experiments.registry import EXPERIMENTS, get_experiment
from experiments.runner import run_experiment
from paper.build import build
from specdec.summary import publish_summary

pytestmark = pytest.mark.slow  # every experiment end to end, ~10 s


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory):
    """Run each experiment's smoke plan once; returns {name: summary dict} and the output folder."""
    out = tmp_path_factory.mktemp("smoke")
    summaries = {}
    for name in EXPERIMENTS.names():
        report = run_experiment(get_experiment(name), out=out, smoke=True, console=Console(quiet=True))
        assert not report.failed and report.summary_path is not None, name
        summaries[name] = json.loads(report.summary_path.read_text())
    return summaries, out


def test_every_experiment_has_a_smoke_run(smoke_results):
    summaries, _ = smoke_results
    assert (
        set(summaries) == set(EXPERIMENTS.names()) >= {"leviathan-table1", "moe-verify-cost", "switch-tables"}
    )
    for name, data in summaries.items():
        assert data["complete"] and data["smoke"] and data["num_runs"] == data["num_planned_runs"] > 0, name
        assert data["tables"] or data["figures"], name


def test_smoke_results_hold_the_exact_checks(smoke_results):
    summaries, _ = smoke_results
    table1 = summaries["leviathan-table1"]["tables"][0]["rows"]
    assert len(table1) == 6 and all(row["match"] == "yes" for row in table1)
    switch = {t["name"]: t["rows"] for t in summaries["switch-tables"]["tables"]}
    for row in switch["switch-loss"]:
        assert row["abs_error"] < 1e-6, row
    assert {row["source"] for row in switch["switch-loss"]} == {"formula", "moe"}
    for row in switch["drop-fraction"]:
        assert row["moe"] == row["reference"], row  # moe.MoE drops exactly what the reference count drops
        assert row["z"] is None or abs(row["z"]) < 5, row
    for row in summaries["moe-verify-cost"]["tables"][0]["rows"]:
        if row["n"] == 1:
            assert row["uniform"] == row["formula"] == int(row["experts"].split("/")[1])


def test_paper_builds_from_the_smoke_summaries(smoke_results, tmp_path):
    summaries, out = smoke_results
    results = tmp_path / "results"
    with pytest.raises(ValueError, match="--smoke run"):
        publish_summary(out / "leviathan-table1" / "summary.json", results)
    results.mkdir()
    for name in summaries:  # smoke summaries are never published; copy them by hand for the build
        (results / f"{name}.json").write_text((out / name / "summary.json").read_text())
    report = build(results, tmp_path / "paper", compile_pdf=False)
    assert not set(summaries) & set(report.placeholders)
    for name, data in summaries.items():
        tex = (tmp_path / "paper" / "tables" / f"{name}.tex").read_text()
        assert "Smoke run" in tex
        for figure in data["figures"]:
            assert (tmp_path / "paper" / "figures" / f"{name}--{figure['name']}.png").exists()


def test_smoke_results_of_the_engine_experiments(smoke_results):
    """Lossless decoding reproduces plain greedy output; lenience 1 is exact; tables are filled."""
    summaries, _ = smoke_results
    table3 = summaries["leviathan-table3-analog"]["tables"][0]["rows"]
    assert {"unigram", "bigram", "ngram", "layerskip"} <= {r["drafter"] for r in table3}
    assert any(r["paper_t0"] == "0.03 / 0.08 / 0.13" for r in table3 if r["drafter"] == "unigram")
    speed = {t["name"]: t["rows"] for t in summaries["speedup-table"]["tables"]}
    assert [r["category"] for r in speed["by-category"]] == ["humaneval", "mtbench/coding", "overall"]
    assert speed["overall"] and all(r["exact_match_rate"] == 1.0 for r in speed["overall"])
    gamma = summaries["gamma-sweep"]["tables"][0]["rows"]
    assert [r["gamma"] for r in gamma] == [0, 1, 2]
    assert gamma[0]["theory"] == pytest.approx(1.0) and all(r["exact"] == 1.0 for r in gamma[1:])
    lossy = summaries["lossy-quality"]["tables"][0]["rows"]
    plain = {r["temperature"]: r for r in lossy if r["lenience"] is None}
    exact = [r for r in lossy if r["lenience"] == 1.0 and r["temperature"] == 0.0]
    assert exact and {r["lenience"] for r in lossy} == {None, 1.0, 0.3}
    for row in exact:  # l = 1 is exact: greedy output equals plain greedy output
        assert row["exact"] == 1.0 and row["dloglik"] == pytest.approx(0.0, abs=1e-9)
        assert row["pass1"] == plain[0.0]["pass1"]


def test_smoke_results_of_serving_load(smoke_results):
    """Both tiny servers answered every request at every rate, with the same greedy tokens; the
    baseline's speedup over itself is 1; the drafter's counters came from /metrics."""
    summaries, _ = smoke_results
    rows = {t["name"]: t["rows"] for t in summaries["serving-load"]["tables"]}["speedup"]
    assert [(r["drafter"], r["rate"]) for r in rows] == [
        ("none", 4.0),
        ("none", 16.0),
        ("ngram", 4.0),
        ("ngram", 16.0),
    ]
    assert all(r["completed"] == 2 and r["failed"] == 0 and r["output_throughput"] > 0 for r in rows)
    none = {r["rate"]: r for r in rows if r["drafter"] == "none"}
    for row in rows:
        assert row["total_output_tokens"] == none[row["rate"]]["total_output_tokens"]  # lossless, T = 0
        assert row["speedup_tps"] == pytest.approx(
            row["output_throughput"] / none[row["rate"]]["output_throughput"]
        )
    assert all(r["speedup_tps"] == r["speedup_tpot"] == 1.0 and r["drafted"] == 0 for r in none.values())
    assert all(r["drafted"] is not None for r in rows if r["drafter"] == "ngram")
