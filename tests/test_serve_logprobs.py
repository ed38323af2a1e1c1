"""The request fields clients send beyond text: lists of prompts, ``n``, ``logprobs`` /
``top_logprobs``, ``echo`` (with ``max_tokens: 0``), streamed and not, through the official
``openai`` client and raw HTTP, against ``specdec serve`` over a tiny random Llama.

Log-probabilities through the server (``--drafter ngram``, speculative) equal bitwise those of an
in-process engine decoding plainly (``drafter="none"``) with the server's engine settings, for the
generated tokens and for the prompt's (echo). Helpers are ``tests/test_serve.py``'s.
"""

from __future__ import annotations

import json

import pytest
import test_serve
import torch
from test_serve import KEY, PROMPT, metric, scrape, serving, sse_lines, wait_idle

from specdec.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")

GAMMA = 3


checkpoint, target = test_serve.checkpoint, test_serve.target  # the same fixtures: a tiny checkpoint, loaded


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory, request):
    flags = f"--gamma {GAMMA} --max-num-seqs 4 --api-key {KEY}"
    with serving(checkpoint, tmp_path_factory, request, flags) as s:
        yield s


def plain(target, ids: list[int], n: int, *, k: int, prompt: bool = False):
    """The oracle: one request through an in-process engine decoding plainly (no drafter), with the
    server's settings (chunked prefill, context): its last output."""
    engine = Engine(target, drafter="none", gamma=GAMMA, max_num_seqs=1, measure_cost=False)
    engine.add_request(
        ids, max_new_tokens=n, temperature=0.0, logprobs=k, prompt_logprobs=k if prompt else None
    )
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            last = out
    return last


def ids_of(target, text: str) -> list[int]:
    return list(target.tokenizer(text).input_ids)


def decode(target, ids: list[int]) -> str:
    return target.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_completion_logprobs_equal_plain_decoding(server, target):
    ids = ids_of(target, PROMPT)
    oracle = plain(target, ids, 24, k=3)
    client = server.client()
    out = client.completions.create(model=server.model, prompt=ids, max_tokens=24, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == [e.logprob for e in oracle.logprobs]  # bitwise: speculative = plain
    assert lp.tokens == [decode(target, [t]) for t in oracle.token_ids]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, value, top, entry in zip(
        lp.tokens, lp.token_logprobs, lp.top_logprobs, oracle.logprobs, strict=True
    ):
        assert 1 <= len(top) <= 4 and top[token] == value == max(top.values())  # greedy: the most likely
        assert all(top[decode(target, [t])] >= v for t, v in entry.top)  # every alternative, by its text
    # streamed: the same values, in pieces; offsets run on across chunks
    chunks = list(
        client.completions.create(
            model=server.model, prompt=ids, max_tokens=24, temperature=0, logprobs=3, stream=True
        )
    )
    pieces = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(pieces) > 1
    assert [v for p in pieces for v in p.token_logprobs] == lp.token_logprobs
    assert [o for p in pieces for o in p.text_offset] == lp.text_offset
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text


def test_echo_scores_the_prompt(server, target):
    ids = ids_of(target, PROMPT)
    oracle = plain(target, ids, 1, k=1, prompt=True)
    http = server.http()
    body = {
        "model": server.model, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0,
        "ignore_eos": True,
    }  # fmt: skip
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == decode(target, ids) and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [e.logprob for e in oracle.prompt_logprobs[1:]]
    assert len(lp["tokens"]) == len(ids) and r.json()["usage"]["completion_tokens"] == 0
    # lm-eval's loglikelihood request: echo, one generated token, logprobs 1, a string prompt
    r = http.post("/v1/completions", json={**body, "prompt": PROMPT, "max_tokens": 1})
    choice = r.json()["choices"][0]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    values = choice["logprobs"]["token_logprobs"]
    assert values[:-1] == lp["token_logprobs"] and values[-1] == oracle.logprobs[0].logprob
    assert r.json()["usage"]["completion_tokens"] == 1
    # streamed: the prompt first, with its values
    r = http.post("/v1/completions", json={**body, "stream": True, "max_tokens": 3})
    chunks = [json.loads(x) for x in sse_lines(r) if x != "[DONE]"]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(decode(target, ids))
    assert first["logprobs"]["token_logprobs"][: len(ids)] == lp["token_logprobs"]
    streamed = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert len(streamed) == len(ids) + 3


def test_prompt_lists_and_n(server, target):
    client = server.client()
    other = "a different prompt, sampled"
    kw = {
        "model": server.model,
        "max_tokens": 12,
        "temperature": 0.9,
        "seed": 5,
        "extra_body": {"ignore_eos": True},
    }
    out = client.completions.create(prompt=[PROMPT, ids_of(target, other)], n=2, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    texts = [c.text for c in out.choices]
    alone = client.completions.create(prompt=other, **kw).choices[0].text
    assert texts[2] == alone  # choice 0 of a prompt: the request's seed, as if sent alone
    assert texts[0] != texts[1] and texts[2] != texts[3]  # each choice its own keyed stream
    assert client.completions.create(prompt=[PROMPT, other], n=2, **kw).choices[3].text == texts[3]
    u = out.usage
    assert u.prompt_tokens == len(ids_of(target, PROMPT)) + len(ids_of(target, other))
    assert u.completion_tokens == 4 * 12 and u.total_tokens == u.prompt_tokens + 48
    # streamed: chunks of every choice, each carrying its index; the same texts
    chunks = list(
        client.completions.create(
            prompt=[PROMPT, other], n=2, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    streamed = ["", "", "", ""]
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    assert chunks[-1].usage.completion_tokens == 48
    finishes = [ch.index for c in chunks for ch in c.choices if ch.finish_reason]
    assert sorted(finishes) == [0, 1, 2, 3]
    wait_idle(server)  # nothing left running: every choice's row was given back


def test_chat_logprobs_and_n(server, target):
    messages = [{"role": "user", "content": "the cat sat on the mat. the cat sat on"}]
    tok = target.tokenizer
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False).input_ids  # fmt: skip
    oracle = plain(target, ids, 16, k=2)
    client = server.client()
    kw = {"model": server.model, "messages": messages, "max_tokens": 16, "temperature": 0}
    out = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
    content = out.choices[0].logprobs.content
    assert [c.logprob for c in content] == [e.logprob for e in oracle.logprobs]
    assert [c.token for c in content] == [decode(target, [t]) for t in oracle.token_ids]
    for c, entry in zip(content, oracle.logprobs, strict=True):
        assert [t.logprob for t in c.top_logprobs] == [v for _, v in entry.top]
        assert bytes(c.bytes).decode("utf-8", errors="replace") == c.token or "\ufffd" in c.token
    chunks = list(client.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **kw))
    streamed = [
        c for ch in chunks for choice in ch.choices if choice.logprobs for c in choice.logprobs.content
    ]
    assert [c.logprob for c in streamed] == [c.logprob for c in content]
    raw = {**kw, "logprobs": True, "top_logprobs": 2}
    whole = server.http().post("/v1/chat/completions", json=raw).json()["choices"][0]["logprobs"]
    assert whole == out.choices[0].logprobs.model_dump()  # raw HTTP: the same object
    with (
        server.http() as http,
        http.stream("POST", "/v1/chat/completions", json={**raw, "stream": True}) as r,
    ):
        lines = [json.loads(x) for x in sse_lines(r) if x != "[DONE]"]
    raw_streamed = [
        c for x in lines for ch in x["choices"] if ch["logprobs"] for c in ch["logprobs"]["content"]
    ]
    assert raw_streamed == whole["content"]
    plain_out = client.chat.completions.create(**kw)
    assert plain_out.choices[0].logprobs is None
    neutral = client.chat.completions.create(top_logprobs=0, **kw)  # 0 without logprobs: off
    assert (
        neutral.choices[0].logprobs is None
        and neutral.choices[0].message.content == out.choices[0].message.content
    )
    many = client.chat.completions.create(n=3, **{**kw, "temperature": 1.0, "seed": 1})
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert len({c.message.content for c in many.choices}) > 1


def test_bad_combinations_get_400_naming_the_field(server):
    http = server.http()
    ok = {"model": server.model, "prompt": "hello", "max_tokens": 2}
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [  # (path, body, param)
        ("/v1/completions", {**ok, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {**ok, "logprobs": -1}, "logprobs"),
        ("/v1/completions", {**ok, "logprobs": "3"}, "logprobs"),
        ("/v1/completions", {**ok, "logprobs": True}, "logprobs"),
        ("/v1/completions", {**ok, "logprobs": 2, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {**ok, "echo": "yes"}, "echo"),
        ("/v1/completions", {**ok, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {**ok, "max_tokens": -1, "echo": True}, "max_tokens"),
        ("/v1/completions", {**ok, "n": 0}, "n"),
        ("/v1/completions", {**ok, "n": 129}, "n"),
        ("/v1/completions", {**ok, "n": "2"}, "n"),
        ("/v1/completions", {**ok, "n": 100, "prompt": ["a", "b"]}, "n"),
        ("/v1/completions", {**ok, "best_of": 2}, "best_of"),
        ("/v1/completions", {**ok, "prompt": [[]]}, "prompt"),
        ("/v1/completions", {**ok, "prompt": ["a", 5]}, "prompt"),
        ("/v1/completions", {**ok, "prompt": [[1, 2], [3, 99999]]}, "prompt[1]"),
        ("/v1/completions", {**ok, "prompt": ["a", ""]}, "prompt[1]"),
        ("/v1/completions", {**ok, "best_of": 0}, "best_of"),
        (
            "/v1/completions",
            {**ok, "stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
        ),
        ("/v1/chat/completions", {**chat, "logprobs": 3}, "logprobs"),
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "echo": True}, "echo"),
        ("/v1/chat/completions", {**chat, "n": 0}, "n"),
    ]
    for path, body, param in cases:
        r = http.post(path, json=body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", (body, error)
    wait_idle(server)


def test_logprobs_through_the_client_types(server):
    """The official client parses every shape (its pydantic models accept the fields)."""
    client = server.client()
    out = client.completions.create(
        model=server.model, prompt=["x y", "z"], max_tokens=2, temperature=0, logprobs=0, echo=True
    )
    for c in out.choices:
        assert c.logprobs.token_logprobs[0] is None
        assert all(isinstance(v, float) for v in c.logprobs.token_logprobs[1:])
        assert all(v is None or isinstance(v, dict) for v in c.logprobs.top_logprobs)
    assert torch.tensor(out.choices[0].logprobs.token_logprobs[1:]).le(0).all()


def test_a_client_leaving_a_stream_of_several_choices_frees_every_row(server):
    body = {
        "model": server.model, "prompt": [PROMPT, "another"], "n": 2, "max_tokens": 1500, "stream": True,
        "temperature": 0.9, "ignore_eos": True, "logprobs": 2,
    }  # fmt: skip
    before = metric(scrape(server), "vllm:request_success_total", finished_reason="abort")
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        seen = set()
        for line in sse_lines(r):
            seen.add(json.loads(line)["choices"][0]["index"])
            if len(seen) == 4:
                break  # every choice has streamed: leave mid-stream
    samples = wait_idle(server, timeout_s=30)  # every row free again
    assert metric(samples, "vllm:request_success_total", finished_reason="abort") - before == 4


def test_token_bytes_and_legacy_format_in_process():
    from _tiny import byte_tokenizer

    from specdec.engine.logprobs import TokenLogprob
    from specdec.serve.logprobs import TokenTexts, chat_logprobs, completion_logprobs

    tok = byte_tokenizer()
    texts = TokenTexts(tok)
    ids = tok("é!").input_ids  # two byte tokens for é, one for !
    assert len(ids) == 3 and texts.text(ids[0]) == "\ufffd"
    assert b"".join(bytes(texts.bytes(t)) for t in ids) == "é!".encode()
    entries = [None, TokenLogprob(ids[1], -0.5, ((ids[2], -0.25),)), TokenLogprob(ids[2], float("-inf"))]
    body, end = completion_logprobs(entries, ids, texts, offset=10)
    assert body["token_logprobs"] == [None, -0.5, -9999.0] and body["top_logprobs"][0] is None
    assert body["top_logprobs"][1] == {texts.text(ids[1]): -0.5, "!": -0.25}
    assert body["text_offset"] == [10, 11, 12] and end == 13
    chat = chat_logprobs(entries[1:], texts)["content"]
    assert chat[0]["bytes"] == ["é".encode()[1]] and chat[0]["top_logprobs"][0]["token"] == "!"
    assert chat[1]["logprob"] == -9999.0 and chat[1]["top_logprobs"] == []
