"""``specdec serve`` end to end: a server process on a free loopback port over a tiny random Llama
(``tests/_tiny.py``, byte-level tokenizer), driven by the official ``openai`` client and raw HTTP.

Greedy text streamed = not streamed = ``specdec.generate``'s plain greedy text on the same ids; stop
strings never leak; usage and /metrics count what ran; errors have OpenAI's shape and status; a
client that disconnects frees its cache row; a full waiting queue gets 429; SIGINT and SIGTERM exit 0.
One server for the module (started once, ~5-15 s), one more for the SIGTERM test (slow).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _extras import SERVE, skip_module_without

skip_module_without(SERVE + ("openai",))

import httpx  # noqa: E402
import openai  # noqa: E402
from _tiny import byte_tokenizer, save_tiny_checkpoint  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import specdec  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # the in-process oracle runs on one thread

KEY = "test-key"
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"
SLOTS, MAX_WAITING = 2, 2
START_TIMEOUT_S = 120.0


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path
    model: str

    def http(self, key: str | None = KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def launch(checkpoint: Path, log: Path, *extra: str) -> subprocess.Popen:
    """Start ``python -m specdec serve`` on port 0 (stderr to ``log``); :func:`ready` waits for it."""
    args = [sys.executable, "-m", "specdec", "serve", "--target", str(checkpoint), "--drafter", "ngram"]
    args += ["--port", "0", "--threads", "1", "--log-level", "warning", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "wb") as err:
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err, env=env)


def ready(proc: subprocess.Popen, checkpoint: Path, log: Path) -> Server:
    """Wait for the server's ready line (it names the port)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        for line in text.splitlines():
            if line.startswith("specdec serve: ") and " on http://" in line:
                url = line.split(" on ", 1)[1].split(" ", 1)[0]
                return Server(proc, url, log, str(checkpoint))
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{text}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"the server did not start within {START_TIMEOUT_S} s:\n{log.read_text()}")


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait(10)


@contextlib.contextmanager
def running(checkpoint: Path, log: Path, *extra: str, meanwhile: Callable[[], object] = lambda: None):
    """A ready server from :func:`launch` for the ``with`` block, killed after it; ``meanwhile()`` runs
    while the server starts (a fixture that loads the target in this process, say)."""
    proc = launch(checkpoint, log, *extra)
    try:
        meanwhile()
        s = ready(proc, checkpoint, log)
    except BaseException:
        proc.kill()
        raise
    try:
        yield s
    finally:
        stop(s)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "tiny", tokenizer=byte_tokenizer())


@pytest.fixture(scope="module")
def target(checkpoint):
    return specdec.load_target(str(checkpoint))


def serving(checkpoint: Path, tmp_path_factory, request, flags: str):
    """:func:`running` for a module's ``server`` fixture: ``flags`` as typed after ``specdec serve``,
    the log in a fresh folder, the module's ``target`` fixture loaded while the server starts."""
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    return running(checkpoint, log, *flags.split(), meanwhile=lambda: request.getfixturevalue("target"))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory, request):
    flags = f"--gamma 3 --max-num-seqs {SLOTS} --max-waiting {MAX_WAITING} --api-key {KEY}"
    with serving(checkpoint, tmp_path_factory, request, flags) as s:
        yield s


def plain_text(target: Any, ids: list[int], n: int) -> tuple[str, list[int]]:
    """The oracle: plain greedy decoding (no drafter) by ``specdec.generate``, as the server decodes it."""
    out = specdec.generate(target, [ids], drafter="none", max_new_tokens=n, temperature=0.0)
    tokens = out.token_ids[0]
    text = target.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return text, tokens


def scrape(server: Server) -> dict[tuple[str, frozenset], float]:
    """/metrics as {(sample name, labels without model_name): value}."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def wait_idle(server: Server, timeout_s: float = 20.0) -> dict:
    """Poll /metrics until no cache slot is in use and nothing runs or waits; returns the last scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(server)
        busy = [
            metric(samples, n)
            for n in ("specdec:cache_slots_in_use", "vllm:num_requests_running", "vllm:num_requests_waiting")
        ]
        if busy == [0, 0, 0]:
            return samples
        assert time.monotonic() < deadline, f"still busy after {timeout_s} s: {busy}"
        time.sleep(0.05)


def sse_lines(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


# --- text as it streams (in-process) -------------------------------------------------------------------


def test_text_stream_holds_back_partial_characters_and_stops():
    from specdec.serve.detokenize import TextStream

    tok = byte_tokenizer()
    ids = tok("né€ x").input_ids  # one token per byte: é is 2 bytes, € is 3
    assert len(ids) == 8
    text = TextStream(tok)
    pieces = [text.push([t], finished=False) for t in ids]
    assert pieces == ["n", "", "é", "", "", "€", " ", "x"]  # nothing sent until a character is whole
    stop = TextStream(tok, ["€ x"])
    pieces = [stop.push([t], finished=False) for t in ids]
    assert "".join(pieces) == "né" and stop.stopped  # "€ " held back: it could start the stop string
    assert stop.push([], finished=True) == "" and stop.text == "né"
    tail = TextStream(tok, ["zz"])
    assert [tail.push([t], finished=False) for t in tok("ab").input_ids] == ["", "a"]
    assert tail.push([], finished=True) == "b" and not tail.stopped


@pytest.mark.model
def test_text_stream_is_incremental_and_equals_the_whole_decoding():
    """On the real tokenizer, pushed in random chunks: the pieces joined equal the decoding of all
    ids (cut at the first stop string), no piece has a broken character, and each push decodes only
    a short window of recent ids (not every id again)."""
    import random

    from specdec.serve.detokenize import TextStream, decode_text
    from specdec.targets.loading import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    text = "Héllo wörld, 日本語 🙂 done.\n    return x  # ünïcode €5 " * 40
    ids = tok(text).input_ids
    rng = random.Random(0)
    for stop in ((), ("€5 Héllo",), ("never there", "done.")):
        stream = TextStream(tok, stop)
        pieces, i, widest = [], 0, 0
        while i < len(ids):
            n = rng.randint(1, 4)
            pieces.append(stream.push(ids[i : i + n], finished=False))
            i += n
            widest = max(widest, len(stream.ids) - stream.detok.prefix_offset)
        pieces.append(stream.push([], finished=True))
        whole = decode_text(tok, ids)
        cuts = [whole.find(s) for s in stop if whole.find(s) >= 0]
        assert "".join(pieces) == whole[: min(cuts, default=len(whole))]
        assert not any("\ufffd" in p for p in pieces)
        assert stream.stopped == bool(cuts)
        assert widest <= 16, widest  # the window, not the whole stream


# --- the API ----------------------------------------------------------------------------------------


def test_health_models_metrics(server):
    http = server.http()
    assert http.get("/health").json() == {"status": "ok"}
    models = server.client().models.list().data
    assert [m.id for m in models] == [server.model]
    names = {name for name, _ in scrape(server)}
    for name in (
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "specdec:cache_slots_in_use",
    ):
        assert name in names, name
    assert metric(scrape(server), "specdec:cache_slots") == SLOTS


def test_completion_greedy_equals_stream_and_generate(server, target):
    ids = target.tokenizer(PROMPT).input_ids
    expected, tokens = plain_text(target, ids, 48)
    client = server.client()
    whole = client.completions.create(model=server.model, prompt=ids, max_tokens=48, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == ("length" if len(tokens) == 48 else "stop")
    u = whole.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (
        len(ids),
        len(tokens),
        len(ids) + len(tokens),
    )
    extra = u.model_extra
    assert 0 < extra["num_accepted_tokens"] <= extra["num_draft_tokens"]  # ngram drafts on this prompt
    as_text = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=48, temperature=0)
    assert as_text.choices[0].text == expected
    chunks = list(
        client.completions.create(
            model=server.model,
            prompt=ids,
            max_tokens=48,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) > 3  # tokens arrived over several chunks
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == u.model_dump()


def test_chat_greedy_equals_stream_and_generate(server, target):
    messages = [{"role": "user", "content": "the cat sat on the mat. the cat sat on"}]
    tok = target.tokenizer
    ids = tok(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    ).input_ids
    expected, tokens = plain_text(target, ids, 32)
    client = server.client()
    whole = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=32, temperature=0
    )
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), len(tokens))
    stream = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=32, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_seeded_sampling_repeats(server):
    client = server.client()
    kw = {
        "model": server.model,
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0.9,
        "top_p": 0.9,
        "seed": 7,
        "extra_body": {"top_k": 50},
    }
    a = client.completions.create(**kw).choices[0].text
    b = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert a == b  # the seed fixes the output, streamed or not
    assert client.completions.create(**{**kw, "seed": 8}).choices[0].text != a


def test_stop_string_not_leaked(server, target):
    client = server.client()
    ids = target.tokenizer(PROMPT).input_ids
    full = (
        client.completions.create(
            model=server.model, prompt=ids, max_tokens=64, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    # A stop string from the greedy text itself: the first two printable ASCII characters in a row.
    i = next(
        i for i in range(1, len(full) - 1) if full[i : i + 2].isascii() and full[i : i + 2].isprintable()
    )
    stop = full[i : i + 2]
    expected = full[: full.index(stop)]
    for stream in (False, True):
        kw = {
            "model": server.model,
            "prompt": ids,
            "max_tokens": 64,
            "temperature": 0,
            "stop": [stop, "\x00zz"],
            "extra_body": {"ignore_eos": True},
        }
        if stream:
            chunks = list(client.completions.create(**kw, stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            out = client.completions.create(**kw)
            text, reason = out.choices[0].text, out.choices[0].finish_reason
            assert out.usage.completion_tokens < 64
        assert text == expected and stop not in text
        assert reason == "stop"


def test_errors(server):
    http = server.http()
    ok = {"model": server.model, "prompt": "hello", "max_tokens": 2}
    assert http.post("/v1/completions", json=ok).status_code == 200
    cases = [  # (body, status, param)
        ({**ok, "temperature": "hot"}, 400, "temperature"),
        ({**ok, "temperature": -1}, 400, "temperature"),
        ({**ok, "max_tokens": 0}, 400, "max_tokens"),
        ({**ok, "max_tokens": 2.5}, 400, "max_tokens"),
        ({**ok, "top_p": 1.5}, 400, "top_p"),
        ({**ok, "top_k": "x"}, 400, "top_k"),
        ({**ok, "n": 0}, 400, "n"),
        ({**ok, "stop": 5}, 400, "stop"),
        ({**ok, "seed": -1}, 400, "seed"),
        ({**ok, "stream": "yes"}, 400, "stream"),
        ({**ok, "logprobs": 21}, 400, "logprobs"),
        ({**ok, "prompt": []}, 400, "prompt"),
        ({**ok, "prompt": [1, 2, 99999]}, 400, "prompt"),
        ({**ok, "prompt": ["a", 5]}, 400, "prompt"),
        ({**ok, "model": "gpt-4"}, 404, "model"),
    ]
    for body, status, param in cases:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (body, error)
    r = http.post("/v1/chat/completions", json={"model": server.model, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = http.post("/v1/completions", content=b'{"prompt": "x",', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={**ok, "max_tokens": 5000})
    assert r.status_code == 400
    error = r.json()["error"]
    n = len(byte_tokenizer()("hello").input_ids)
    assert error["code"] == "context_length_exceeded" and f"prompt has {n} tokens" in error["message"]
    assert "max_tokens is 5000" in error["message"] and "2048" in error["message"]
    for key in (None, "wrong"):
        r = server.http(key).post("/v1/completions", json=ok)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert server.http().get("/v1/nothing").status_code == 404
    # the official client maps them to its exceptions
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model, prompt="x", max_tokens=2, n=0)
    bad_key = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.completions.create(model=server.model, prompt="x", max_tokens=2)


def test_metrics_count_a_request(server):
    before = wait_idle(server)
    out = server.client().completions.create(
        model=server.model, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    after = wait_idle(server)
    delta = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)  # noqa: E731
    extra = out.usage.model_extra
    assert delta("vllm:generation_tokens_total") == 40
    assert delta("vllm:prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("vllm:spec_decode_num_draft_tokens_total") == extra["num_draft_tokens"] > 0
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == extra["num_accepted_tokens"]
    per_pos = sum(
        delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(k)) for k in range(3)
    )
    assert per_pos == extra["num_accepted_tokens"]
    assert 0 < delta("vllm:spec_decode_num_drafts_total") <= extra["num_draft_tokens"]
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert delta(name) == 1
    assert delta("vllm:inter_token_latency_seconds_count") >= 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_may_ask_for_no_drafting(server, stream):
    """``"speculative": false``: the same greedy text with no draft token verified for it (usage's
    counts stay, streamed or not); a value that is not a boolean is a 400 naming the field."""
    client = server.client()
    texts, drafted = [], []
    for speculative in (True, False):
        extra = {"ignore_eos": True, "speculative": speculative}
        options = dict(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=extra)
        if stream:
            chunks = list(
                client.completions.create(stream=True, stream_options={"include_usage": True}, **options)
            )
            texts.append("".join(c.choices[0].text for c in chunks if c.choices))
            usage = chunks[-1].usage
        else:
            out = client.completions.create(**options)
            texts.append(out.choices[0].text)
            usage = out.usage
        drafted.append(usage.model_extra["num_draft_tokens"])
        assert usage.completion_tokens == 24
    assert texts[0] == texts[1]
    assert drafted[0] > 0 and drafted[1] == 0
    r = server.http().post("/v1/completions", json={"prompt": PROMPT, "speculative": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative", r.text


def _long_stream(http: httpx.Client, max_tokens: int = 1900) -> httpx.Response:
    """A streamed request that runs for seconds: sampled, so prompt lookup's drafts are rarely accepted."""
    body = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": 0,
        "ignore_eos": True,
        "stream": True,
    }
    request = http.build_request("POST", "/v1/completions", json=body)
    response = http.send(request, stream=True)
    assert response.status_code == 200, response.read()
    return response


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_disconnect_frees_the_row(server, stream):
    """A client that leaves mid-stream (after its first chunk), or while waiting for a whole response,
    has its request aborted and its cache row freed."""
    before = wait_idle(server)
    http = server.http()
    if stream:
        response = _long_stream(http)
        assert '"text"' in next(sse_lines(response))
        response.close()
    else:
        body = {"prompt": PROMPT, "max_tokens": 1900, "temperature": 1.0, "seed": 0, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=httpx.Timeout(10.0, read=0.3))
    http.close()
    after = wait_idle(server)
    assert metric(after, "vllm:request_success_total", finished_reason="abort") == (
        metric(before, "vllm:request_success_total", finished_reason="abort") + 1
    )
    generated = metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total")
    assert 0 < generated < 1900


def test_full_waiting_queue_gets_429(server):
    wait_idle(server)
    http = server.http()
    streams = [_long_stream(http) for _ in range(SLOTS + MAX_WAITING)]  # every slot busy, the queue full
    try:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert metric(scrape(server), "specdec:cache_slots_in_use") == SLOTS
    finally:
        for s in streams:
            s.close()
        http.close()
    wait_idle(server)
    assert server.http().post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_sigint_exits_0(server):
    """Last in the module: Ctrl-C stops the module's server cleanly (exit status 0)."""
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(30) == 0, server.log.read_text()
    assert "Traceback" not in server.log.read_text()


@pytest.mark.slow
def test_sigterm_refuses_new_requests_aborts_late_ones_exits_0(checkpoint, tmp_path):
    """SIGTERM: new requests get 503 at once; a request still running when the shutdown timeout ends
    is aborted (its stream ends with an error and [DONE]); the process exits 0."""
    log = tmp_path / "server.log"
    extra = ["--drafter", "none", "--gamma", "0", "--shutdown-timeout", "0.5"]
    with running(checkpoint, log, *extra) as s:
        http = s.http(None)
        response = _long_stream(http)  # plain decoding of 1,900 tokens: seconds, far past the 0.5 s
        lines = sse_lines(response)
        next(lines)
        s.proc.send_signal(signal.SIGTERM)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        rest = list(lines)
        assert rest[-1] == "[DONE]" and "shutting down" in rest[-2] and '"error"' in rest[-2]
        assert s.proc.wait(30) == 0, s.log.read_text()
        assert "Traceback" not in s.log.read_text()
