"""A soak of ``specdec serve``: many requests at a fixed concurrency, some clients leaving mid-stream,
some requests malformed; then checks that the server survived, answered, freed every cache slot, kept
its memory flat and shuts down cleanly (docs/serving.md#soak lists the checks).

    python tests/soak.py --num-requests 1000 --concurrency 16 --out /tmp/soak.json
    python tests/soak.py --base-url http://127.0.0.1:8000      # a server that runs already

Without ``--base-url`` it starts ``specdec serve`` with ``specdec bench-serve``'s launcher
(:mod:`specdec.bench.serve_peers`) and drives it with its client (:mod:`specdec.bench.serve_load`).
:func:`plan_requests` makes the seeded plan; ``judge_*`` return None when an answer is as expected, else
what is wrong with it; :func:`run_soak` sends the plan, samples the server's RSS and runs the checks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx

from specdec.bench import serve_load as load
from specdec.bench import serve_peers as peers
from specdec.bench import serve_probe as probe
from specdec.cli_args import ArgumentParser, finite_float, positive_int, seed_int, stderr_line

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


def _check_fractions(**values: float) -> None:
    for name, value in values.items():
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value!r}")


def _rate(text: str) -> float:
    value = finite_float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return value


def _setting(default: Any, kind: Any, help: str) -> Any:
    """A setting and its flag, ``--NAME`` without the ``_s`` of seconds, read by ``kind``."""
    return field(default=default, metadata={"type": kind, "help": help})


@dataclass(frozen=True, kw_only=True)
class SoakConfig:
    """The soak's settings (see ``python tests/soak.py --help``)."""

    num_requests: int = _setting(1000, positive_int, "requests to send")
    concurrency: int = _setting(16, positive_int, "requests in flight at once")
    max_tokens: int = _setting(16, positive_int, "per request: max_tokens//2..this")
    disconnect_rate: float = _setting(0.1, _rate, "of streamed ones: cut off")
    malformed_rate: float = _setting(0.05, _rate, "of all requests: malformed")
    stream_fraction: float = _setting(0.5, _rate, "of all requests: streamed")
    chat_fraction: float = _setting(0.5, _rate, "of all requests: chat completions")
    seed: int = _setting(0, seed_int, "seed of the plan")
    base_url: str | None = _setting(None, str, "soak a running server (no RSS, shutdown or log checks)")
    target: str = _setting("smollm2-135m", str, "the server's --target")
    drafter: str = _setting("default", str, "the server's --drafter")
    max_num_seqs: int = _setting(8, positive_int, "the server's cache slots")
    server_args: tuple[str, ...] = _setting((), shlex.split, "more `specdec serve` flags, one string")
    server_log: str | None = _setting(None, str, "the server's output, kept (None: a temp file)")
    shutdown_timeout_s: float = _setting(10.0, finite_float, "the server's --shutdown-timeout, s")
    start_timeout_s: float = _setting(900.0, finite_float, "s for the server to start")
    request_timeout_s: float = _setting(300.0, finite_float, "s per request")
    idle_timeout_s: float = _setting(10.0, finite_float, "s for the slots to free")
    api_key: str | None = _setting(None, str, "the server's --api-key")
    rss_interval_s: float = _setting(0.5, finite_float, "s between RSS samples")
    warmup_fraction: float = _setting(0.1, _rate, "requests before RSS counts")
    rss_tolerance_frac: float = _setting(0.10, finite_float, "RSS growth allowed, of the first RSS")
    rss_tolerance_mb: float = _setting(50.0, finite_float, "RSS growth allowed, MB")
    progress_s: float = _setting(5.0, finite_float, "s between progress lines")

    def __post_init__(self) -> None:
        names = ("disconnect_rate", "malformed_rate", "stream_fraction", "chat_fraction", "warmup_fraction")
        _check_fractions(**{name: getattr(self, name) for name in names})
        for name in ("num_requests", "concurrency", "max_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")


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
    kinds of :data:`MALFORMED` in turn), and round(disconnect_rate x streamed well-formed ones) cut off
    by the client after 1..max(1, max_tokens // 4) SSE events (a speculative step sends several tokens
    in one event); the well-formed ones ask for max_tokens // 2..max_tokens tokens."""
    _check_fractions(
        malformed_rate=malformed_rate,
        disconnect_rate=disconnect_rate,
        stream_fraction=stream_fraction,
        chat_fraction=chat_fraction,
    )
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


def judge_idle(samples: Mapping[str, float]) -> tuple[bool, dict[str, float | None]]:
    """Whether every gauge of :data:`IDLE_GAUGES` reads 0 among parsed ``/metrics`` samples
    (:func:`specdec.bench.serve_probe.parse_prometheus_text`; a missing one is None and fails)."""
    values = {gauge: samples.get(gauge) for gauge in IDLE_GAUGES}
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


# --- driving the load --------------------------------------------------------------------------------
async def _send(client: Any, p: Planned) -> Outcome:
    t0 = time.perf_counter()
    out = Outcome(p.index, p.kind, None, None)
    if p.stream:
        reply = await load.post_sse(client, p.path, p.body, stop_after=p.disconnect_after)
        out.status, out.events, out.cut_off = reply.status, len(reply.events), reply.cut_off
        if reply.error is not None:
            out.problem = f"transport: {reply.error}"
        elif reply.status != 200:
            out.problem = f"status {reply.status}: {reply.body[:200]!r}"
        elif not reply.cut_off:
            events = [data for _, data in reply.events]
            out.problem = judge_stream(200, events, chat=p.chat, max_tokens=p.max_tokens)
    else:
        try:
            r = await client.post(p.path, content=p.body)
        except httpx.HTTPError as err:
            out.problem = f"transport: {type(err).__name__}: {err}"
        else:
            out.status = r.status_code
            if p.kind == "malformed":
                out.problem = judge_error(p, r.status_code, r.content)
            else:
                out.problem = judge_whole(r.status_code, r.content, chat=p.chat, max_tokens=p.max_tokens)
    out.seconds = time.perf_counter() - t0
    return out


async def _drive(config: SoakConfig, url: str, plan: list[Planned], pid: int | None) -> dict[str, Any]:
    """Send ``plan`` at ``config.concurrency``; sample the server's RSS; print progress."""
    finished: list[Outcome] = []
    samples: list[tuple[float, int, int]] = []
    t0 = time.perf_counter()

    async def sample_rss() -> None:
        import psutil

        try:
            proc = psutil.Process(pid) if pid is not None else None
            while proc is not None:
                rss = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
                samples.append((time.perf_counter() - t0, len(finished), rss))
                await asyncio.sleep(config.rss_interval_s)
        except psutil.Error:  # the process is gone: server_alive reports it
            return

    async def progress() -> None:
        while True:
            await asyncio.sleep(config.progress_s)
            bad = sum(1 for o in finished if o.problem)
            rss = f", server RSS {samples[-1][2] / MB:.0f} MB" if samples else ""
            done = f"{len(finished)}/{len(plan)} done, {bad} with a problem"
            print(f"soak: {done}, {time.perf_counter() - t0:.0f} s{rss}", flush=True)

    async with load.http_client(url, config.request_timeout_s, config.api_key) as client:

        async def send(p: Planned) -> Outcome:
            finished.append(await _send(client, p))
            return finished[-1]

        side = [asyncio.create_task(sample_rss()), asyncio.create_task(progress())]
        outcomes = await load.closed_loop(plan, config.concurrency, send)
        for task in side:
            task.cancel()
    return {"outcomes": outcomes, "rss": samples, "seconds": time.perf_counter() - t0}


# --- the server ----------------------------------------------------------------------------------------
def _start_server(config: SoakConfig, log: Path) -> peers.LaunchedServer:
    """``python -m specdec serve`` on a free loopback port, once ``/health`` answers 200."""
    port = peers.free_port()
    command = peers.ours_command(
        config.drafter, target=config.target, threads=None, max_num_seqs=config.max_num_seqs, port=port
    )
    command += ["--shutdown-timeout", str(config.shutdown_timeout_s)]
    command += ["--api-key", config.api_key] if config.api_key else []
    command += list(config.server_args)
    print("soak: starting", " ".join(command[1:]), flush=True)
    return peers.launch("specdec serve", command, log, port=port, startup_timeout_s=config.start_timeout_s)


def _wait_idle(url: str, timeout_s: float) -> tuple[bool, dict[str, Any]]:
    t0 = time.monotonic()
    while True:
        samples = probe.get_metrics(url)
        idle, values = judge_idle(samples) if samples is not None else (False, {"error": "no /metrics"})
        if idle or time.monotonic() - t0 > timeout_s:
            return idle, {**values, "seconds": round(time.monotonic() - t0, 2)}
        time.sleep(0.1)


def _shutdown(server: peers.LaunchedServer, timeout_s: float) -> dict[str, Any]:
    """SIGTERM; the exit status and the children that outlived it."""
    import psutil

    try:
        children = psutil.Process(server.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    t0 = time.monotonic()
    rc = server.stop(timeout_s)
    left = [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    for pid in left:  # ours to clean up: started by the server we started
        psutil.Process(pid).kill()
    return dict(returncode=rc, seconds=round(time.monotonic() - t0, 2), children=len(children), left=left)


def _counters(samples: Mapping[str, float] | None) -> dict[str, float]:
    """The ``…_total`` counters (finished requests by reason apart), without the per-position ones."""
    name = lambda key: key.partition("{")[0]
    return {
        k: v
        for k, v in (samples or {}).items()
        if name(k).endswith("_total") and not name(k).endswith("_per_pos_total")
    }


# --- the whole soak --------------------------------------------------------------------------------------
def _check(passed: bool | None, detail: Any) -> dict[str, Any]:
    return {"result": "skip" if passed is None else ("pass" if passed else "fail"), "detail": detail}


def _problems(outcomes: Sequence[Outcome], limit: int = 10) -> list[str]:
    return [f"#{o.index} ({o.kind}): {o.problem}" for o in outcomes if o.problem][:limit]


def run_soak(config: SoakConfig) -> dict[str, Any]:
    """Run the soak; the result (``checks``: name -> {result, detail}) as a JSON-ready dict."""
    log = Path(config.server_log or tempfile.mkstemp(prefix="specdec-soak-", suffix=".log")[1])
    server = None if config.base_url else _start_server(config, log)
    url = server.base_url if server else config.base_url.rstrip("/")
    proc = server.proc if server else None
    try:
        if not probe.wait_healthy(url, config.start_timeout_s):
            raise RuntimeError(f"{url}/health did not answer 200 within {config.start_timeout_s} s")
        card = probe.model_card(url, api_key=config.api_key)
        if card is None:
            raise RuntimeError(f"{url}/v1/models names no model")
        model, max_model_len = card["id"], int(card.get("max_model_len") or 1_000_000)
        shape = (
            "max_tokens",
            "malformed_rate",
            "disconnect_rate",
            "stream_fraction",
            "chat_fraction",
            "seed",
        )
        settings = {name: getattr(config, name) for name in shape}
        plan = plan_requests(config.num_requests, model=model, max_model_len=max_model_len, **settings)
        print(f"soak: {url}, {len(plan)} requests at concurrency {config.concurrency}", flush=True)
        before = _counters(probe.get_metrics(url, keep_label="finished_reason"))
        run = asyncio.run(_drive(config, url, plan, None if proc is None else proc.pid))
        outcomes: list[Outcome] = run["outcomes"]
        checks: dict[str, dict[str, Any]] = {}
        try:
            health: Any = httpx.get(url + "/health", timeout=10.0).status_code
        except httpx.HTTPError as err:
            health = f"{type(err).__name__}: {err}"
        alive = (proc is None or proc.poll() is None) and health == 200
        checks["server_alive"] = _check(alive, {"health": health, "returncode": proc and proc.poll()})
        good = [o for o in outcomes if o.kind != "malformed"]
        wrong = [o for o in good if o.problem or (o.cut_off and o.status != 200)]
        checks["well_formed_answered"] = _check(
            not wrong,
            {"expected": len(good), "answered": len(good) - len(wrong), "problems": _problems(wrong)},
        )
        bad = [o for o in outcomes if o.kind == "malformed"]
        wrong_bad = [o for o in bad if o.problem]
        checks["malformed_rejected"] = _check(
            not wrong_bad, {"malformed": len(bad), "problems": _problems(wrong_bad)}
        )
        fatal = [o for o in outcomes if (o.status or 0) >= 500 or o.status is None]
        checks["no_5xx"] = _check(not fatal, {"count": len(fatal), "problems": _problems(fatal)})
        idle, gauges = _wait_idle(url, config.idle_timeout_s) if alive else (False, {"why": "server down"})
        checks["slots_freed"] = _check(idle, gauges)
        warmup = max(1, round(config.warmup_fraction * len(plan)))
        flat, rss = judge_rss(run["rss"], warmup, config.rss_tolerance_frac, config.rss_tolerance_mb)
        checks["memory_flat"] = _check(flat if proc else None, rss if proc else "no server process")
        after = _counters(probe.get_metrics(url, keep_label="finished_reason")) if alive else before
        counters = {k: after[k] - before.get(k, 0.0) for k in sorted(after)}
        finished = sum(v for k, v in counters.items() if k.startswith("vllm:request_success_total"))
        accepted = sum(1 for o in good if o.status == 200)
        checks["every_request_finished"] = _check(
            finished == accepted if proc is not None and alive else None,
            {"accepted_200": accepted, "server_finished": finished},
        )
    except BaseException:
        if proc is not None and proc.poll() is None:
            proc.kill()
        raise
    if server is not None:
        stop = _shutdown(server, config.shutdown_timeout_s + 15.0)
        checks["clean_shutdown"] = _check(stop["returncode"] == 0, stop)
        checks["no_child_left"] = _check(
            not stop["left"], {"children": stop["children"], "left": stop["left"]}
        )
        text = log.read_text(errors="replace")
        checks["log_clean"] = _check("Traceback" not in text, {"log": str(log), "lines": text.count("\n")})
    cut = [o for o in outcomes if o.cut_off]
    counts = Counter(o.kind for o in outcomes)
    return {
        "config": asdict(config),
        "url": url,
        "model": model,
        "seconds": round(run["seconds"], 1),
        "requests_per_s": round(len(plan) / run["seconds"], 2),
        "counts": {**counts, "cut_off": len(cut), "disconnect_after_end": counts["disconnect"] - len(cut)},
        "malformed_kinds": Counter(p.malformed for p in plan if p.malformed),
        "server_counters": counters,
        "checks": checks,
        "passed": all(c["result"] != "fail" for c in checks.values()),
        "server_log": None if proc is None else str(log),
        "rss_mb": [  # (seconds, requests done, MB), at most ~200 of the samples
            (round(t, 1), done, round(rss / MB, 1))
            for t, done, rss in run["rss"][:: len(run["rss"]) // 200 + 1]
        ],
    }


def print_summary(result: dict[str, Any]) -> None:
    """The checks as a table, and the counts."""
    head = f"soak of {result['url']} ({result['model']})"
    print(f"\n{head}: {result['seconds']} s, {result['requests_per_s']} requests/s")
    print("counts:", json.dumps(result["counts"]), " malformed:", json.dumps(result["malformed_kinds"]))
    print(f"\n{'check':<22} {'result':<6} detail")
    for name, check in result["checks"].items():
        print(f"{name:<22} {check['result']:<6} {json.dumps(check['detail'], default=str)[:300]}")
    print(f"\n{'PASS' if result['passed'] else 'FAIL'}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python tests/soak.py``: 0 if every check passed (or skipped), 1 if one failed, 2 if the soak
    could not run (bad arguments, a server that did not start)."""
    p = ArgumentParser(
        prog="python tests/soak.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for setting in fields(SoakConfig):
        flag = setting.name.removesuffix("_s")
        p.add_argument("--" + flag.replace("_", "-"), dest=setting.name, metavar=flag.upper(),
                       default=setting.default, **setting.metadata)  # fmt: skip
    p.add_argument("--out", default=None, help="write the result as JSON here")
    a = vars(p.parse_args(argv))
    out = a.pop("out")
    try:
        result = run_soak(SoakConfig(**a | {"server_args": tuple(a["server_args"])}))
    except (ValueError, RuntimeError) as err:  # the server did not start, or a setting is wrong
        stderr_line(p.prog, err)
        return 2
    print_summary(result)
    if out:
        Path(out).write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"soak: wrote {out}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
