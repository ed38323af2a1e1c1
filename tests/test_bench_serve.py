"""``specdec bench-serve``: the figures' definitions on known timestamps, the load loop against a fake
streaming server with known chunk timings (``tests/_fake_openai_server.py``), failures, ``/metrics``
deltas, the files written, flag validation, the llama-server peer (a fake binary, and none), and one
run against ``specdec serve`` on a tiny model (slow)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx", reason="specdec bench-serve needs httpx")

import _fake_openai_server as fake  # noqa: E402
import numpy as np  # noqa: E402

from specdec.bench import serve_load as load  # noqa: E402
from specdec.bench import serve_peers as peers  # noqa: E402
from specdec.bench import serve_probe as probe  # noqa: E402
from specdec.bench.serve_command import BenchServeConfig, run_bench_serve  # noqa: E402
from specdec.bench.serve_load import BenchRequest, LevelRun, RequestResult, result_from_trace  # noqa: E402
from specdec.bench.serve_report import level_figures, parse_goodput  # noqa: E402
from specdec.cli import build_parser, main  # noqa: E402
from specdec.percentile import percentile  # noqa: E402

_ASGI = all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn"))
needs_asgi = pytest.mark.skipif(
    not _ASGI, reason="the fake server needs starlette and uvicorn ([serve] extra)"
)
SAMPLING = {"max_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def server():
    if not _ASGI:
        pytest.skip("the fake server needs starlette and uvicorn ([serve] extra)")
    s = fake.ThreadedServer(fake.build_app())
    yield s
    s.close()


@pytest.fixture(scope="module")
def bare_server():
    if not _ASGI:
        pytest.skip("the fake server needs starlette and uvicorn ([serve] extra)")
    s = fake.ThreadedServer(fake.build_app(bare=True))
    yield s
    s.close()


@pytest.fixture
def fast_env(monkeypatch):
    """A fixed environment record (the real one imports transformers: seconds)."""
    env = {
        "cpu": "Test CPU 9000",
        "isa": "avx512-test",
        "commit": "abc1234",
        "torch_threads": 1,
        "torch": "x",
    }
    monkeypatch.setattr("specdec.bench.report.environment", lambda: dict(env))
    return env


def reqs(*prompts: str) -> list[BenchRequest]:
    return [BenchRequest(index=i, prompt=p, prompt_set="test") for i, p in enumerate(prompts)]


# --- definitions on known timestamps -------------------------------------------------------------


def test_trace_figures_follow_vllm_definitions():
    r = result_from_trace(
        3,
        sent_s=10.0,
        token_times_s=[10.5, 10.6, 10.8],
        last_choice_s=10.9,
        usage={"completion_tokens": 9, "num_draft_tokens": 12, "num_accepted_tokens": 5},
        start_s=9.0,
    )
    assert r.ok and r.index == 3 and r.sent_s == pytest.approx(1.0)
    assert r.ttft_s == pytest.approx(0.5)  # sent → first token chunk
    assert r.itl_s == pytest.approx([0.1, 0.2])  # gaps between token chunks
    assert r.e2el_s == pytest.approx(0.9)  # sent → last event with a choice
    assert r.output_tokens == 9 and r.token_chunks == 3  # usage wins over chunks
    assert r.tpot_s == pytest.approx((0.9 - 0.5) / 8)
    assert (r.draft_tokens, r.accepted_tokens) == (12, 5)


def test_trace_without_usage_counts_chunks_and_one_token_has_no_tpot():
    r = result_from_trace(0, sent_s=0.0, token_times_s=[0.2, 0.3], last_choice_s=None, usage=None)
    assert r.output_tokens == 2 and r.e2el_s == pytest.approx(0.3) and r.tpot_s == pytest.approx(0.1)
    one = result_from_trace(0, sent_s=0.0, token_times_s=[0.2], last_choice_s=0.25, usage=None)
    assert one.ok and one.tpot_s is None and one.itl_s == []
    empty = result_from_trace(0, sent_s=0.0, token_times_s=[], last_choice_s=0.1, usage=None)
    assert not empty.ok and empty.error == "the stream carried neither text nor a finish_reason"
    eos = result_from_trace(
        0, sent_s=1.0, token_times_s=[], last_choice_s=1.3, usage={"completion_tokens": 1}, finish_s=1.25
    )  # a response whose one token is the end of sequence: no text, but answered
    assert eos.ok and eos.ttft_s == pytest.approx(0.25) and eos.e2el_s == pytest.approx(0.3)
    assert eos.output_tokens == 1 and eos.token_chunks == 0 and eos.tpot_s is None
    failed = result_from_trace(0, sent_s=0.0, token_times_s=[0.1], last_choice_s=0.1, usage=None, error="x")
    assert not failed.ok and failed.ttft_s is None and failed.tpot_s is None


@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_percentile_matches_numpy(n):
    values = list(np.random.default_rng(n).exponential(size=n))
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="q"):
        percentile(values, 101)


def test_level_figures_throughput_goodput_and_failures():
    def ok(i, ttft, e2el, tokens, itl):
        return RequestResult(index=i, ok=True, ttft_s=ttft, e2el_s=e2el, output_tokens=tokens, itl_s=itl)

    results = [
        ok(0, 0.1, 1.1, 11, [0.1] * 10),  # TPOT 100 ms
        ok(1, 0.3, 0.8, 6, [0.1] * 5),  # TPOT 100 ms, TTFT 300 ms
        ok(2, 0.1, 0.5, 21, [0.02] * 20),  # TPOT 20 ms
        ok(3, 0.05, 0.05, 1, []),  # one token: no TPOT, within any TPOT SLO
        RequestResult(index=4, ok=False, error="HTTP 500: boom"),
        RequestResult(index=5, ok=False, error="HTTP 500: boom"),
    ]
    f = level_figures(LevelRun(results, duration_s=2.0), parse_goodput(["ttft:200", "tpot:50"]))
    assert (f["completed"], f["failed"]) == (4, 2)
    assert f["errors"] == {"HTTP 500: boom": 2}
    assert f["request_throughput"] == pytest.approx(2.0)
    assert f["total_output_tokens"] == 39 and f["output_throughput"] == pytest.approx(19.5)
    assert f["goodput"] == pytest.approx(1.0)  # requests 2 and 3 meet both SLOs
    assert f["ttft_mean_ms"] == pytest.approx(137.5)
    assert f["ttft_p50_ms"] == pytest.approx(100.0)
    assert f["tpot_p50_ms"] == pytest.approx(100.0) and f["tpot_mean_ms"] == pytest.approx(220 / 3)
    itl = [1e3 * g for r in results if r.ok for g in r.itl_s]
    assert f["itl_p90_ms"] == pytest.approx(float(np.percentile(itl, 90)))
    assert f["e2el_p99_ms"] == pytest.approx(float(np.percentile([1100, 800, 500, 50], 99)))
    assert f["usage_drafted"] is None  # the requests did not report draft counts
    assert level_figures(LevelRun(results, 2.0))["goodput"] is None


def test_arrival_times_poisson_and_gamma():
    with pytest.raises(ValueError, match="request_rate"):
        load.arrival_times(3, 0.0, 1.0, 0)
    with pytest.raises(ValueError, match="burstiness"):
        load.arrival_times(3, 1.0, 0.0, 0)
    assert load.arrival_times(4, math.inf, 1.0, 0) == [0.0] * 4
    times = load.arrival_times(4000, 2.0, 1.0, seed=1)
    assert times[0] == 0.0 and times == load.arrival_times(4000, 2.0, 1.0, seed=1)
    gaps = np.diff(times)
    # Exponential gaps of mean 0.5 s: the sample mean's standard error is 0.5 / sqrt(3999) ~ 0.008.
    assert statistics.fmean(gaps) == pytest.approx(0.5, abs=0.04)
    assert np.std(gaps) == pytest.approx(0.5, abs=0.05)  # coefficient of variation 1
    bursty = np.diff(load.arrival_times(4000, 2.0, 0.25, seed=1))
    assert statistics.fmean(bursty) == pytest.approx(0.5, abs=0.08)
    assert np.std(bursty) > 0.8  # shape 0.25: coefficient of variation 2


def test_prometheus_parsing_and_acceptance():
    text = (
        "# TYPE vllm:spec_decode_num_drafts_total counter\n"
        'vllm:spec_decode_num_drafts_total{model_name="m"} 4.0\n'
        'vllm:spec_decode_num_drafts_created{model_name="m"} 1.7e9\n'
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 16\n'
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 6\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 5\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1\n'
        "llamacpp:tokens_predicted_total 120\n"
        "not_a_number NaNx\n"
    )
    samples = probe.parse_prometheus_text(text)
    assert samples["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == 6.0
    before = probe.spec_counters(samples)
    assert before == {"num_drafts": 4.0, "num_draft_tokens": 16.0, "num_accepted_tokens": 6.0}
    after = {"num_drafts": 10.0, "num_draft_tokens": 40.0, "num_accepted_tokens": 21.0}
    acc = probe.acceptance(before, after)
    assert acc == {"drafts": 6.0, "drafted": 24.0, "accepted": 15.0, "alpha": 0.625, "tau": 3.5}
    assert probe.spec_counters(probe.parse_prometheus_text("llamacpp:tokens_predicted_total 3\n")) is None
    by_reason = (
        'vllm:request_success_total{finished_reason="stop",model_name="m"} 3\n'
        'vllm:request_success_total{model_name="m",finished_reason="length"} 2\n'
        "vllm:num_requests_running 1\n"
    )
    assert probe.parse_prometheus_text(by_reason, keep_label="finished_reason") == {
        "vllm:request_success_total{stop}": 3.0,
        "vllm:request_success_total{length}": 2.0,
        "vllm:num_requests_running": 1.0,
    }
    assert probe.acceptance(None, after) is None
    zero = probe.acceptance(before, before)
    assert zero["alpha"] is None and zero["tau"] is None


# --- the load loop against the fake server ---------------------------------------------------


def test_closed_loop_times_the_fake_chunks(server):
    run = load.run_closed_loop(
        server.url,
        reqs("a", "b", "c"),
        concurrency=2,
        endpoint="completions",
        model="fake-model",
        sampling=SAMPLING,
    )
    assert [r.index for r in run.results] == [0, 1, 2] and all(r.ok for r in run.results)
    for r in run.results:
        assert r.output_tokens == fake.CHUNKS * fake.TOKENS_PER_CHUNK and r.token_chunks == fake.CHUNKS
        assert fake.TTFT_S <= r.ttft_s < fake.TTFT_S + 1.0
        assert len(r.itl_s) == fake.CHUNKS - 1
        assert sum(r.itl_s) >= (fake.CHUNKS - 1) * fake.GAP_S * 0.5  # sleeps of GAP_S between chunks
        assert r.e2el_s >= r.ttft_s + sum(r.itl_s) - 1e-9
        assert r.tpot_s == pytest.approx((r.e2el_s - r.ttft_s) / (r.output_tokens - 1))
        assert (r.draft_tokens, r.accepted_tokens) == (fake.DRAFT_TOKENS, fake.ACCEPTED)
    body = server.app.state.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "fake-model" and body["max_tokens"] == 8 and "prompt" in body
    # Two workers: the third request waits for one of the first two.
    assert run.duration_s >= 2 * fake.TTFT_S
    assert sorted(r.sent_s for r in run.results)[2] >= min(r.e2el_s for r in run.results[:2]) - 0.01


def test_chat_ttft_skips_the_role_chunk(server):
    run = load.run_closed_loop(
        server.url, reqs("hello"), concurrency=1, endpoint="chat", model="fake-model", sampling=SAMPLING
    )
    (r,) = run.results
    assert r.ok and r.ttft_s >= fake.TTFT_S and r.token_chunks == fake.CHUNKS
    assert server.app.state.bodies[-1]["messages"] == [{"role": "user", "content": "hello"}]


def test_failed_requests_are_counted_with_their_reason(server):
    prompts = ("fail-500", "drop", "no-done", "error-event", "fine", "eos-only")
    run = load.run_closed_loop(
        server.url, reqs(*prompts), concurrency=6, endpoint="completions", model="m", sampling=SAMPLING
    )
    by = {prompts[r.index]: r for r in run.results}
    assert by["fine"].ok and not any(by[p].ok for p in prompts[:4])
    assert by["eos-only"].ok and by["eos-only"].output_tokens == 1 and by["eos-only"].ttft_s >= fake.TTFT_S
    assert by["fail-500"].error.startswith("HTTP 500") and "boom" in by["fail-500"].error
    assert by["no-done"].error == "the stream ended without data: [DONE]"
    assert by["error-event"].error.startswith("error event") and "engine failed" in by["error-event"].error
    assert by["drop"].error  # the connection broke mid-stream (an httpx error)
    f = level_figures(run)
    assert (f["completed"], f["failed"]) == (2, 4) and len(f["errors"]) == 4


def test_open_loop_sends_at_the_arrival_times(server):
    run = load.run_open_loop(
        server.url, reqs("a", "b", "c", "d"), request_rate=20.0, burstiness=1.0, seed=3,
        endpoint="completions", model="m", sampling=SAMPLING,
    )  # fmt: skip
    times = load.arrival_times(4, 20.0, 1.0, 3)
    assert all(r.ok for r in run.results)
    for r, t in zip(run.results, times, strict=True):
        assert t - 1e-3 <= r.sent_s < t + 0.5


def test_metrics_deltas_and_model_card(server, bare_server):
    before = probe.scrape_metrics(server.url)
    load.run_closed_loop(
        server.url, reqs("a", "b"), concurrency=2, endpoint="completions", model="m", sampling=SAMPLING
    )
    acc = probe.acceptance(before, probe.scrape_metrics(server.url))
    assert acc == {
        "drafts": 2.0 * fake.DRAFTS,
        "drafted": 2.0 * fake.DRAFT_TOKENS,
        "accepted": 2.0 * fake.ACCEPTED,
        "alpha": fake.ACCEPTED / fake.DRAFT_TOKENS,
        "tau": 1 + fake.ACCEPTED / fake.DRAFTS,
    }
    assert probe.scrape_metrics(bare_server.url) is None  # no /metrics: no acceptance
    assert probe.model_card(server.url)["id"] == fake.MODEL
    assert probe.wait_healthy(server.url, 5.0)


# --- the command ---------------------------------------------------------------------------------


def test_run_against_base_url_writes_json_markdown_and_plot(server, fast_env, tmp_path, capsys):
    config = BenchServeConfig(
        base_url=server.url, prompt_sets=("humaneval",), num_prompts=2, max_tokens=8,
        concurrency=(1, 2), request_rates=(math.inf,), goodput=("ttft:5000", "tpot:1"), out=str(tmp_path),
    )  # fmt: skip
    record = run_bench_serve(config, command="specdec bench-serve --test")
    out = capsys.readouterr().out
    assert "CPU: Test CPU 9000 (kernels: avx512-test path)" in out.splitlines()[0]  # the header
    assert "c=1" in out and "c=2" in out and "inf req/s" in out
    (entry,) = record["servers"]
    assert entry["model"] == fake.MODEL and entry["warmup_failed"] == 0
    assert [lv.get("concurrency") for lv in entry["levels"]] == [1, 2, None]
    for level in entry["levels"]:
        assert level["completed"] == 2 and level["failed"] == 0 and len(level["requests"]) == 2
        assert level["goodput"] == 0.0  # no request meets a 1 ms TPOT
        assert level["acceptance"]["alpha"] == pytest.approx(fake.ACCEPTED / fake.DRAFT_TOKENS)
        assert level["usage_drafted"] == 2 * fake.DRAFT_TOKENS
    doc = json.loads((tmp_path / "bench-serve.json").read_text())
    assert doc["schema"] == "specdec.summary/1" and doc["experiment"] == "bench-serve"
    assert doc["command"] == "specdec bench-serve --test" and doc["env"]["isa"] == "avx512-test"
    assert doc["machine"].startswith("CPU: Test CPU 9000 (kernels: avx512-test path), servers on 2 threads")
    (table,) = doc["tables"]
    assert len(table["rows"]) == 3 and table["rows"][0]["server"] == server.url
    assert {f["name"] for f in doc["figures"]} == {"ttft-vs-throughput", "tpot-vs-throughput"}
    assert doc["servers"][0]["levels"][2]["request_rate"] is None  # inf is written as null (strict JSON)
    md = (tmp_path / "bench-serve.md").read_text()
    assert md.count(f"| {server.url} |") == 3 and "TPOT ms" in md
    pngs = list(tmp_path.glob("bench-serve-*.png"))
    assert len(pngs) == 1 and pngs[0].read_bytes()[:4] == b"\x89PNG"


@pytest.fixture
def no_llama_server(monkeypatch, tmp_path):
    monkeypatch.delenv(peers.LLAMA_SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))


def test_llama_server_missing_is_skipped_with_one_line(no_llama_server, fast_env, tmp_path, capsys):
    config = BenchServeConfig(servers=("llama-server",), num_prompts=1, concurrency=(1,), out=str(tmp_path))
    record = run_bench_serve(config)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "specdec bench-serve: llama-server skipped: no llama-server on PATH and $LLAMA_SERVER is not set "
        "(docs/serving.md shows how to build it)"
    ]
    assert (
        record["servers"][0]["skipped"].startswith("llama-server skipped")
        and not record["servers"][0]["levels"]
    )
    assert "skipped" in (tmp_path / "bench-serve.md").read_text()


def test_llama_server_env_must_be_an_executable(monkeypatch, tmp_path):
    monkeypatch.setenv(peers.LLAMA_SERVER_ENV, str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"\$LLAMA_SERVER"):
        peers.find_llama_server()


@needs_asgi
def test_fake_llama_server_binary_is_started_loaded_and_stopped(monkeypatch, fast_env, tmp_path):
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    script = Path(fake.__file__).resolve()
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    binary.chmod(0o755)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.delenv(peers.LLAMA_SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", f"{binary.parent}{os.pathsep}{os.environ['PATH']}")
    config = BenchServeConfig(
        peers=("llama-server",), target=str(gguf), prompt_sets=("humaneval",), num_prompts=1,
        max_tokens=8, concurrency=(2,), threads=3, out=str(tmp_path / "out"), startup_timeout_s=60,
    )  # fmt: skip
    (entry,) = run_bench_serve(config, echo=lambda line: None)["servers"]
    assert entry["exit_status"] == 0  # stopped by SIGTERM
    assert f"-m {gguf} -t 3 -np 2 -c " in entry["launch"] and "--metrics" in entry["launch"]
    assert entry["levels"][0]["completed"] == 1
    assert (tmp_path / "out" / "server-llama-server.log").is_file()


def test_context_per_slot_bounds_tokens_by_bytes():
    assert peers.context_per_slot(["é" * 100, "x"], 128) == 512  # 200 bytes + 64 + 128 + 16 = 408
    assert peers.context_per_slot([], 1) % 256 == 0


# --- flags ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--goodput", "ttft:abc"], "--goodput"),
        (["--goodput", "itl:5"], "--goodput"),
        (["--goodput", "tpot:-1"], "--goodput"),
        (["--request-rate", "0"], "--request-rate"),
        (["--request-rate", "-2,1"], "--request-rate"),
        (["--request-rate", "nan"], "--request-rate"),
        (["--concurrency", "0,2"], "--concurrency"),
        (["--burstiness", "inf"], "--burstiness"),
        (["--endpoint", "embeddings"], "--endpoint"),
        (["--num-prompts", "0"], "--num-prompts"),
    ],
)
def test_bad_flags_are_argparse_errors_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench-serve", *argv])
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--servers", "ours"], "--servers"),
        (["--servers", "vllm"], "--servers"),
        (["--peers", "ours:x"], "--peers"),
        (["--burstiness", "0"], "--burstiness"),
        (["--base-url", "localhost:8000"], "--base-url"),
        (["--prompt-set", "nope"], "--prompt-set"),
        (["--prompt-set", "mtbench-chat"], "--prompt-set"),
        (["--goodput", "ttft:5", "ttft:6"], "--goodput"),
        (["--servers", "ours:none", "--concurrency", "1", "--gamma", "deep"], "--gamma"),
        (["--servers", "ours:none", "--concurrency", "1", "--gamma", "-1"], "--gamma"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_flag(argv, flag, tmp_path, capsys):
    assert main(["bench-serve", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdec: error:") and flag in err and "\n" not in err


def test_parse_goodput_and_config_errors():
    assert parse_goodput(["ttft:500", "TPOT:50.5", "e2el:9000"]) == {
        "ttft": 500.0,
        "tpot": 50.5,
        "e2el": 9000.0,
    }
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput(["ttft=5"])
    with pytest.raises(ValueError, match="nothing to load"):
        BenchServeConfig(concurrency=(1,))
    with pytest.raises(ValueError, match="no load level"):
        BenchServeConfig(servers=("ours:none",))
    with pytest.raises(ValueError, match="--request-rate"):
        BenchServeConfig(servers=("ours:none",), request_rates=(float("nan"),))


# --- against specdec serve ------------------------------------------------------------------------


@pytest.mark.slow
@needs_asgi
def test_against_specdec_serve_on_a_tiny_model(tmp_path):
    for name in ("fastapi", "sse_starlette", "prometheus_client"):
        pytest.importorskip(name, reason="specdec serve needs the [serve] extra (pip install -e '.[serve]')")
    from _tiny import byte_tokenizer, save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "tiny", tokenizer=byte_tokenizer())
    config = BenchServeConfig(
        servers=("ours:ngram",), target=str(checkpoint), prompt_sets=("humaneval",), num_prompts=2,
        max_tokens=16, concurrency=(1, 2), threads=1, gamma="2", out=str(tmp_path / "out"),
        startup_timeout_s=120,
    )  # fmt: skip
    (entry,) = run_bench_serve(config, echo=lambda line: None)["servers"]
    assert entry["exit_status"] == 0 and entry["model"] == str(checkpoint)
    assert "--max-num-seqs 2" in entry["launch"] and "--threads 1" in entry["launch"]
    assert "--gamma 2" in entry["launch"]  # a fixed depth: drafting does not hang on timings
    for level in entry["levels"]:
        assert level["completed"] == 2 and level["failed"] == 0
        acc = level["acceptance"]  # specdec serve exposes the counters; its usage counts agree
        assert acc is not None and acc["drafted"] == level["usage_drafted"]
        assert acc["accepted"] == level["usage_accepted"]
        if acc["drafts"]:  # the accepted tokens, position by position, add up to the accepted ones
            assert sum(rate * acc["drafts"] for rate in acc["per_position"]) == pytest.approx(acc["accepted"])
    assert sum(level["acceptance"]["drafted"] for level in entry["levels"]) > 0


def test_a_request_on_a_connection_the_server_closed_while_idle_is_sent_again():
    """llama-server closes kept-alive connections that sit idle: the next request fails before any
    response (``RemoteProtocolError``) and is sent once more; a second such failure is the request's."""
    import asyncio

    import httpx

    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) in (1, 3, 4):
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, content=b'data: {"choices": []}\n\ndata: [DONE]\n\n')

    async def send() -> load.SSEReply:
        async with httpx.AsyncClient(base_url="http://test", transport=httpx.MockTransport(handler)) as c:
            return await load.post_sse(c, "/v1/completions", b"{}")

    reply = asyncio.run(send())
    assert reply.error is None and reply.events[-1][1] == "[DONE]" and len(calls) == 2
    reply = asyncio.run(send())
    assert reply.error.startswith("RemoteProtocolError") and len(calls) == 4
