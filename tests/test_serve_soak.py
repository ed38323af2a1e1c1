"""The soak of ``specdec serve`` (``python tests/soak.py``): its plan and its judgements on
made-up answers, /metrics texts and RSS series (each must be able to fail), and a scaled-down soak
against a server on a free loopback port over the tiny random Llama of ``tests/test_serve.py``
(byte-level tokenizer, ``ngram`` drafter): 60 requests at concurrency 8, max_tokens 8, half the
streams cut off by the client, every kind of malformed request once (slow: the server takes seconds
to start).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _extras import SERVE, skip_module_without

skip_module_without(SERVE + ("psutil",))

from soak import (  # noqa: E402
    IDLE_GAUGES,
    MALFORMED,
    Planned,
    SoakConfig,
    judge_error,
    judge_idle,
    judge_rss,
    judge_stream,
    judge_whole,
    main,
    plan_requests,
    run_soak,
)

from specdec.bench.serve_probe import parse_prometheus_text  # noqa: E402
from specdec.serve.metrics import ServerMetrics  # noqa: E402

MB = 1 << 20
PLAN = {"model": "m", "max_model_len": 2048, "max_tokens": 16}


# --- the plan -------------------------------------------------------------------------------------------


def test_plan_is_seeded_and_has_exact_counts():
    plan = plan_requests(200, **PLAN, malformed_rate=0.06, disconnect_rate=0.5, seed=3)
    assert [p.index for p in plan] == list(range(200))
    bad = [p for p in plan if p.kind == "malformed"]
    assert len(bad) == 12 and sorted(p.malformed for p in bad) == sorted(list(MALFORMED) * 2)
    streamed_ok = [p for p in plan if p.kind != "malformed" and p.stream]
    cut = [p for p in plan if p.kind == "disconnect"]
    assert len(cut) == round(0.5 * len(streamed_ok)) and all(p.stream for p in cut)
    assert all(1 <= p.disconnect_after <= 4 for p in cut)
    assert all(8 <= p.max_tokens <= 16 for p in plan if p.kind != "malformed")
    assert {p.chat for p in plan} == {True, False} and {p.stream for p in plan} == {True, False}
    assert plan == plan_requests(200, **PLAN, malformed_rate=0.06, disconnect_rate=0.5, seed=3)
    assert plan != plan_requests(200, **PLAN, malformed_rate=0.06, disconnect_rate=0.5, seed=4)
    for p in bad:
        if p.malformed == "bad_json":
            with pytest.raises(ValueError):
                json.loads(p.body)
            continue
        body = json.loads(p.body)
        if p.malformed == "over_context":
            assert body["max_tokens"] == 2048 and "2048" in p.expect[3]
        if p.malformed == "bad_max_tokens":
            assert body["max_tokens"] == "x"
    with pytest.raises(ValueError, match="malformed_rate"):
        plan_requests(10, **PLAN, malformed_rate=1.5, disconnect_rate=0.1)
    with pytest.raises(ValueError, match="disconnect_rate"):
        SoakConfig(disconnect_rate=-0.1)


# --- judging answers ------------------------------------------------------------------------------------


def _chunk(text: str, reason: str | None = None) -> str:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": reason}]})


def test_judge_stream():
    good = [_chunk("a"), _chunk("b"), _chunk("", "length"), "[DONE]"]
    assert judge_stream(200, good, chat=False, max_tokens=4) is None
    assert "[DONE]" in judge_stream(200, good[:-1], chat=False, max_tokens=4)
    error = json.dumps({"error": {"message": "boom", "type": "server_error"}})
    assert "error event" in judge_stream(200, [_chunk("a"), error, "[DONE]"], chat=False, max_tokens=4)
    assert "finish_reason" in judge_stream(200, [_chunk("a"), "[DONE]"], chat=False, max_tokens=4)
    two = [_chunk("a", "stop"), _chunk("b", "length"), "[DONE]"]
    assert "finish_reason" in judge_stream(200, two, chat=False, max_tokens=4)
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 3}})
    assert judge_stream(200, [*good[:-1], usage, "[DONE]"], chat=False, max_tokens=3) is None
    assert "length after 3" in judge_stream(200, [*good[:-1], usage, "[DONE]"], chat=False, max_tokens=4)
    assert "delta" in judge_stream(200, good, chat=True, max_tokens=4)  # a chat stream needs deltas
    assert judge_stream(500, good, chat=False, max_tokens=4) == "status 500"


def test_judge_whole():
    def body(reason, tokens, chat=False):
        choice = {"message": {"role": "assistant", "content": "hi"}} if chat else {"text": "hi"}
        return json.dumps(
            {"choices": [{**choice, "finish_reason": reason}], "usage": {"completion_tokens": tokens}}
        ).encode()

    assert judge_whole(200, body("stop", 2), chat=False, max_tokens=8) is None
    assert judge_whole(200, body("length", 8, chat=True), chat=True, max_tokens=8) is None
    assert "not a complete chat.completion" in judge_whole(200, body("stop", 2), chat=True, max_tokens=8)
    assert "finish_reason None" in judge_whole(200, body(None, 2), chat=False, max_tokens=8)
    assert "outside [1, max_tokens=8]" in judge_whole(200, body("stop", 9), chat=False, max_tokens=8)
    assert "length after 5" in judge_whole(200, body("length", 5), chat=False, max_tokens=8)
    assert "status 500" in judge_whole(500, b'{"error": {}}', chat=False, max_tokens=8)


def test_judge_error():
    plan = plan_requests(100, **PLAN, malformed_rate=0.06, disconnect_rate=0.0)
    p = next(p for p in plan if p.malformed == "bad_temperature")

    def error(status, **fields):
        fields = {"message": "temperature must be a number >= 0", "type": "invalid_request_error", **fields}
        return judge_error(p, status, json.dumps({"error": fields}).encode())

    assert error(400, param="temperature") is None
    assert "status 500" in error(500, param="temperature")
    assert "error.param None" in error(400, param=None)
    assert "does not name" in error(400, param="temperature", message="bad request")
    assert "not OpenAI's error JSON" in judge_error(p, 400, b"Bad Request")
    over = next(p for p in plan if p.malformed == "over_context")
    msg = "maximum context length is 2048 tokens"
    ok = {"message": msg, "type": "x", "param": "max_tokens", "code": "context_length_exceeded"}
    assert judge_error(over, 400, json.dumps({"error": ok}).encode()) is None
    no_code = json.dumps({"error": {**ok, "code": None}}).encode()
    assert "error.code" in judge_error(over, 400, no_code)
    assert isinstance(over, Planned) and over.expect[0] == 400


# --- slots and memory -----------------------------------------------------------------------------------


def test_judge_idle_reads_the_servers_own_gauges():
    metrics = ServerMetrics("tiny", 4)
    text = lambda: parse_prometheus_text(metrics.render()[0].decode())  # noqa: E731
    idle, values = judge_idle(text())
    assert idle and values == dict.fromkeys(IDLE_GAUGES, 0.0)
    metrics.set_load(running=0, waiting=0, slots_in_use=1)  # a leaked slot
    idle, values = judge_idle(text())
    assert not idle and values["specdec:cache_slots_in_use"] == 1.0
    metrics.set_load(running=1, waiting=2, slots_in_use=1)
    assert not judge_idle(text())[0]
    metrics.set_load(running=0, waiting=0, slots_in_use=0)
    assert judge_idle(text())[0]
    fake = '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 0.0\n'
    idle, values = judge_idle(parse_prometheus_text(fake))  # the other two are missing: not idle
    assert not idle and values["specdec:cache_slots_in_use"] is None


def test_judge_rss():
    flat = [(i * 0.5, i, 800 * MB + (i % 5) * MB) for i in range(100)]
    ok, detail = judge_rss(flat, 10, 0.10, 50.0)
    assert ok and detail["growth_mb"] < 5 and detail["samples"] == 90
    leak = [(i * 0.5, i, 800 * MB + i * MB) for i in range(100)]  # 1 MB per sample: ~70 MB over the run
    ok, detail = judge_rss(leak, 10, 0.10, 50.0)
    assert not ok and detail["growth_mb"] > 50 and detail["tolerance_mb"] == 50.0
    assert not judge_rss(leak, 10, 0.05, 500.0)[0]  # the relative bound binds too: 5 % of 800 MB
    warm = [(i * 0.5, i, (400 + min(i, 20) * 20) * MB) for i in range(100)]  # grows in the warm-up only
    assert judge_rss(warm, 25, 0.10, 50.0)[0] is True
    assert judge_rss(warm, 0, 0.10, 50.0)[0] is False
    assert judge_rss(flat[:20], 15, 0.10, 50.0)[0] is None  # 5 samples: too few to judge


def test_cli_refuses_bad_rates(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--malformed-rate", "2"])
    assert exc.value.code == 2 and "--malformed-rate" in capsys.readouterr().err


# --- a scaled-down soak ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_soak_small(tmp_path, monkeypatch):
    from _tiny import byte_tokenizer, save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "tiny", tokenizer=byte_tokenizer())
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    config = SoakConfig(
        num_requests=60,
        concurrency=8,
        max_tokens=8,
        disconnect_rate=0.5,
        malformed_rate=0.1,  # 6: every kind once
        seed=1,
        target=str(checkpoint),
        drafter="ngram",
        max_num_seqs=4,
        server_args=("--threads", "1", "--gamma", "3"),
        server_log=str(tmp_path / "server.log"),
        shutdown_timeout_s=5.0,
        start_timeout_s=120.0,
        rss_interval_s=0.01,
        progress_s=30.0,
    )
    result = run_soak(config)
    checks = result["checks"]
    assert {name: c["result"] for name, c in checks.items()} == dict.fromkeys(checks, "pass"), checks
    assert set(checks) == {
        "server_alive",
        "well_formed_answered",
        "malformed_rejected",
        "no_5xx",
        "slots_freed",
        "every_request_finished",
        "memory_flat",
        "clean_shutdown",
        "no_child_left",
        "log_clean",
    }
    assert result["passed"] and result["malformed_kinds"] == dict.fromkeys(MALFORMED, 1)
    counts = result["counts"]
    assert counts["malformed"] == 6 and counts["cut_off"] >= 1
    assert counts["ok"] + counts["disconnect"] == checks["well_formed_answered"]["detail"]["answered"] == 54
    assert checks["every_request_finished"]["detail"]["server_finished"] == 54
    assert Path(result["server_log"]).exists()
