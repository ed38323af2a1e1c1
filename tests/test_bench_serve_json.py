"""``specdec bench-serve --prompt-set json``: the schema-constrained prompt set (deterministic, held out
alike with ``humaneval`` and ``mtbench``, every schema a Draft 2020-12 schema), the body that carries
the schema, the text and finish reason the load client keeps, the validity counts on hand-written
outputs, the report's columns, a run against the fake server, and one against ``specdec serve`` on a
tiny model (slow)."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from _extras import SERVE, skip_module_without

skip_module_without(SERVE + ("jsonschema", "starlette"))

import _fake_openai_server as fake  # noqa: E402
import httpx  # noqa: E402
import jsonschema  # noqa: E402
from test_bench_serve import fast_env  # noqa: E402,F401  (a fixture)

from specdec.bench import serve_load as load  # noqa: E402
from specdec.bench.json_prompts import (  # noqa: E402
    SCHEMAS,
    is_valid_output,
    json_prompts,
    json_validity,
    load_schema_prompts,
    schema_of,
)
from specdec.bench.serve_command import BenchServeConfig, _requests, run_bench_serve  # noqa: E402
from specdec.bench.serve_load import BenchRequest, RequestResult  # noqa: E402
from specdec.bench.serve_report import markdown, summarize  # noqa: E402
from specdec.cli import main  # noqa: E402
from specdec.prompt_sets import load_prompts  # noqa: E402

VALID = {  # one output per variant that its schema accepts
    "function": {
        "function_name": "add",
        "arguments": [{"name": "a", "type": "int"}, {"name": "b", "type": "int"}],
        "returns": "int",
        "summary": "Adds two numbers.",
    },
    "examples": {"function_name": "add", "examples": [{"call": "add(1, 2)", "result": "3"}]},
    "answer": {"topic": "math", "answer": "4", "confidence": "high"},
    "outline": {"title": "Hawaii", "key_points": ["beaches", "volcanoes"]},
}


# --- the prompt set ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3, 8])
def test_the_set_is_deterministic_held_out_and_its_schemas_are_schemas(n):
    prompts = json_prompts(n)
    assert prompts == json_prompts(n) == load_schema_prompts("json", n)
    assert len(prompts) == 2 * n
    humaneval, mtbench = prompts[:n], prompts[n:]
    # The same picks as the humaneval and mtbench sets for this n (held out from the head's training).
    for p, text in zip(humaneval, load_prompts("humaneval", n), strict=True):
        assert p.source.startswith("humaneval/HumanEval/") and text.strip() in p.prompt
    for p, text in zip(mtbench, load_prompts("mtbench", n), strict=True):
        assert p.source.startswith("mtbench/") and p.prompt.endswith(text)
    assert [p.variant for p in humaneval] == [("function", "examples")[i % 2] for i in range(n)]
    assert [p.variant for p in mtbench] == [("answer", "outline")[i % 2] for i in range(n)]
    for p in prompts:
        jsonschema.Draft202012Validator.check_schema(p.schema)
        assert p.schema == SCHEMAS[p.variant] and p.schema is not SCHEMAS[p.variant]
        fmt = p.response_format()
        assert fmt == {"type": "json_schema", "json_schema": {"name": p.variant, "schema": p.schema}}
        assert schema_of(fmt) == p.schema
        assert json.loads(json.dumps(fmt)) == fmt  # plain JSON, as sent


def test_every_source_at_most_once_and_bad_sizes():
    every = json_prompts(1000)  # more than either source: all 164 tasks and 80 questions
    assert len(every) == 164 + 80 and len({p.source for p in every}) == 244
    with pytest.raises(ValueError, match="num_prompts"):
        json_prompts(0)
    with pytest.raises(ValueError, match="known: json"):
        load_schema_prompts("yaml", 2)


def test_schema_of_reads_both_forms_and_nothing_else():
    schema = SCHEMAS["answer"]
    assert schema_of({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}) == schema
    assert schema_of({"type": "json_schema", "schema": schema}) == schema  # llama-server's shortcut
    assert schema_of({"type": "json_object"}) is None and schema_of(None) is None


# --- validity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(SCHEMAS))
def test_hand_written_outputs_valid_invalid_and_truncated(variant):
    schema, good = SCHEMAS[variant], json.dumps(VALID[variant])
    assert is_valid_output(good, schema) and is_valid_output(f"\n {good}\n", schema)
    assert not is_valid_output(good[:-3], schema)  # cut off: not JSON
    assert not is_valid_output(good + " {}", schema)  # two values
    assert not is_valid_output(json.dumps({**VALID[variant], "extra": 1}), schema)  # closed objects
    first = next(iter(VALID[variant]))
    assert not is_valid_output(json.dumps({k: v for k, v in VALID[variant].items() if k != first}), schema)


def test_enums_and_array_bounds_are_checked():
    answer = {**VALID["answer"], "confidence": "certain"}
    assert not is_valid_output(json.dumps(answer), SCHEMAS["answer"])
    assert not is_valid_output(json.dumps({**VALID["answer"], "topic": "cooking"}), SCHEMAS["answer"])
    outline = VALID["outline"]
    assert not is_valid_output(json.dumps({**outline, "key_points": []}), SCHEMAS["outline"])
    assert not is_valid_output(json.dumps({**outline, "key_points": ["x"] * 6}), SCHEMAS["outline"])


def _result(index: int, text: str, finish: str | None, ok: bool = True) -> RequestResult:
    return RequestResult(index=index, ok=ok, text=text, finish_reason=finish, error=None if ok else "x")


def test_validity_counts_stop_valid_stop_invalid_and_length():
    s = SCHEMAS["answer"]
    good, bad = json.dumps(VALID["answer"]), json.dumps({**VALID["answer"], "confidence": "total"})
    schemas = [s, s, s, s, None, s, s]
    results = [
        _result(0, good, "stop"),  # valid
        _result(1, bad, "stop"),  # ended by itself, but not what the schema asks
        _result(2, good[:10], "length"),  # cut at max_tokens
        _result(3, "{", "stop"),  # ended by itself mid-object: invalid
        _result(4, "not JSON at all", "stop"),  # no schema: not counted
        _result(5, "", None, ok=False),  # failed: counted as failed elsewhere
        _result(6, good, "length"),  # at max_tokens even if its text is valid
    ]
    counts, verdicts = json_validity(schemas, results)
    assert counts == {"json_valid": 1, "json_invalid": 2, "json_length": 2}
    assert verdicts == [True, False, None, False, None, None, None]
    none, _ = json_validity([None, None], results[:2])
    assert none == {"json_valid": None, "json_invalid": None, "json_length": None}


# --- the request and the client ------------------------------------------------------------------


def test_config_refuses_json_on_completions_and_builds_requests_with_their_schema():
    with pytest.raises(ValueError, match="--prompt-set json holds chat turns"):
        BenchServeConfig(servers=("ours:none",), concurrency=(1,), prompt_sets=("json",))
    config = BenchServeConfig(
        servers=("ours:none",), concurrency=(1,), endpoint="chat", prompt_sets=("mtbench-chat", "json"),
        num_prompts=2,
    )  # fmt: skip
    requests = _requests(config)
    assert [r.index for r in requests] == list(range(6))
    assert [r.response_format for r in requests[:2]] == [None, None]
    assert [r.response_format for r in requests[2:]] == [p.response_format() for p in json_prompts(2)]
    body = load._payload(requests[2], "chat", "m", {"max_tokens": 8})
    assert body["response_format"]["type"] == "json_schema"
    assert body["messages"] == [{"role": "user", "content": requests[2].prompt}]
    assert "response_format" not in load._payload(requests[0], "chat", "m", {})


def test_the_cli_refuses_json_on_completions_naming_the_flag(tmp_path, capsys):
    argv = ["bench-serve", "--servers", "ours:none", "--concurrency", "1", "--prompt-set", "json"]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdec: error:") and "--prompt-set" in err and "\n" not in err


def test_the_client_keeps_the_full_text_and_the_finish_reason():
    pieces = ['{"topic": "ma', 'th", "answer": "4", ', '"confidence": "high"}']

    def event(delta: dict, finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        assert sent["response_format"]["json_schema"]["schema"] == SCHEMAS["answer"]
        body = event({"role": "assistant", "content": ""})
        body += b"".join(event({"content": p}) for p in pieces) + event({}, "stop")
        return httpx.Response(200, content=body + b"data: [DONE]\n\n")

    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMAS["answer"]}}
    request = BenchRequest(index=0, prompt="q", prompt_set="json", response_format=fmt)

    async def send() -> RequestResult:
        async with httpx.AsyncClient(base_url="http://test", transport=httpx.MockTransport(handler)) as c:
            return await load.stream_request(c, request, endpoint="chat", model="m", sampling={})

    r = asyncio.run(send())
    assert r.ok and r.token_chunks == 3 and r.finish_reason == "stop" and r.text == "".join(pieces)
    assert r.to_dict()["text"] == r.text and r.to_dict()["finish_reason"] == "stop"
    assert json_validity([SCHEMAS["answer"]], [r])[0]["json_valid"] == 1


# --- the report ----------------------------------------------------------------------------------


def _record(level: dict) -> dict:
    level = {"mode": "concurrency", "concurrency": 1, "completed": 4, "failed": 0, **level}
    return {
        "command": "",
        "environment": {"cpu": "c", "isa": "i", "commit": "x"},
        "config": {"threads": 1, "max_tokens": 8},
        "num_requests": 4,
        "servers": [{"name": "ours:none", "kind": "ours", "base_url": "u", "levels": [level]}],
    }


def test_the_table_has_the_validity_columns():
    record = _record({"json_valid": 2, "json_invalid": 1, "json_length": 1})
    md = markdown(record)
    assert "| JSON valid / stop / length |" in md and md.rstrip().endswith("| 2 / 3 / 1 |")
    (table,) = summarize(record).tables
    assert {"json_valid", "json_invalid", "json_length"} <= {c.key for c in table.columns}
    row = table.rows[0]
    assert (row["json_valid"], row["json_invalid"], row["json_length"]) == (2, 1, 1)
    assert markdown(_record({})).rstrip().endswith("| – |")  # a level without schemas


def test_run_against_the_fake_server_counts_the_cut_outputs(fast_env, tmp_path):  # noqa: F811
    server = fake.ThreadedServer(fake.build_app())
    try:
        config = BenchServeConfig(
            base_url=server.url, endpoint="chat", prompt_sets=("json",), num_prompts=1, max_tokens=8,
            concurrency=(1,), request_rates=(math.inf,), out=str(tmp_path),
        )  # fmt: skip
        (entry,) = run_bench_serve(config, echo=lambda line: None)["servers"]
        bodies = server.app.state.bodies
    finally:
        server.close()
    assert all(b["response_format"]["type"] == "json_schema" for b in bodies) and len(bodies) == 1 + 2 * 2
    for level in entry["levels"]:  # the fake server always stops at "length", after "abababab"
        assert (level["json_valid"], level["json_invalid"], level["json_length"]) == (0, 0, 2)
        assert all(
            r["finish_reason"] == "length" and r["text"] == "ab" * fake.CHUNKS for r in level["requests"]
        )
    doc = json.loads((tmp_path / "bench-serve.json").read_text())
    assert doc["servers"][0]["levels"][0]["json_length"] == 2
    assert (tmp_path / "bench-serve.md").read_text().count("| 0 / 0 / 2 |") == 2


# --- against specdec serve ------------------------------------------------------------------------


@pytest.mark.slow
def test_against_specdec_serve_on_a_tiny_model(tmp_path):
    from _tiny import byte_tokenizer, save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "tiny", tokenizer=byte_tokenizer())
    config = BenchServeConfig(
        servers=("ours:none",), target=str(checkpoint), endpoint="chat", prompt_sets=("json",),
        num_prompts=1, max_tokens=24, concurrency=(1,), threads=1, out=str(tmp_path / "out"),
        startup_timeout_s=120,
    )  # fmt: skip
    (entry,) = run_bench_serve(config, echo=lambda line: None)["servers"]
    assert entry["exit_status"] == 0 and entry["warmup_failed"] == 0
    (level,) = entry["levels"]
    assert level["completed"] == 2 and level["failed"] == 0, level["errors"]
    counts = (level["json_valid"], level["json_invalid"], level["json_length"])
    assert all(isinstance(c, int) for c in counts)
    reasons = [r["finish_reason"] for r in level["requests"]]
    assert set(reasons) <= {"stop", "length"} and sum(counts) == 2
    assert level["json_invalid"] == 0  # ours constrains the output: one that ends by itself is valid
    for r in level["requests"]:
        assert isinstance(r["text"], str) and ("json_valid" in r) == (r["finish_reason"] == "stop")
    md = (tmp_path / "out" / "bench-serve.md").read_text()
    assert "JSON valid / stop / length" in md
    assert f"| {counts[0]} / {counts[0] + counts[1]} / {counts[2]} |" in md
