"""The load loop of ``specdec bench-serve``: streamed OpenAI requests, timed at the client.

Every request is a ``POST /v1/completions`` (or ``/v1/chat/completions``) with ``"stream": true`` and
``"stream_options": {"include_usage": true}`` (and the request's ``response_format``, if it has one),
sent by one asyncio ``httpx`` client. Two ways to load the server, as ``vllm bench serve``:

- **closed loop** (:func:`run_closed_loop`): ``concurrency`` workers, each sending its next request
  when its last one has ended, so that exactly that many are in flight until the prompts run out;
- **open loop** (:func:`run_open_loop`): requests sent at arrival times drawn from a gamma
  distribution of mean ``1 / request_rate`` and shape ``burstiness`` (1: a Poisson process; below 1
  burstier, above 1 more even), whatever the server has not finished; ``inf``: all at once.

Times are ``time.perf_counter`` at the client, from the moment the request is sent. A *token chunk*
is a streamed event whose choice carries text (``choices[0].text``, or ``delta.content`` for chat):
a chat stream's opening role chunk and an empty finishing chunk are not token chunks. The figures
(:class:`RequestResult`), with ``vllm bench serve``'s definitions:

- TTFT: sent → the first token chunk (for a response without text, an end-of-sequence token alone:
  sent → the first event with a ``finish_reason``);
- ITL: the gaps between consecutive token chunks (one chunk may bring several tokens: a server
  that speculates streams an accepted draft block as one chunk);
- E2EL: sent → the last event that carries a choice;
- TPOT: ``(E2EL − TTFT) / (output tokens − 1)``, for requests with more than one output token;
- output tokens: the server's ``usage.completion_tokens``, else the number of token chunks;
- text and finish reason: the choices' texts joined, and the first ``finish_reason`` (kept for
  checks of the output, such as :mod:`specdec.bench.json_prompts`);
- draft and accepted tokens: the server's ``usage.num_draft_tokens`` and ``usage.num_accepted_tokens``
  (``specdec serve``), else llama-server's ``timings.draft_n`` and ``timings.draft_n_accepted`` (it
  leaves both out of a response it drafted nothing for: 0 then).

A request fails on an HTTP status other than 200, an ``error`` event in the stream, a stream that
ends without ``data: [DONE]``, a stream with neither a token chunk nor a ``finish_reason``, or a
connection error or timeout.

:mod:`specdec.bench.serve_probe` reads what the server reports about itself (``/health``,
``/v1/models``, ``/metrics``).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = [
    "ENDPOINTS",
    "BenchRequest",
    "RequestResult",
    "LevelRun",
    "result_from_trace",
    "arrival_times",
    "SSEReply",
    "post_sse",
    "stream_request",
    "http_client",
    "closed_loop",
    "run_closed_loop",
    "run_open_loop",
]

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
"""``--endpoint`` → the route the requests are posted to."""


@dataclass(frozen=True, kw_only=True)
class BenchRequest:
    """One request of a level: the prompt (text), where it comes from, and the ``response_format`` its
    body carries (structured output; None: none)."""

    index: int
    prompt: str
    prompt_set: str
    response_format: Mapping[str, Any] | None = None


@dataclass(kw_only=True)
class RequestResult:
    """One request as the client saw it (times in seconds; ``None`` where a failed request has none)."""

    index: int
    ok: bool
    error: str | None = None
    sent_s: float = 0.0
    """When it was sent, from the start of its level."""
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    token_chunks: int = 0
    prompt_tokens: int | None = None
    draft_tokens: int | None = None
    """``usage.num_draft_tokens`` (``specdec serve``) or ``timings.draft_n`` (llama-server), when the
    server reports it."""
    accepted_tokens: int | None = None
    text: str = ""
    """The output: every choice's text (``delta.content`` for chat) joined, in stream order."""
    finish_reason: str | None = None
    """The first ``finish_reason`` the stream gave (``"stop"``, ``"length"``, ...), if any."""

    @property
    def tpot_s(self) -> float | None:
        """``(E2EL − TTFT) / (output tokens − 1)``; None for a failed request or one of ≤ 1 token."""
        if not self.ok or self.output_tokens <= 1 or self.ttft_s is None or self.e2el_s is None:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        """The request's figures, finish reason and text for the results file (ITLs summarised by their
        count)."""
        return {
            "index": self.index,
            "ok": self.ok,
            "error": self.error,
            "sent_s": self.sent_s,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2el_s": self.e2el_s,
            "output_tokens": self.output_tokens,
            "token_chunks": self.token_chunks,
            "prompt_tokens": self.prompt_tokens,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "finish_reason": self.finish_reason,
            "text": self.text,
        }


@dataclass
class LevelRun:
    """The requests of one load level and its wall time (first send → last request ended)."""

    results: list[RequestResult]
    duration_s: float


def result_from_trace(
    index: int,
    *,
    sent_s: float,
    token_times_s: Sequence[float],
    last_choice_s: float | None,
    usage: Mapping[str, Any] | None,
    error: str | None = None,
    start_s: float = 0.0,
    finish_s: float | None = None,
    timings: Mapping[str, Any] | None = None,
    text: str = "",
    finish_reason: str | None = None,
) -> RequestResult:
    """The figures of one streamed request from its timestamps (module doc for the definitions).

    ``sent_s``: when it was sent; ``token_times_s``: when each token chunk arrived; ``last_choice_s``:
    when the last event with a choice arrived; ``usage``: the stream's usage object, if any;
    ``error``: why it failed (None if the stream ended with ``[DONE]``); ``start_s``: the level's
    start (``RequestResult.sent_s`` is relative to it); ``finish_s``: when the first choice with a
    ``finish_reason`` arrived (the first token's time of a response without text); ``timings``:
    llama-server's ``timings`` object, if any; ``text``, ``finish_reason``: the output and the first
    finish reason, kept as they are. One clock."""
    chunks = len(token_times_s)
    if error is None and not token_times_s and finish_s is None:
        error = "the stream carried neither text nor a finish_reason"
    if error is not None:
        return RequestResult(
            index=index,
            ok=False,
            error=error,
            sent_s=sent_s - start_s,
            text=text,
            finish_reason=finish_reason,
        )
    times = list(token_times_s) or [finish_s]  # no text: an end-of-sequence token alone came
    counted = usage.get("completion_tokens") if usage else None
    output_tokens = counted if isinstance(counted, int) and counted >= 0 else chunks
    end = last_choice_s if last_choice_s is not None else times[-1]

    def count(key: str) -> int | None:
        value = usage.get(key) if usage else None
        return value if isinstance(value, int) else None

    def timed(key: str) -> int | None:
        value = timings.get(key, 0) if timings is not None else None
        return value if isinstance(value, int) else None

    drafted, accepted = count("num_draft_tokens"), count("num_accepted_tokens")
    if drafted is None and accepted is None:
        drafted, accepted = timed("draft_n"), timed("draft_n_accepted")

    return RequestResult(
        index=index,
        ok=True,
        sent_s=sent_s - start_s,
        ttft_s=times[0] - sent_s,
        e2el_s=end - sent_s,
        itl_s=[b - a for a, b in zip(times, times[1:], strict=False)],
        output_tokens=output_tokens,
        token_chunks=chunks,
        prompt_tokens=count("prompt_tokens"),
        draft_tokens=drafted,
        accepted_tokens=accepted,
        text=text,
        finish_reason=finish_reason,
    )


def arrival_times(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds from the level's start) of an open loop: the first at 0, then gaps drawn
    from Gamma(shape ``burstiness``, scale ``1 / (request_rate · burstiness)``), mean ``1 /
    request_rate`` (``vllm bench serve``'s; ``burstiness`` 1 is a Poisson process). An infinite rate
    sends every request at 0."""
    if not (request_rate > 0):
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    times, t = [], 0.0
    for _ in range(num_requests):
        times.append(t)
        t += rng.gammavariate(burstiness, scale)
    return times


def _payload(request: BenchRequest, endpoint: str, model: str, sampling: Mapping[str, Any]) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling,
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if request.response_format is not None:
        body["response_format"] = dict(request.response_format)
    return body


def _choice_text(choice: Mapping[str, Any], endpoint: str) -> str:
    if endpoint == "chat":
        delta = choice.get("delta")
        return (delta.get("content") or "") if isinstance(delta, Mapping) else ""
    return choice.get("text") or ""


@dataclass
class SSEReply:
    """What one streamed ``POST`` got: the status (None if no answer came), the body of an answer other
    than 200, the ``data:`` payloads with their arrival times (``time.perf_counter``), whether the client
    closed the stream before its end, and why the transport failed."""

    status: int | None = None
    body: bytes = b""
    events: list[tuple[float, str]] = field(default_factory=list)
    cut_off: bool = False
    error: str | None = None
    stale: bool = False  # the connection was closed before any response (sent again once)


async def post_sse(client: httpx.AsyncClient, path: str, content: bytes, *, stop_after: int = 0) -> SSEReply:
    """``POST`` a JSON body to ``path`` and read its SSE stream; ``stop_after`` > 0 closes the connection
    once that many events came, unless the last is ``[DONE]``. Never raises for the server's failure.

    A kept-alive connection that the server closed while it was idle (llama-server does) fails the
    next request before any response: that request is sent once more, on a new connection."""
    reply = await _post_sse_once(client, path, content, stop_after)
    if reply.stale:
        reply = await _post_sse_once(client, path, content, stop_after)
    return reply


async def _post_sse_once(client: httpx.AsyncClient, path: str, content: bytes, stop_after: int) -> SSEReply:
    reply = SSEReply()
    try:
        async with client.stream("POST", path, content=content) as response:
            reply.status = response.status_code
            if response.status_code != 200:
                reply.body = await response.aread()
                return reply
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    reply.events.append((time.perf_counter(), line[5:].strip()))
                    if stop_after and len(reply.events) >= stop_after and reply.events[-1][1] != "[DONE]":
                        reply.cut_off = True  # leaving the block closes the connection
                        break
    except (httpx.HTTPError, OSError) as err:
        reply.error = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        reply.stale = isinstance(err, httpx.RemoteProtocolError) and reply.status is None
    return reply


async def stream_request(
    client: httpx.AsyncClient,
    request: BenchRequest,
    *,
    endpoint: str,
    model: str,
    sampling: Mapping[str, Any],
    start_s: float = 0.0,
) -> RequestResult:
    """Send one streamed request through ``client`` (:func:`http_client`) and time it; never raises
    for a failure of the server (the result says why it failed)."""
    body = json.dumps(_payload(request, endpoint, model, sampling)).encode()
    token_times: list[float] = []
    last_choice: float | None = None
    finish: float | None = None
    finish_reason: str | None = None
    pieces: list[str] = []
    usage: Mapping[str, Any] | None = None
    timings: Mapping[str, Any] | None = None
    sent = time.perf_counter()
    reply = await post_sse(client, ENDPOINTS[endpoint], body)
    error = reply.error
    if error is None and reply.status != 200:
        text = reply.body.decode("utf-8", "replace")
        error = f"HTTP {reply.status}: {' '.join(text.split())[:200]}"
    done = False
    for now, data in reply.events if error is None else ():
        if data == "[DONE]":
            done = True
            break
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            error = f"an event that is not JSON: {data[:80]!r}"
            break
        if not isinstance(event, dict):
            continue
        if event.get("error"):
            error = f"error event: {json.dumps(event['error'])[:200]}"
            break
        choices = event.get("choices")
        if choices and isinstance(choices[0], Mapping):
            last_choice = now
            piece = _choice_text(choices[0], endpoint)
            if piece:
                token_times.append(now)
                pieces.append(piece)
            if finish is None and choices[0].get("finish_reason"):
                finish, finish_reason = now, str(choices[0]["finish_reason"])
        if isinstance(event.get("usage"), Mapping):
            usage = event["usage"]
        if isinstance(event.get("timings"), Mapping):
            timings = event["timings"]  # llama-server's; its last event carries the request's totals
    if error is None and not done:
        error = "the stream ended without data: [DONE]"
    return result_from_trace(
        request.index,
        sent_s=sent,
        token_times_s=token_times,
        last_choice_s=last_choice,
        usage=usage,
        error=error,
        start_s=start_s,
        finish_s=finish,
        timings=timings,
        text="".join(pieces),
        finish_reason=finish_reason,
    )


def http_client(base_url: str, timeout_s: float, api_key: str | None = None) -> httpx.AsyncClient:
    """An asyncio client for ``base_url`` that sends JSON (and the API key), with no connection limit."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return httpx.AsyncClient(
        base_url=base_url,
        headers=headers,
        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


async def closed_loop(items: Sequence[Any], concurrency: int, send: Callable[[Any], Awaitable[Any]]) -> list:
    """``await send(item)`` for every item through ``concurrency`` workers, each taking the next item
    when its last one has ended; the results in the order of ``items``."""
    results: list[Any] = [None] * len(items)
    todo = iter(enumerate(items))

    async def worker() -> None:
        for i, item in todo:
            results[i] = await send(item)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def _closed(base_url: str, requests: Sequence[BenchRequest], concurrency: int, **kw: Any) -> LevelRun:
    timeout_s, api_key = kw.pop("timeout_s"), kw.pop("api_key")
    async with http_client(base_url, timeout_s, api_key) as client:
        start = time.perf_counter()
        send = lambda request: stream_request(client, request, start_s=start, **kw)
        results = await closed_loop(requests, concurrency, send)
        duration = time.perf_counter() - start
    return LevelRun(sorted(results, key=lambda r: r.index), duration)


async def _open(
    base_url: str, requests: Sequence[BenchRequest], times: Sequence[float], **kw: Any
) -> LevelRun:
    timeout_s, api_key = kw.pop("timeout_s"), kw.pop("api_key")
    async with http_client(base_url, timeout_s, api_key) as client:
        start = time.perf_counter()

        async def one(request: BenchRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await stream_request(client, request, start_s=start, **kw)

        results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, times, strict=True)))
        duration = time.perf_counter() - start
    return LevelRun(list(results), duration)


def run_closed_loop(
    base_url: str,
    requests: Sequence[BenchRequest],
    *,
    concurrency: int,
    endpoint: str,
    model: str,
    sampling: Mapping[str, Any],
    timeout_s: float = 600.0,
    api_key: str | None = None,
) -> LevelRun:
    """Every request of ``requests`` through ``concurrency`` workers (module doc)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    kw = {"endpoint": endpoint, "model": model, "sampling": sampling, "timeout_s": timeout_s}
    return asyncio.run(_closed(base_url, requests, concurrency, api_key=api_key, **kw))


def run_open_loop(
    base_url: str,
    requests: Sequence[BenchRequest],
    *,
    request_rate: float,
    burstiness: float = 1.0,
    seed: int = 0,
    endpoint: str,
    model: str,
    sampling: Mapping[str, Any],
    timeout_s: float = 600.0,
    api_key: str | None = None,
) -> LevelRun:
    """Every request of ``requests`` at the arrival times of :func:`arrival_times` (module doc)."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    times = arrival_times(len(requests), request_rate, burstiness, seed)
    kw = {"endpoint": endpoint, "model": model, "sampling": sampling, "timeout_s": timeout_s}
    return asyncio.run(_open(base_url, requests, times, api_key=api_key, **kw))
