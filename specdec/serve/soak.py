"""A soak of ``specdec serve``: many requests at a fixed concurrency, some clients leaving mid-stream,
some requests malformed; then checks that the server survived, answered, freed every cache slot, kept
its memory flat and shuts down cleanly.

    python -m specdec.serve.soak --num-requests 1000 --concurrency 16 --out /tmp/soak.json
    python -m specdec.serve.soak --base-url http://127.0.0.1:8000      # a server that runs already

Without ``--base-url`` it starts ``python -m specdec serve`` on a free loopback port (stderr to
``--server-log``) and waits for ``/health``. The plan (:mod:`specdec.serve.soak_checks`) is seeded:
completions and chat, streamed and not, greedy and sampled; exactly round(``--malformed-rate`` x N)
requests are malformed (``MALFORMED``: bad JSON, a body that is not an object, temperature -1,
max_tokens "x", an unknown model, prompt + max_tokens over the context) and round(``--disconnect-rate``
x streamed well-formed ones) close their connection after a random number of SSE events. The checks
(each pass, fail or skip; exit status 1 if one fails):

- ``server_alive``: the process runs and ``/health`` is 200 after the load;
- ``well_formed_answered``: every well-formed request that was not cut off got a complete answer (200,
  a ``finish_reason``, usage consistent with ``max_tokens``; a stream ends with ``data: [DONE]`` and
  holds no error event); a cut-off one had started (200);
- ``malformed_rejected``: every malformed one got its 4xx with OpenAI's error JSON naming the problem;
- ``no_5xx``: no response had a 5xx status and no request failed at the transport;
- ``slots_freed``: ``/metrics`` shows running, waiting and cache slots in use all 0 within
  ``--idle-timeout`` seconds (``judge_idle``);
- ``every_request_finished``: the server counted (``vllm:request_success_total``, any reason) as many
  finished requests as it accepted with 200 (a soak of our own server only);
- ``memory_flat``: the server's RSS, sampled through the run, after the warm-up: the last quarter's
  median exceeds the first quarter's by at most ``min(--rss-tolerance-frac x first, --rss-tolerance-mb)``
  (``judge_rss``);
- ``clean_shutdown``: SIGTERM ends it with status 0 within ``--shutdown-timeout`` + 15 s; ``no_child_left``:
  none of its child processes outlives it; ``log_clean``: no traceback in its log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specdec.cli_args import ArgumentParser, finite_float, positive_int, seed_int, stderr_line
from specdec.serve.soak_checks import (
    MB,
    Outcome,
    Planned,
    judge_error,
    judge_idle,
    judge_rss,
    judge_stream,
    judge_whole,
    plan_requests,
)

__all__ = ["SoakConfig", "run_soak", "print_summary", "main"]


@dataclass(frozen=True, kw_only=True)
class SoakConfig:
    """The soak's settings (see ``python -m specdec.serve.soak --help``)."""

    num_requests: int = 1000
    concurrency: int = 16
    max_tokens: int = 16
    disconnect_rate: float = 0.1
    malformed_rate: float = 0.05
    stream_fraction: float = 0.5
    chat_fraction: float = 0.5
    seed: int = 0
    base_url: str | None = None
    target: str = "smollm2-135m"
    drafter: str = "default"
    max_num_seqs: int = 8
    server_args: tuple[str, ...] = ()
    server_log: str | None = None
    shutdown_timeout_s: float = 10.0
    start_timeout_s: float = 900.0
    request_timeout_s: float = 300.0
    idle_timeout_s: float = 10.0
    api_key: str | None = None
    rss_interval_s: float = 0.5
    warmup_fraction: float = 0.1
    rss_tolerance_frac: float = 0.10
    rss_tolerance_mb: float = 50.0
    progress_s: float = 5.0

    def __post_init__(self) -> None:
        for name in (
            "disconnect_rate",
            "malformed_rate",
            "stream_fraction",
            "chat_fraction",
            "warmup_fraction",
        ):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        for name in ("num_requests", "concurrency", "max_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")


# --- driving the load --------------------------------------------------------------------------------
async def _send(client: Any, p: Planned, headers: dict[str, str]) -> Outcome:
    import httpx

    t0 = time.perf_counter()
    out = Outcome(p.index, p.kind, None, None)
    try:
        if not p.stream:
            r = await client.post(p.path, content=p.body, headers=headers)
            out.status = r.status_code
            if p.kind == "malformed":
                out.problem = judge_error(p, r.status_code, r.content)
            else:
                out.problem = judge_whole(r.status_code, r.content, chat=p.chat, max_tokens=p.max_tokens)
        else:
            async with client.stream("POST", p.path, content=p.body, headers=headers) as r:
                out.status = r.status_code
                if r.status_code != 200:
                    out.problem = f"status {r.status_code}: {(await r.aread())[:200]!r}"
                else:
                    events: list[str] = []
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            events.append(line[5:].strip())
                            if (
                                p.disconnect_after
                                and len(events) >= p.disconnect_after
                                and events[-1] != "[DONE]"
                            ):
                                out.cut_off = True  # leaving the block closes the connection
                                break
                    out.events = len(events)
                    if not out.cut_off:
                        out.problem = judge_stream(200, events, chat=p.chat, max_tokens=p.max_tokens)
    except httpx.HTTPError as err:
        out.problem = f"transport: {type(err).__name__}: {err}"
    out.seconds = time.perf_counter() - t0
    return out


async def _drive(config: SoakConfig, url: str, plan: list[Planned], pid: int | None) -> dict[str, Any]:
    """Send ``plan`` at ``config.concurrency``; sample the server's RSS; print progress."""
    import httpx

    outcomes: list[Outcome | None] = [None] * len(plan)
    headers = {"Content-Type": "application/json"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    todo = iter(plan)
    done = 0
    samples: list[tuple[float, int, int]] = []
    t0 = time.perf_counter()

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        for p in todo:
            outcomes[p.index] = await _send(client, p, headers)
            done += 1

    async def sample_rss() -> None:
        proc = _process(pid)
        while proc is not None:
            try:
                rss = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
            except Exception:  # the process is gone: server_alive reports it
                return
            samples.append((time.perf_counter() - t0, done, rss))
            await asyncio.sleep(config.rss_interval_s)

    async def progress() -> None:
        while True:
            await asyncio.sleep(config.progress_s)
            bad = sum(1 for o in outcomes if o is not None and o.problem)
            rss = f", server RSS {samples[-1][2] / MB:.0f} MB" if samples else ""
            elapsed = time.perf_counter() - t0
            print(f"soak: {done}/{len(plan)} done, {bad} with a problem, {elapsed:.0f} s{rss}", flush=True)

    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        side = [asyncio.create_task(sample_rss()), asyncio.create_task(progress())]
        await asyncio.gather(*(worker(client) for _ in range(config.concurrency)))
        for task in side:
            task.cancel()
    return {"outcomes": outcomes, "rss": samples, "seconds": time.perf_counter() - t0}


def _process(pid: int | None) -> Any:
    if pid is None:
        return None
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


# --- the server ----------------------------------------------------------------------------------------
def _start_server(config: SoakConfig, log: Path) -> tuple[subprocess.Popen, str]:
    """``python -m specdec serve`` on a free loopback port; returns it and its URL once it listens."""
    args = [sys.executable, "-m", "specdec", "serve", "--target", config.target, "--drafter", config.drafter]
    args += ["--host", "127.0.0.1", "--port", "0", "--max-num-seqs", str(config.max_num_seqs)]
    args += ["--shutdown-timeout", str(config.shutdown_timeout_s), "--log-level", "warning"]
    if config.api_key:
        args += ["--api-key", config.api_key]
    args += list(config.server_args)
    print("soak: starting", " ".join(args[1:]), flush=True)
    with open(log, "wb") as err:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    deadline = time.monotonic() + config.start_timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("specdec serve: ") and " on http://" in line:
                return proc, line.split(" on ", 1)[1].split(" ", 1)[0]
        if proc.poll() is not None:
            lines = log.read_text(errors="replace").strip().splitlines() or ["(no output)"]
            raise RuntimeError(
                f"the server exited with {proc.returncode} before listening: {lines[-1]} (see {log})"
            )
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not listen within {config.start_timeout_s} s; see {log}")


def _get(url: str, path: str, timeout_s: float = 10.0) -> Any:
    import httpx

    return httpx.get(url + path, timeout=timeout_s)


def _wait_health(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if _get(url, "/health").status_code == 200:
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health did not answer 200 within {timeout_s} s")
        time.sleep(0.2)


def _model_card(url: str, api_key: str | None) -> tuple[str, int]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    import httpx

    card = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"][0]
    return card["id"], int(card.get("max_model_len") or 1_000_000)


def _wait_idle(url: str, timeout_s: float) -> tuple[bool, dict[str, Any]]:
    t0 = time.monotonic()
    while True:
        try:
            idle, values = judge_idle(_get(url, "/metrics").text)
        except Exception as err:
            idle, values = False, {"error": f"{type(err).__name__}: {err}"}
        if idle or time.monotonic() - t0 > timeout_s:
            return idle, {**values, "seconds": round(time.monotonic() - t0, 2)}
        time.sleep(0.1)


def _shutdown(proc: subprocess.Popen, timeout_s: float) -> dict[str, Any]:
    """SIGTERM; the exit status and the children that outlived it."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc: int | None = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
        proc.kill()
        proc.wait(10)
    left = [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    for pid in left:  # ours to clean up: started by the server we started
        psutil.Process(pid).kill()
    return {
        "returncode": rc,
        "seconds": round(time.monotonic() - t0, 2),
        "children": len(children),
        "left": left,
    }


# --- the whole soak --------------------------------------------------------------------------------------
def _check(passed: bool | None, detail: Any) -> dict[str, Any]:
    return {"result": "skip" if passed is None else ("pass" if passed else "fail"), "detail": detail}


def _problems(outcomes: Sequence[Outcome], limit: int = 10) -> list[str]:
    return [f"#{o.index} ({o.kind}): {o.problem}" for o in outcomes if o.problem][:limit]


def run_soak(config: SoakConfig) -> dict[str, Any]:
    """Run the soak; the result (``checks``: name -> {result, detail}) as a JSON-ready dict."""
    log = Path(config.server_log or tempfile.mkstemp(prefix="specdec-soak-", suffix=".log")[1])
    proc: subprocess.Popen | None = None
    if config.base_url:
        url = config.base_url.rstrip("/")
    else:
        proc, url = _start_server(config, log)
    try:
        _wait_health(url, config.start_timeout_s)
        model, max_model_len = _model_card(url, config.api_key)
        plan = plan_requests(
            config.num_requests,
            model=model,
            max_model_len=max_model_len,
            max_tokens=config.max_tokens,
            malformed_rate=config.malformed_rate,
            disconnect_rate=config.disconnect_rate,
            stream_fraction=config.stream_fraction,
            chat_fraction=config.chat_fraction,
            seed=config.seed,
        )
        print(f"soak: {url}, {len(plan)} requests at concurrency {config.concurrency}", flush=True)
        before = _get(url, "/metrics").text
        run = asyncio.run(_drive(config, url, plan, None if proc is None else proc.pid))
        outcomes: list[Outcome] = run["outcomes"]
        checks: dict[str, dict[str, Any]] = {}
        try:
            health = _get(url, "/health").status_code
        except Exception as err:
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
        checks["memory_flat"] = _check(
            flat if proc is not None else None, rss if proc else "no server process"
        )
        after = _get(url, "/metrics").text if alive else before
        counters = _counter_delta(before, after)
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
    if proc is not None:
        stop = _shutdown(proc, config.shutdown_timeout_s + 15.0)
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


def _counter_delta(before: str, after: str) -> dict[str, float]:
    """Requests finished (by reason), tokens and drafts the server counted during the soak."""
    from prometheus_client.parser import text_string_to_metric_families

    def read(text: str) -> dict[str, float]:
        out: Counter[str] = Counter()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_total") and not s.name.endswith("_per_pos_total"):
                    reason = s.labels.get("finished_reason")
                    out[s.name + (f"{{{reason}}}" if reason else "")] += s.value
        return out

    b, a = read(before), read(after)
    return {k: a[k] - b.get(k, 0.0) for k in sorted(a)}


def print_summary(result: dict[str, Any]) -> None:
    """The checks as a table, and the counts."""
    head = f"soak of {result['url']} ({result['model']})"
    print(f"\n{head}: {result['seconds']} s, {result['requests_per_s']} requests/s")
    print("counts:", json.dumps(result["counts"]), " malformed:", json.dumps(result["malformed_kinds"]))
    print(f"\n{'check':<22} {'result':<6} detail")
    for name, check in result["checks"].items():
        print(f"{name:<22} {check['result']:<6} {json.dumps(check['detail'], default=str)[:300]}")
    print(f"\n{'PASS' if result['passed'] else 'FAIL'}", flush=True)


def _rate(text: str) -> float:
    value = finite_float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specdec.serve.soak``: 0 if every check passed (or skipped), 1 if one failed, 2 if the
    soak could not run (bad arguments, a server that did not start)."""
    import shlex

    d = SoakConfig()
    p = ArgumentParser(
        prog="python -m specdec.serve.soak",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = p.add_argument
    add("--num-requests", type=positive_int, default=d.num_requests, help="requests to send")
    add("--concurrency", type=positive_int, default=d.concurrency, help="requests in flight at once")
    add("--max-tokens", type=positive_int, default=d.max_tokens, help="per request: max_tokens//2..this")
    add("--disconnect-rate", type=_rate, default=d.disconnect_rate, help="of streamed ones: cut off")
    add("--malformed-rate", type=_rate, default=d.malformed_rate, help="of all requests: malformed")
    add("--stream-fraction", type=_rate, default=d.stream_fraction, help="of all requests: streamed")
    add("--chat-fraction", type=_rate, default=d.chat_fraction, help="of all requests: chat completions")
    add("--seed", type=seed_int, default=d.seed, help="seed of the plan")
    add("--base-url", default=None, help="soak a running server (no RSS, shutdown or log checks)")
    add("--target", default=d.target, help="the server's --target")
    add("--drafter", default=d.drafter, help="the server's --drafter")
    add("--max-num-seqs", type=positive_int, default=d.max_num_seqs, help="the server's cache slots")
    add("--server-args", default="", help="more `specdec serve` flags, one string (e.g. '--gamma 3')")
    add("--server-log", default=None, help="the server's stderr, kept (None: a temp file)")
    add("--shutdown-timeout", type=finite_float, default=d.shutdown_timeout_s, help="the server's, s")
    add("--start-timeout", type=finite_float, default=d.start_timeout_s, help="s for the server to start")
    add("--request-timeout", type=finite_float, default=d.request_timeout_s, help="s per request")
    add("--idle-timeout", type=finite_float, default=d.idle_timeout_s, help="s for the slots to free")
    add("--api-key", default=None, help="the server's --api-key")
    add("--rss-interval", type=finite_float, default=d.rss_interval_s, help="s between RSS samples")
    add("--warmup-fraction", type=_rate, default=d.warmup_fraction, help="requests before RSS counts")
    add("--rss-tolerance-frac", type=finite_float, default=d.rss_tolerance_frac, help="of the first RSS")
    add("--rss-tolerance-mb", type=finite_float, default=d.rss_tolerance_mb, help="RSS growth allowed")
    add("--progress", type=finite_float, default=d.progress_s, help="s between progress lines")
    add("--out", default=None, help="write the result as JSON here")
    a = p.parse_args(argv)
    config = SoakConfig(
        num_requests=a.num_requests, concurrency=a.concurrency, max_tokens=a.max_tokens,
        disconnect_rate=a.disconnect_rate, malformed_rate=a.malformed_rate, stream_fraction=a.stream_fraction,
        chat_fraction=a.chat_fraction, seed=a.seed, base_url=a.base_url, target=a.target, drafter=a.drafter,
        max_num_seqs=a.max_num_seqs, server_args=tuple(shlex.split(a.server_args)), server_log=a.server_log,
        shutdown_timeout_s=a.shutdown_timeout, start_timeout_s=a.start_timeout,
        request_timeout_s=a.request_timeout, idle_timeout_s=a.idle_timeout, api_key=a.api_key,
        rss_interval_s=a.rss_interval, warmup_fraction=a.warmup_fraction,
        rss_tolerance_frac=a.rss_tolerance_frac, rss_tolerance_mb=a.rss_tolerance_mb, progress_s=a.progress,
    )  # fmt: skip
    try:
        result = run_soak(config)
    except (ValueError, RuntimeError) as err:  # the server did not start, or a setting is wrong
        stderr_line(p.prog, err)
        return 2
    print_summary(result)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"soak: wrote {a.out}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
