"""``python -m specdec.bench.concurrency`` end to end on a tiny random Llama (byte tokenizer): every
level, drafter and path (the engine's two: no static batch since ``specdec.generate`` runs on the
engine) is a row; greedy requests equal their solo outputs; every row carries the scheduler's share of
the step time (a fraction strictly between 0 and 1); the Markdown table has the column."""

from __future__ import annotations

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
        assert r["tokens"] == 2 * 6
    table = (out / "concurrency.md").read_text()
    assert "scheduler % of step" in table


def test_scheduler_seconds_is_what_the_measured_parts_leave():
    stats = {"total_s": 1.0, "forward_s": 0.5, "draft_s": 0.2, "rule_s": 0.1, "verify_s": 0.15}
    assert scheduler_seconds(stats) == pytest.approx(0.2)
