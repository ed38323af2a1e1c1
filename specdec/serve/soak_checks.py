"""What the soak of ``specdec serve`` sends, and how it judges what comes back (no I/O here).

:func:`plan_requests` makes the seeded plan: completions and chat, streamed and not, greedy and
sampled, some cut off by the client mid-stream, some malformed (:data:`MALFORMED`: each kind, the
status and OpenAI error fields it must get). ``judge_*`` return None when an answer is as expected,
else what is wrong; :func:`judge_idle` reads the load gauges of ``/metrics`` and :func:`judge_rss`
decides whether the server's memory stayed flat. The driver is :mod:`specdec.serve.soak`.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Planned",
    "Outcome",
    "MALFORMED",
    "IDLE_GAUGES",
    "PROMPTS",
    "plan_requests",
    "judge_whole",
    "judge_stream",
    "judge_error",
    "judge_idle",
    "judge_rss",
]

# The gauges of specdec/serve/metrics.py that must read 0 once the load has ended.
IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "specdec:cache_slots_in_use")
# kind -> (status, param, code, words the message must hold); "{max_model_len}" is filled in.
MALFORMED: dict[str, tuple[int, str | None, str | None, tuple[str, ...]]] = {
    "bad_json": (400, None, None, ("JSON",)),
    "not_object": (400, None, None, ("JSON object",)),
    "bad_temperature": (400, "temperature", None, ("temperature",)),
    "bad_max_tokens": (400, "max_tokens", None, ("max_tokens",)),
    "unknown_model": (404, "model", "model_not_found", ("no-such-model",)),
    "over_context": (400, "max_tokens", "context_length_exceeded", ("context length", "{max_model_len}")),
}
PROMPTS = (
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def fibonacci(n):\n    ",
    "Write a short poem about the sea.",
    "List three prime numbers and explain why each is prime.",
    "Once upon a time, in a small village by the river, there lived",
    "Translate to French: good morning, how are you?",
    "import numpy as np\n\ndef softmax(x):\n",
    "What is the capital of France? Answer in one word.",
)
FINISH = ("stop", "length")
MB = 1 << 20


@dataclass(frozen=True)
class Planned:
    """One request of the plan: ``kind`` is ``ok``, ``disconnect`` or ``malformed``."""

    index: int
    kind: str
    path: str
    body: bytes
    stream: bool
    chat: bool
    max_tokens: int = 0
    disconnect_after: int = 0  # SSE events read before closing the connection (0: read them all)
    malformed: str | None = None
    expect: tuple[int, str | None, str | None, tuple[str, ...]] | None = None


@dataclass
class Outcome:
    """What came back for one request; ``problem`` None means it is as the plan expects."""

    index: int
    kind: str
    status: int | None
    problem: str | None
    events: int = 0
    cut_off: bool = False  # the client closed the stream before its end
    seconds: float = 0.0


# --- the plan ----------------------------------------------------------------------------------------
def _well_formed(rng: random.Random, model: str, chat: bool, stream: bool, max_tokens: int) -> dict[str, Any]:
    prompt = rng.choice(PROMPTS)
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(max(1, max_tokens // 2), max_tokens)}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, seed=rng.randrange(2**32))
        if rng.random() < 0.5:
            body["top_p"] = 0.9
    if rng.random() < 0.25:
        body["stop"] = ["\n\n", "."]
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return body


def _malformed(kind: str, body: dict[str, Any], max_model_len: int) -> bytes:
    body = dict(body, stream=False)
    body.pop("stream_options", None)
    if kind == "bad_json":
        return json.dumps(body).encode()[:-7]
    if kind == "not_object":
        return b"[1, 2, 3]"
    if kind == "bad_temperature":
        body["temperature"] = -1
    elif kind == "bad_max_tokens":
        body["max_tokens"] = "x"
    elif kind == "unknown_model":
        body["model"] = "no-such-model"
    elif kind == "over_context":
        body["max_tokens"] = max_model_len
    else:
        raise ValueError(f"malformed kind {kind!r}: expected one of {sorted(MALFORMED)}")
    return json.dumps(body).encode()


def plan_requests(
    num_requests: int,
    *,
    model: str,
    max_model_len: int,
    max_tokens: int,
    malformed_rate: float,
    disconnect_rate: float,
    stream_fraction: float = 0.5,
    chat_fraction: float = 0.5,
    seed: int = 0,
) -> list[Planned]:
    """The seeded plan of ``num_requests``: exactly round(malformed_rate x N) malformed requests (the
    kinds in turn), and round(disconnect_rate x streamed well-formed ones) cut off by the client after
    1..max(1, max_tokens // 4) SSE events (a speculative step sends several tokens in one event); the
    well-formed ones ask for max_tokens // 2..max_tokens tokens."""
    for name, value in (
        ("malformed_rate", malformed_rate),
        ("disconnect_rate", disconnect_rate),
        ("stream_fraction", stream_fraction),
        ("chat_fraction", chat_fraction),
    ):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    rng = random.Random(seed)
    n = num_requests
    bad = sorted(rng.sample(range(n), round(malformed_rate * n)))
    kinds = [sorted(MALFORMED)[i % len(MALFORMED)] for i in range(len(bad))]
    rng.shuffle(kinds)
    bad_kind = dict(zip(bad, kinds, strict=True))
    shapes = [(rng.random() < chat_fraction, rng.random() < stream_fraction) for _ in range(n)]
    streamed = [i for i in range(n) if i not in bad_kind and shapes[i][1]]
    cut = set(rng.sample(streamed, round(disconnect_rate * len(streamed))))
    plan = []
    for i, (chat, stream) in enumerate(shapes):
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = _well_formed(rng, model, chat, stream, max_tokens)
        if i in bad_kind:
            kind = bad_kind[i]
            status, param, code, words = MALFORMED[kind]
            words = tuple(w.format(max_model_len=max_model_len) for w in words)
            raw = _malformed(kind, body, max_model_len)
            plan.append(
                Planned(i, "malformed", path, raw, False, chat, 0, 0, kind, (status, param, code, words))
            )
            continue
        after = rng.randint(1, max(1, max_tokens // 4)) if i in cut else 0
        kind = "disconnect" if after else "ok"
        plan.append(
            Planned(i, kind, path, json.dumps(body).encode(), stream, chat, body["max_tokens"], after)
        )
    return plan


# --- judging what came back ----------------------------------------------------------------------------
def _usage_problem(usage: Any, max_tokens: int, reason: str) -> str | None:
    if not isinstance(usage, dict):
        return f"usage is {usage!r}"
    tokens = usage.get("completion_tokens")
    if not isinstance(tokens, int) or not 1 <= tokens <= max_tokens:
        return f"usage.completion_tokens {tokens!r} outside [1, max_tokens={max_tokens}]"
    if reason == "length" and tokens != max_tokens:
        return f"finish_reason length after {tokens} of max_tokens={max_tokens} tokens"
    return None


def judge_whole(status: int, body: bytes, *, chat: bool, max_tokens: int) -> str | None:
    """None if a non-streamed answer is complete, else what is wrong with it."""
    if status != 200:
        return f"status {status}: {body[:200]!r}"
    try:
        choice = json.loads(body)["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        reason, usage = choice["finish_reason"], json.loads(body).get("usage")
    except (ValueError, KeyError, IndexError, TypeError) as err:
        return f"not a complete {'chat.completion' if chat else 'text_completion'} ({err!r}): {body[:200]!r}"
    if not isinstance(text, str) or reason not in FINISH:
        return f"text {type(text).__name__}, finish_reason {reason!r}"
    return _usage_problem(usage, max_tokens, reason)


def judge_stream(status: int, events: Sequence[str], *, chat: bool, max_tokens: int) -> str | None:
    """None if a read-to-the-end stream is complete (``events``: its ``data:`` payloads), else why not."""
    if status != 200:
        return f"status {status}"
    if not events or events[-1] != "[DONE]":
        return f"the stream does not end with [DONE] (last event {events[-1:]!r}, {len(events)} events)"
    reasons, usage = [], None
    for raw in events[:-1]:
        try:
            chunk = json.loads(raw)
        except ValueError:
            return f"an event is not JSON: {raw[:200]!r}"
        if not isinstance(chunk, dict) or "error" in chunk:
            return f"error event: {raw[:200]!r}"
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            if (choice.get("delta") if chat else choice.get("text")) is None:
                return f"a chunk without {'delta' if chat else 'text'}: {raw[:200]!r}"
            reasons.append(choice.get("finish_reason"))
    finished = [r for r in reasons if r is not None]
    if len(finished) != 1 or reasons[-1] not in FINISH:
        return f"finish_reasons {finished!r} (the last choice chunk must carry the only one)"
    return None if usage is None else _usage_problem(usage, max_tokens, reasons[-1])


def judge_error(planned: Planned, status: int, body: bytes) -> str | None:
    """None if a malformed request got the 4xx and the OpenAI error JSON its plan expects."""
    assert planned.expect is not None
    want, param, code, words = planned.expect
    if status != want:
        return f"{planned.malformed}: status {status}, expected {want}: {body[:200]!r}"
    try:
        error = json.loads(body)["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        return f"{planned.malformed}: not OpenAI's error JSON: {body[:200]!r}"
    if not isinstance(message, str) or not isinstance(error.get("type"), str):
        return f"{planned.malformed}: error.message / error.type not strings: {error!r}"
    if param is not None and error.get("param") != param:
        return f"{planned.malformed}: error.param {error.get('param')!r}, expected {param!r}"
    if code is not None and error.get("code") != code:
        return f"{planned.malformed}: error.code {error.get('code')!r}, expected {code!r}"
    missing = [w for w in words if w.lower() not in message.lower()]
    return f"{planned.malformed}: the message does not name {missing}: {message!r}" if missing else None


def judge_idle(metrics_text: str) -> tuple[bool, dict[str, float | None]]:
    """Whether every gauge of :data:`IDLE_GAUGES` reads 0 in a ``/metrics`` text (summed over labels;
    a missing one is None and fails)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float | None] = dict.fromkeys(IDLE_GAUGES)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] = (values[sample.name] or 0.0) + sample.value
    return all(v == 0 for v in values.values()), values


def judge_rss(
    samples: Sequence[tuple[float, int, int]], warmup_done: int, tolerance_frac: float, tolerance_mb: float
) -> tuple[bool | None, dict[str, Any]]:
    """Flat memory: ``samples`` are (seconds, requests done, RSS bytes); those taken once ``warmup_done``
    requests had finished are split in quarters, and the last quarter's median RSS may exceed the first
    quarter's by at most min(``tolerance_frac`` x first, ``tolerance_mb``). None (skip) under 8 samples."""
    rss = [r for _, done, r in samples if done >= warmup_done]
    detail: dict[str, Any] = {"samples": len(rss), "warmup_requests": warmup_done}
    if len(rss) < 8:
        return None, {**detail, "why": "fewer than 8 RSS samples after the warm-up"}
    q = len(rss) // 4
    first, last = statistics.median(rss[:q]), statistics.median(rss[-q:])
    tolerance = min(tolerance_frac * first, tolerance_mb * MB)
    detail.update(
        first_quarter_mb=round(first / MB, 1),
        last_quarter_mb=round(last / MB, 1),
        growth_mb=round((last - first) / MB, 1),
        tolerance_mb=round(tolerance / MB, 1),
        max_mb=round(max(rss) / MB, 1),
    )
    return last - first <= tolerance, detail
