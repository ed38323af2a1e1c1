"""llama.cpp's ``llama-bench`` as the benchmarks' peer: its JSON parsed, the binary found, the skip path,
and its figures beside ours (tables of ``python -m specdec.bench.target`` and ``specdec bench``).

The fixture ``tests/data/llama_bench_smollm2_q4_1.json`` is a real ``llama-bench -o json`` output
(SmolLM2-135M-Instruct Q4_1, 2 threads, AMD EPYC Zen 3, the build of docs/targets.md); the fake
binaries below print it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from specdec.bench import llama_bench
from specdec.bench.llama_bench import (
    comparison_markdown,
    comparison_rows,
    parse_llama_bench_json,
    run_llama_bench,
)

FIXTURE = Path(__file__).parent / "data" / "llama_bench_smollm2_q4_1.json"


def fake_llama_bench(folder: Path, *, exit_status: int = 0, stdout: Path = FIXTURE) -> Path:
    """An executable ``folder/bin/llama-bench`` that logs its arguments to ``folder/argv`` and prints
    ``stdout`` (``--version``: a version line), with a ``CMakeCache.txt`` beside its ``bin``."""
    (folder / "bin").mkdir(parents=True)
    (folder / "CMakeCache.txt").write_text(
        "// comment\nCMAKE_BUILD_TYPE:STRING=Release\nGGML_NATIVE:BOOL=OFF\nGGML_AVX512:BOOL=OFF\n"
        "GGML_AVX2:BOOL=ON\nLLAMA_BUILD_SERVER:BOOL=ON\nGGML_CUDA_GRAPHS:BOOL=ON\n"
    )
    binary = folder / "bin" / "llama-bench"
    binary.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "if sys.argv[1:] == ['--version']:\n"
        "    print('version: 1 (0c1e570)\\nbuilt with GNU 12.2.0 for Linux x86_64', file=sys.stderr)\n"
        "    sys.exit(0)\n"
        f"open({str(folder / 'argv')!r}, 'w').write(' '.join(sys.argv[1:]))\n"
        f"print(open({str(stdout)!r}).read())\n"
        f"sys.exit(print('error: failed to load model', file=sys.stderr) or {exit_status})\n"
    )
    binary.chmod(0o755)
    return binary


@pytest.fixture
def no_llama_bench(monkeypatch, tmp_path):
    """No llama-bench anywhere: an empty PATH folder and no $LLAMA_BENCH."""
    monkeypatch.delenv(llama_bench.LLAMA_BENCH_ENV, raising=False)
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def test_the_recorded_output_parses_into_every_test():
    figures = parse_llama_bench_json(FIXTURE.read_text(), source=str(FIXTURE))
    assert set(figures["tests"]) == {"pp1", "pp4", "pp7", "pp16", "tg128"}
    raw = {(r["n_prompt"], r["n_gen"]): r for r in json.loads(FIXTURE.read_text())}
    assert figures["tests"]["pp7"]["tokens_per_second"] == raw[(7, 0)]["avg_ts"]
    assert figures["tests"]["tg128"]["samples"] == raw[(0, 128)]["samples_ts"]
    assert figures["n_threads"] == 2 and figures["build_commit"] == raw[(1, 0)]["build_commit"]
    assert figures["n_depth"] == 0 and "Q4_1" in figures["model_type"]


@pytest.mark.parametrize(
    "text, match",
    [
        ("llama_model_load: error", "not JSON"),
        ("[]", "non-empty JSON list"),
        ('{"n_prompt": 1}', "non-empty JSON list"),
        ('[{"n_prompt": 1, "n_gen": 0}]', "test 0 lacks numeric avg_ts"),
        ('[{"n_prompt": 4, "n_gen": 128, "avg_ts": 1.0}]', "expected a pp or a tg test"),
    ],
)
def test_bad_output_is_a_value_error_naming_the_source(text, match):
    with pytest.raises(ValueError, match=match) as err:
        parse_llama_bench_json(text, source="fake-llama-bench output")
    assert "fake-llama-bench output" in str(err.value)


def test_runs_the_binary_on_path_with_the_same_file_and_threads(monkeypatch, tmp_path, no_llama_bench):
    binary = fake_llama_bench(tmp_path / "build")
    monkeypatch.setenv("PATH", str(binary.parent))
    gguf = tmp_path / "model.gguf"
    figures = run_llama_bench(gguf, threads=2, repetitions=3)
    assert isinstance(figures, dict)
    argv = (tmp_path / "build" / "argv").read_text().split()
    assert argv == ["-m", str(gguf), "-t", "2", "-p", "1,4,7,16", "-n", "128", "-r", "3", "-o", "json"]
    assert figures["command"] == f"{binary} " + " ".join(argv)
    assert figures["version"] == "version: 1 (0c1e570) built with GNU 12.2.0 for Linux x86_64"
    assert figures["build_options"] == {
        "CMAKE_BUILD_TYPE": "Release",
        "GGML_AVX2": "ON",
        "GGML_NATIVE": "OFF",
    }
    assert figures["tests"] == parse_llama_bench_json(FIXTURE.read_text())["tests"]
    assert len(figures["load_average"]) == 2 and min(figures["load_average"]) >= 0


def test_the_environment_variable_wins_and_a_wrong_one_is_refused(monkeypatch, tmp_path, no_llama_bench):
    on_path = fake_llama_bench(tmp_path / "on-path")
    named = fake_llama_bench(tmp_path / "named")
    monkeypatch.setenv("PATH", str(on_path.parent))
    monkeypatch.setenv("LLAMA_BENCH", str(named))
    assert run_llama_bench(tmp_path / "m.gguf", threads=1)["binary"] == str(named)
    assert (tmp_path / "named" / "argv").exists() and not (tmp_path / "on-path" / "argv").exists()
    monkeypatch.setenv("LLAMA_BENCH", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"\$LLAMA_BENCH=.*missing.* is not an executable file"):
        run_llama_bench(tmp_path / "m.gguf", threads=1)


def test_without_a_binary_or_a_gguf_file_it_is_skipped_with_one_line(tmp_path, no_llama_bench):
    reason = run_llama_bench(tmp_path / "m.gguf", threads=2)
    assert reason == "llama-bench not run: no llama-bench on PATH and $LLAMA_BENCH is not set"
    assert run_llama_bench(None, threads=2) == "llama-bench not run: the target does not come as a GGUF file"
    with pytest.raises(ValueError, match="threads, repetitions"):
        run_llama_bench(tmp_path / "m.gguf", threads=0)


def test_a_failing_binary_is_a_note_not_an_error(monkeypatch, tmp_path, no_llama_bench):
    monkeypatch.setenv("LLAMA_BENCH", str(fake_llama_bench(tmp_path / "b", exit_status=1)))
    reason = run_llama_bench(tmp_path / "m.gguf", threads=2)
    assert reason.startswith("llama-bench failed: exit status 1:") and "failed to load model" in reason
    garbage = tmp_path / "garbage.txt"
    garbage.write_text("not json\n")
    monkeypatch.setenv("LLAMA_BENCH", str(fake_llama_bench(tmp_path / "c", stdout=garbage)))
    assert "not JSON" in run_llama_bench(tmp_path / "m.gguf", threads=2)


def _figures() -> dict:
    return parse_llama_bench_json(FIXTURE.read_text())


def test_comparison_rows_put_ours_beside_each_test_with_the_ratio():
    figures = _figures()
    theirs = {n: t["tokens_per_second"] for n, t in figures["tests"].items()}
    rows = comparison_rows(figures, {"gguf": {"tg": 100.0, "pp1": 50.0, "pp7": 300.0}})
    assert rows[0] == {"engine": "llama-bench", "weights": figures["model_type"], **theirs}
    ours = rows[1]
    assert ours["tg128_ratio"] == pytest.approx(100.0 / theirs["tg128"])
    assert ours["pp7_ratio"] == pytest.approx(300.0 / theirs["pp7"])
    assert "pp4" not in ours and "pp4_ratio" not in ours  # not measured: left out, not zero
    md = comparison_markdown(figures, rows)
    assert f"{100.0 / theirs['tg128']:.2f}×" in md and md.splitlines()[0].startswith("llama-bench ")


def test_skipped_peer_keeps_our_rows_and_says_it_was_not_run():
    reason = "llama-bench not run: no llama-bench on PATH and $LLAMA_BENCH is not set"
    rows = comparison_rows(reason, {"gguf": {"tg": 100.0, "pp1": 50.0}})
    assert rows == [
        {"engine": "llama-bench", "weights": "not run"},
        {"engine": "ours", "weights": "gguf", "tg128": 100.0, "pp1": 50.0},
    ]
    md = comparison_markdown(reason, rows)
    assert md.splitlines()[0] == reason and "| llama-bench | not run |" in md


def _target_result(peer: dict | str) -> dict:
    """A :func:`specdec.bench.target.run` result of two formats (made up, in its shape)."""
    forward_ms = {T: 10.0 + T for T in (*range(1, 10), 16)}
    fmt = {
        "weight_mb": 96.0,
        "decode_tok_s": 80.0,
        "greedy_equals_transformers": True,
        "forward_ms": forward_ms,
        "verify_ratio": {T: ms / forward_ms[1] for T, ms in forward_ms.items()},
        "floor_ms": 6.0,
        "forward_over_floor": 11.0 / 6.0,
        "products_ms": 9.0,
        "outside_products_ms": 2.0,
    }
    env = {"cpu": "cpu", "isa": "avx2", "torch_threads": 2, "commit": "abc", "torch": "2"}
    return {
        "environment": env,
        "formats": {"gguf": fmt, "int4": fmt | {"decode_tok_s": 120.0}},
        "read_bandwidth_gb_s": 15.0,
        "transformers_tok_s": 6.0,
        "llama_bench": peer,
        "command": "python -m specdec.bench.target",
    }


def test_the_target_bench_reports_llama_bench_beside_every_format(tmp_path):
    from paper.results import load_summary
    from paper.tables import render_tables
    from specdec.bench import target
    from specdec.bench.report import benchmark_document
    from specdec.summary import write_json

    options = {"GGML_NATIVE": "ON"}
    figures = _figures() | {"command": "llama-bench -m m.gguf", "version": "v", "build_options": options}
    result = _target_result(figures)
    text = target.report(result)
    assert "| ours | int4 | 120.0 |" in text and "| llama-bench |" in text
    doc = benchmark_document(result, experiment="target-formats", summarize=target.summarize, description="d")
    write_json(tmp_path / "target-formats.json", doc)
    tables = {t["name"]: t for t in load_summary(tmp_path / "target-formats.json")["tables"]}
    rows = tables["llama-bench"]["rows"]
    theirs = figures["tests"]
    assert [r["weights"] for r in rows] == [figures["model_type"], "gguf", "int4"]
    assert rows[2]["tg128_ratio"] == pytest.approx(120.0 / theirs["tg128"]["tokens_per_second"])
    assert rows[1]["pp16"] == pytest.approx(16 / 26.0 * 1e3)  # T / forward time of T = 16
    assert rows[1]["pp4_ratio"] == pytest.approx(4 / 14.0 * 1e3 / theirs["pp4"]["tokens_per_second"])
    assert "GGML\\_NATIVE=ON" in render_tables(doc, "x")  # the caption names the build, LaTeX-escaped
    skipped = target.report(_target_result("llama-bench not run: no llama-bench on PATH"))
    assert "llama-bench not run: no llama-bench on PATH" in skipped and "| llama-bench | not run |" in skipped


def test_the_target_bench_refuses_a_result_name_that_cannot_name_a_file(capsys, monkeypatch):
    """``--name`` becomes the experiment (a file name and LaTeX label): refused before anything runs."""
    from specdec.bench import target

    monkeypatch.setattr(target, "run", lambda args: pytest.fail("the bench ran"))
    assert target.main(["--name", "Target Formats", "--no-llama-bench"]) == 2
    assert "--name must be a [a-z0-9-] name" in capsys.readouterr().err


@pytest.mark.slow  # a tiny checkpoint through transformers and our loop: ~5 s on 2 busy cores
def test_specdec_bench_puts_llama_bench_beside_every_method(monkeypatch, tmp_path, no_llama_bench):
    """``--peers llama.cpp`` end to end on a tiny checkpoint (its GGUF file faked): the binary runs
    once, its table has each method's tok/s against tg128 and the blocks its verify calls had."""
    from _tiny import save_tiny_checkpoint

    from specdec import bench
    from specdec.bench import BenchConfig, run_bench, speculative

    target = str(save_tiny_checkpoint(tmp_path / "target", seed=1))
    monkeypatch.setitem(bench.PROMPT_SETS, "code", lambda: ["def f(x):\n    return x"])
    monkeypatch.setenv("LLAMA_BENCH", str(fake_llama_bench(tmp_path / "build")))
    monkeypatch.setattr(
        speculative, "run_llama_bench", lambda gguf, **kw: run_llama_bench(tmp_path / "m.gguf", **kw)
    )

    def no_llama_cpp_python(*args, **kwargs):
        raise ImportError("llama_cpp")

    monkeypatch.setattr(speculative, "llama_cpp_methods", no_llama_cpp_python)
    cfg = BenchConfig(
        target=target,
        prompt_sets=("code",),
        num_prompts=1,
        max_new_tokens=9,
        temperatures=(0.0,),
        drafters=("none", "model"),
        draft_model=target,  # the target drafts for itself: every draft accepted, blocks of γ + 1
        gamma=3,
        gamma_policy="fixed",  # blocks of exactly γ + 1 (auto chooses depths from timings: flaky under load)
        hf_baselines=(),
        peers=("llama.cpp",),
        backend="hf",
        out=str(tmp_path / "out"),
        warmup=False,
    )
    payload = run_bench(cfg)
    assert "-t" in (tmp_path / "build" / "argv").read_text().split()
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    rows = {r["weights"]: r for r in {t["name"]: t for t in data["tables"]}["llama-bench"]["rows"]}
    tg128 = payload["llama_bench"]["tests"]["tg128"]["tokens_per_second"]
    summary = {r["method"]: r for r in payload["summary"] if r["prompt_set"] == "all"}
    none, model = rows["ours/none (temperature 0)"], rows["ours/model (temperature 0)"]
    assert none["tg128_ratio"] == pytest.approx(summary["ours/none"]["tokens_per_second"] / tg128)
    assert none["pp1"] == pytest.approx(1e3 / summary["ours/none"]["verify_ms_by_block"]["1"])
    assert model["pp4"] == pytest.approx(4e3 / summary["ours/model"]["verify_ms_by_block"]["4"])
    assert "| llama-bench |" in (tmp_path / "out" / "bench.md").read_text()


def test_a_wrong_llama_bench_variable_stops_the_target_bench_before_it_measures(monkeypatch, capsys):
    from specdec.bench import target

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded a target before checking $LLAMA_BENCH")

    monkeypatch.setattr(target.LlamaTarget, "from_pretrained", no_loading)
    monkeypatch.setenv("LLAMA_BENCH", "/no/such/llama-bench")
    assert target.main(["--weights", "gguf"]) == 2
    assert "$LLAMA_BENCH='/no/such/llama-bench' is not an executable file" in capsys.readouterr().err
