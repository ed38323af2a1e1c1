"""One results schema (``specdec.summary/1``): experiment summaries and every benchmark's file carry the
same fields, and the committed benchmark tables are exactly what their raw measurements give."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from paper.results import load_summary
from specdec.summary import Summary, summary_document, table_from_rows, write_json

RESULTS = Path(__file__).resolve().parents[1] / "paper" / "results"
ENVELOPE = set(summary_document(experiment="x", summary=Summary(title=""), command="", machine="", env={}))


def _benchmark(name: str):
    """(summarize, document builder) of the benchmark that wrote ``paper/results/<name>.json``."""
    from experiments import bench_moe, bench_packed_gemm, gpu_engine_check, gpu_moe_report
    from specdec.bench import concurrency, target
    from specdec.bench.report import bench_document, benchmark_document

    if name.startswith("specdec-bench"):
        return lambda raw, doc: bench_document(raw, name, created_at=doc["created_at"])
    if name == "gpu-moe-bench":
        return lambda raw, doc: gpu_moe_report.gpu_document(raw, doc["command"])
    modules = {
        "bench-moe": bench_moe,
        "packed-gemm": bench_packed_gemm,
        "engine-concurrency": concurrency,
        "gpu-engine-check": gpu_engine_check,
    }
    summarize = target if name.startswith("target-formats") else modules[name]  # one file per ISA path
    return lambda raw, doc: benchmark_document(
        raw,
        experiment=name,
        summarize=summarize.summarize,
        description=doc["description"],
        created_at=doc["created_at"],
    )


@pytest.mark.parametrize(
    "name",
    [
        "specdec-bench",
        "specdec-bench-qself",
        "specdec-bench-gpu",
        "specdec-bench-heads",
        "specdec-bench-avx512vnni",
        "specdec-bench-avx2",
        "bench-moe",
        "packed-gemm",
        "target-formats",
        "target-formats-avx512vnni",
        "target-formats-avx2",
        "gpu-moe-bench",
        "engine-concurrency",
        "gpu-engine-check",
    ],
)
def test_committed_benchmark_tables_come_from_their_raw_measurements(name):
    path = RESULTS / f"{name}.json"
    doc = load_summary(path)  # the paper's reader accepts it
    raw = {k: v for k, v in doc.items() if k not in ENVELOPE or k in ("command", "notes", "env")}
    again = _benchmark(name)(raw, doc)
    assert json.loads(json.dumps(again["tables"])) == doc["tables"]
    assert (again["experiment"], again["machine"]) == (doc["experiment"], doc["machine"])
    assert doc["tables"] and all(table["rows"] for table in doc["tables"])


def test_summary_document_fields_and_refusals(tmp_path):
    table = table_from_rows("t", "caption", [("a", "A", ""), ("b", "B", ".2f")], [{"a": "x", "b": 1.5}])
    doc = summary_document(
        experiment="my-bench",
        summary=Summary(title="T", tables=(table,)),
        command="cmd",
        machine="m",
        env={"git_commit": "abc"},
        num_runs=1,
        num_planned_runs=2,
        missing_run_ids=["r2"],
        created_at="2026-01-01T00:00:00Z",
    )
    assert doc["schema"] == "specdec.summary/1" and not doc["complete"] and doc["num_planned_runs"] == 2
    write_json(tmp_path / "my-bench.json", doc)
    assert load_summary(tmp_path / "my-bench.json")["tables"][0]["rows"] == [{"a": "x", "b": 1.5}]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "my-bench.json").stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600
    with pytest.raises(ValueError, match="experiment must be a"):
        summary_document(experiment="My Bench", summary=Summary(title=""), command="", machine="", env={})
