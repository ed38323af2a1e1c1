"""``specdec serve`` end to end: load the target, start the engine thread, run uvicorn, shut down cleanly.

Shutdown (SIGTERM or SIGINT): the server answers 503 to every new request at once but keeps its
socket open, lets the running requests finish for up to ``shutdown_timeout_s`` seconds, aborts what is
left (a streamed one gets an error event, a waiting one a 503), waits for the engine thread to end,
then stops uvicorn; :func:`serve` returns 0. A second signal aborts what runs at once. Uvicorn's own
handlers would re-raise the signal after the server stops (the process would die of it): ours do not.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from specdec.serve.app import ServerState, build_app
from specdec.serve.cors import check_cors
from specdec.serve.intake import DEFAULT_MAX_BODY_BYTES, Intake, IntakeLimits
from specdec.serve.metrics import ServerMetrics
from specdec.serve.protocol import ServedModel
from specdec.serve.worker import EngineWorker

__all__ = ["ServeConfig", "serve"]

log = logging.getLogger("specdec.serve")

# The engine thread and the HTTP loop share the GIL; at CPython's default switch interval (5 ms) a
# step's outputs wait up to that long for the loop to run, and the loop's wake-up makes the engine
# wait in turn. At 0.5 ms a 1,000-token greedy request on the tiny test model takes 0.39-0.43 s
# through the server against 0.36-0.39 s in the engine alone (0.87-1.2 s at 5 ms).
_SWITCH_INTERVAL_S = 0.0005
_FLUSH_S = 2.0  # after the engine thread ends, how long handlers get to send their last bytes
_UVICORN_GRACE_S = 3.0  # then uvicorn's own wait for open connections


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Everything ``specdec serve`` takes (see ``specdec serve --help``)."""

    target: str = "smollm2-135m"
    backend: str = "auto"
    weights: str | None = None
    dtype: str | None = None
    compile: str | None = None
    device: str | None = None
    drafter: str = "default"
    drafter_options: dict[str, Any] = field(default_factory=dict)
    gamma: int | str = "auto"
    gamma_options: dict[str, Any] = field(default_factory=dict)
    verify: str = "exact"
    verify_options: dict[str, Any] = field(default_factory=dict)
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    threads: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_waiting: int | None = 256
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    chat_content_special_tokens: bool = False
    shutdown_timeout_s: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        check_api_key(self.api_key, "api_key")
        mb = self.max_body_bytes
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
            raise ValueError(f"max_body_bytes must be an int >= 1, got {mb!r}")
        check_cors(self.allowed_origins, self.allowed_methods, self.allowed_headers)


def check_api_key(key: str | None, name: str) -> None:
    """An API key is None (no authentication) or a non-empty string without surrounding whitespace
    (an empty key would serve everyone while looking set; a key with spaces could never match, as
    the ``Authorization`` header's value is stripped)."""
    if key is None:
        return
    if not isinstance(key, str):
        raise ValueError(f"{name} must be a string, got {type(key).__name__}")
    if not key:
        raise ValueError(f"{name} is empty: give a key, or leave it out to serve without authentication")
    if key != key.strip() or not key.isprintable():
        raise ValueError(f"{name} must not have surrounding whitespace or control characters")
    if not key.isascii():
        raise ValueError(f"{name} must be ASCII (HTTP headers carry it)")


class _Server(uvicorn.Server):
    """uvicorn's server with our signal handling (drain first, then stop; no re-raised signal)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout_s = shutdown_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.num_signals = 0
        self.drain_task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.num_signals += 1
        if self.loop is None or not self.started:  # still starting: stop now
            self.should_exit = True
            return
        self.loop.call_soon_threadsafe(self._begin_drain, self.num_signals > 1)

    async def startup(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started:
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            model = self.state.model
            print(
                f"specdec serve: {model.name} on http://{self.config.host}:{port} "
                f"(drafter {self.state.worker.engine.drafter_name}, {self.state.max_num_seqs} slots, "
                f"max_model_len {model.max_model_len})",
                file=sys.stderr,
                flush=True,
            )

    def _begin_drain(self, now: bool) -> None:
        self.state.draining = True
        self.state.worker.drain(0.0 if now else self.shutdown_timeout_s)
        if self.drain_task is None:
            log.info("draining: new requests get 503; running ones get %.1f s", self.shutdown_timeout_s)
            self.drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self.state.worker.alive:
            await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while self.state.open > 0 and loop.time() - t0 < _FLUSH_S:
            await asyncio.sleep(0.02)
        self.should_exit = True


def serve(config: ServeConfig) -> int:
    """Run the server until a signal ends it; 0 when it ended cleanly (engine thread joined)."""
    import prometheus_client
    import torch

    from specdec.engine import Engine
    from specdec.targets import open_target_from

    options: dict[str, Any] = {}
    if config.max_num_batched_tokens is not None:
        options["max_num_batched_tokens"] = config.max_num_batched_tokens
    if config.max_model_len is not None:
        options["max_model_len"] = config.max_model_len

    def build() -> Engine:
        """The target and the engine, built on the engine thread (EngineWorker's doc says why)."""
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        target = open_target_from(config)
        if getattr(target, "tokenizer", None) is None:
            raise ValueError(
                f"--target {config.target}: the server needs the checkpoint's tokenizer; it has none"
            )
        return Engine(
            target,
            drafter=config.drafter,
            drafter_options=config.drafter_options,
            gamma=config.gamma,
            gamma_options=config.gamma_options,
            verify=config.verify,
            verify_options=config.verify_options,
            max_num_seqs=config.max_num_seqs,
            **options,
        )

    worker = EngineWorker(build)
    worker.start()
    try:
        engine = worker.ready()
    except BaseException:
        worker.drain(0.0)
        worker.join(60.0)
        raise
    name = config.served_model_name or config.target
    prometheus_client.disable_created_metrics()
    metrics = ServerMetrics(name, engine.max_num_seqs)
    model = ServedModel(
        name=name,
        max_model_len=engine.max_model_len,
        reserved=engine.gamma_max + 1,
        vocab_size=engine.vocab_size,
        # the HTTP thread's own copy; the engine thread keeps the target's
        tokenizer=copy.deepcopy(engine.target.tokenizer),
        content_special_tokens=config.chat_content_special_tokens,
    )
    worker.metrics = metrics
    state = ServerState(
        worker=worker,
        model=model,
        metrics=metrics,
        max_num_seqs=engine.max_num_seqs,
        api_key=config.api_key,
        max_waiting=config.max_waiting,
    )
    state.intake = Intake(IntakeLimits.for_model(model, max_body_bytes=config.max_body_bytes), model.name)
    app = build_app(
        state,
        allowed_origins=config.allowed_origins,
        allowed_methods=config.allowed_methods,
        allowed_headers=config.allowed_headers,
    )
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        lifespan="off",
        timeout_graceful_shutdown=_UVICORN_GRACE_S,
    )
    server = _Server(uv_config, state, config.shutdown_timeout_s)
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    try:
        server.run()
    finally:
        state.intake.close()
        state.draining = True
        worker.drain(0.0)
        joined = worker.join(60.0)
    if not joined:
        log.error("the engine thread did not end within 60 s")
        return 1
    return 0
