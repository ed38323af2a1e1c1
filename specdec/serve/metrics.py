"""The server's Prometheus metrics, under vLLM's names where vLLM has one (its dashboards read them).

Counters (exposed with the ``_total`` suffix): ``vllm:spec_decode_num_drafts`` (verify steps of a
request in which it drafted at least one token), ``vllm:spec_decode_num_draft_tokens``,
``vllm:spec_decode_num_accepted_tokens``, ``vllm:spec_decode_num_accepted_tokens_per_pos`` (label
``position``, 0-based), ``vllm:prompt_tokens``, ``vllm:generation_tokens``,
``vllm:request_success`` (label ``finished_reason``: stop, length, abort). Histograms:
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:e2e_request_latency_seconds``. Gauges: ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``specdec:cache_slots_in_use``, ``specdec:cache_slots``. Every
series has the label ``model_name``.

``vllm:prompt_tokens`` counts the prompt of every request the engine reported on, however it ended
(finished, or aborted while waiting, during its prefill or later), once, at its first output.

The engine thread records (:meth:`ServerMetrics.observe`, :meth:`ServerMetrics.set_load`); the
HTTP side renders. Times are on the engine's clock (``time.perf_counter``), from the moment the
HTTP handler received the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.engine import RequestOutput

__all__ = ["ServerMetrics", "RequestTrack"]

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on


@dataclass
class RequestTrack:
    """What the metrics have seen of one request so far (engine thread only)."""

    arrival_s: float
    prompt_tokens: int
    counted: bool = False  # its prompt tokens are in vllm:prompt_tokens
    last_token_s: float | None = None
    drafted: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class ServerMetrics:
    """A registry of its own (several servers may live in one process) with the series above."""

    def __init__(self, model_name: str, num_slots: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.model_name = model_name
        self.num_drafts = Counter("vllm:spec_decode_num_drafts", "Draft steps", m, registry=r)
        self.num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens", m, registry=r)
        self.num_accepted = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Accepted draft tokens", m, registry=r
        )
        self.accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens at each draft position (0-based)",
            [*m, "position"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of the requests admitted, however they ended", m, registry=r
        )
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", m, registry=r)
        self.request_success = Counter(
            "vllm:request_success", "Finished requests", [*m, "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Request arrival to first token",
            m,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between a request's consecutive engine steps that gave it tokens",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Request arrival to its last token (aborted ones excluded)",
            m,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.running = Gauge("vllm:num_requests_running", "Requests holding a cache slot", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued for a cache slot", m, registry=r)
        self.slots_in_use = Gauge("specdec:cache_slots_in_use", "Cache slots (rows) in use", m, registry=r)
        Gauge("specdec:cache_slots", "Cache slots (rows) of the engine", m, registry=r).labels(
            model_name
        ).set(num_slots)
        for metric in (
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted,
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.running,
            self.waiting,
            self.slots_in_use,
        ):
            metric.labels(model_name)  # every series shows from the start, at 0

    def observe(self, track: RequestTrack, out: RequestOutput) -> None:
        """Record one step's output of a request (engine thread)."""
        name, m = self.model_name, out.metrics
        if not track.counted:  # its first output: a token, or an abort before any
            track.counted = True
            self.prompt_tokens.labels(name).inc(track.prompt_tokens)
        if out.new_token_ids:
            now = m.token_times_s[-1]
            if track.last_token_s is None:
                self.ttft.labels(name).observe(max(0.0, now - track.arrival_s))
            else:
                self.itl.labels(name).observe(now - track.last_token_s)
            track.last_token_s = now
            self.generation_tokens.labels(name).inc(len(out.new_token_ids))
        drafted = m.num_drafted - track.drafted
        if drafted > 0:
            self.num_drafts.labels(name).inc()
            self.num_draft_tokens.labels(name).inc(drafted)
        self.num_accepted.labels(name).inc(m.num_accepted - track.accepted)
        for k, count in enumerate(m.accepted_per_pos):
            before = track.accepted_per_pos[k] if k < len(track.accepted_per_pos) else 0
            if count > before:
                self.accepted_per_pos.labels(name, str(k)).inc(count - before)
        track.drafted, track.accepted = m.num_drafted, m.num_accepted
        track.accepted_per_pos = list(m.accepted_per_pos)
        if out.finished:
            reason = {"eos": "stop", "stop_string": "stop", "grammar": "stop"}.get(
                out.finish_reason or "", out.finish_reason
            )
            self.request_success.labels(name, reason or "abort").inc()
            if out.finish_reason != "abort" and m.finished_s is not None:
                self.e2e.labels(name).observe(max(0.0, m.finished_s - track.arrival_s))

    def set_load(self, running: int, waiting: int, slots_in_use: int) -> None:
        """The engine's load now (engine thread, after every step)."""
        self.running.labels(self.model_name).set(running)
        self.waiting.labels(self.model_name).set(waiting)
        self.slots_in_use.labels(self.model_name).set(slots_in_use)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
