"""``python -m specdec.bench.concurrency`` end to end on a tiny random Llama (byte tokenizer): every
level, drafter and path (the engine's two: no static batch since ``specdec.generate`` runs on the
engine) is a row; greedy requests equal their solo outputs; every row carries the scheduler's share of
the step time (a fraction strictly between 0 and 1); the Markdown table has the column."""

from __future__ import annotations

import argparse
import json

import pytest
from _tiny import save_tiny_checkpoint

from specdec.bench import concurrency
from specdec.engine.engine import scheduler_seconds

pytestmark = pytest.mark.usefixtures("one_thread")


def test_concurrency_bench_rows_solo_and_scheduler_share(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "tiny", seed=1)
    out = tmp_path / "out"
    argv = [
        "--target", str(path), "--num-prompts", "1", "--max-new-tokens", "6",
        "--drafters", "none,ngram", "--concurrency", "1,2", "--out", str(out),
    ]  # fmt: skip
    assert concurrency.main(argv) == 0
    record = json.loads((out / "concurrency.json").read_text())
    rows = record["raw"]["rows"] if "raw" in record else record["rows"]
    assert len(rows) == 2 * 2 * 2  # levels x drafters x paths
    assert {r["path"] for r in rows} == {"engine/together", "engine/staggered"}
    for r in rows:
        assert r["equal_solo"] == 1.0
        assert 0.0 < r["scheduler_share"] < 1.0
        assert 0.0 <= r["drafting_ms_per_step"] <= r["draft_ms_per_step"]  # owed catch-up left out
        assert r["tokens"] == 2 * 6
    table = (out / "concurrency.md").read_text()
    assert "scheduler % of step" in table
    # the summary the paper reads: a row per (level, drafter, path) with throughput for each, the
    # throughput and ratio figures, and where each drafter's ratio to none falls below 1
    summary = {t["name"]: t["rows"] for t in record["tables"]}["engine-concurrency"]
    assert [r["concurrency"] for r in summary] == [1] * 4 + [2] * 4
    assert all(r["tokens_per_second"] > 0 and r["x_none"] > 0 for r in summary)
    assert {f["name"] for f in record["figures"]} == {"throughput", "speedup"}
    assert set(record["extra"]["crossover_concurrency"]) == {
        "ngram engine/together",
        "ngram engine/staggered",
    }


def test_full_plan_and_bad_levels():
    """The default levels are c = 1, 2, 4, 8; a level below 1 is refused."""
    parser = argparse.ArgumentParser()
    concurrency.add_concurrency_arguments(parser)
    assert parser.parse_args([]).concurrency == (1, 2, 4, 8)
    with pytest.raises(SystemExit):
        parser.parse_args(["--concurrency", "0"])


def test_crossover_interpolates_in_log_concurrency():
    assert concurrency.crossover([(1, 2.0), (2, 1.5), (4, 1.2)]) is None
    assert concurrency.crossover([(4, 0.8), (1, 1.5), (2, 1.2)]) == pytest.approx(2 ** (1 + 0.2 / 0.4))
    assert concurrency.crossover([(1, 0.9), (2, 0.8)]) == 1.0
    assert concurrency.crossover([(1, 0.9), (2, 1.1), (4, 0.8)]) == 1.0  # below 1 from the start
    assert concurrency.crossover([(1, None), (2, 1.1), (4, 0.9)]) == pytest.approx(2**1.5)
    assert concurrency.crossover([]) is None


def test_scheduler_seconds_is_what_the_measured_parts_leave():
    stats = {"total_s": 1.0, "forward_s": 0.5, "draft_s": 0.2, "rule_s": 0.1, "verify_s": 0.15}
    assert scheduler_seconds(stats) == pytest.approx(0.2)


def test_repeats_take_the_median_repeat_and_the_median_ratio():
    """``--repeats 3``: each (level, drafter, path) is reported as its median repeat, and each drafter's
    ratio to none as the median of the per-repeat ratios (each repeat an alternation)."""

    def row(c: int, d: str, rep: int, tps: float) -> dict:
        return {
            "concurrency": c,
            "drafter": d,
            "path": "engine/staggered",
            "repeat": rep,
            "tokens_per_second": tps,
        }

    rows = [row(1, "none", 0, 100.0), row(1, "default", 0, 150.0)]
    rows += [row(1, "none", 1, 50.0), row(1, "default", 1, 60.0)]  # a slow repeat: ratio 1.2
    rows += [row(1, "none", 2, 110.0), row(1, "default", 2, 99.0)]  # ratio 0.9
    picked = {r["drafter"]: r for r in concurrency.median_rows(rows)}
    assert picked["none"]["tokens_per_second"] == 100.0 and picked["none"]["repeats"] == 3
    assert picked["default"]["tokens_per_second"] == 99.0
    assert concurrency.ratio_lines(rows) == [
        "default / none (engine/staggered, median of repeats): c=1 1.20x"
    ]
