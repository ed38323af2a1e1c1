"""CI smoke: every registered experiment at its --smoke size, then ``paper build`` on the summaries."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from experiments.registry import EXPERIMENTS, get_experiment
from experiments.runner import run_experiment
from experiments.summary import publish_summary
from paper.build import build


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
