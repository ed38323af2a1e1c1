"""The engine thread: the one thread that touches the target and the :class:`specdec.Engine`.

The HTTP side (an asyncio loop) talks to it through one thread-safe command queue (submit, abort,
drain) and hears back through a :class:`Sink` per request: an ``asyncio.Queue`` on the HTTP loop,
fed with ``loop.call_soon_threadsafe``. For each submitted request the sink gets first
:data:`ACCEPTED` (or a :class:`Failed` with the 400 to answer), then every ``RequestOutput`` of
``Engine.step()`` that concerns it, the last one ``finished``. Between two steps the thread takes
every queued command, so a request joins the batch at the next step and an abort frees its cache row
before the next step runs.

``drain(timeout_s)`` stops taking requests (new ones fail with 503), lets the running ones finish
for up to ``timeout_s`` seconds, aborts what is left, and ends the thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specdec.engine import Engine, RequestOutput
from specdec.serve.errors import APIError, from_engine_error
from specdec.serve.metrics import RequestTrack, ServerMetrics

__all__ = ["ACCEPTED", "Failed", "Sink", "EngineWorker"]

log = logging.getLogger("specdec.serve")

ACCEPTED = "accepted"
"""The engine took the request (it waits for a cache slot or runs)."""

_IDLE_WAIT_S = 0.5  # how long an idle engine thread sleeps on the command queue between checks


@dataclass(frozen=True)
class Failed:
    """The request is refused or failed: answer with ``error``."""

    error: APIError


class Sink:
    """Where one request's events go: an ``asyncio.Queue`` on the HTTP side's loop, fed from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:
        """Hand ``item`` to the loop's queue (any thread); dropped if the loop has closed."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def get(self) -> Any:
        """The next item (on the loop)."""
        return await self.queue.get()


@dataclass
class _Entry:
    sink: Sink
    track: RequestTrack


class EngineWorker:
    """Runs ``engine`` on a thread of its own (see the module doc).

    Args:
        engine: the engine, or a function that builds it (called on the engine thread, which
            :meth:`ready` waits for: see below); only this worker's thread uses it once :meth:`start`
            is called.
        metrics: where the engine thread records each output and the load (None: nowhere).

    **Build the engine on its thread.** The native kernels run OpenMP teams; a team belongs to the
    thread that starts it, and its workers spin between the many small parallel regions of a
    forward. A target that ran anything on the main thread (loading, the engine's cost-model
    forwards) leaves that thread's team behind, and with more OpenMP threads than cores libgomp
    throttles the spinning, so every region wakes sleeping threads (a token several times slower:
    docs/serving.md). Given a builder, the worker
    loads and measures on the thread that decodes.
    """

    def __init__(self, engine: Engine | Callable[[], Engine], metrics: ServerMetrics | None = None) -> None:
        self._build = None if isinstance(engine, Engine) else engine
        self.engine: Engine = engine if isinstance(engine, Engine) else None  # type: ignore[assignment]
        self._ready = threading.Event()
        self.metrics = metrics
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._entries: dict[str, _Entry] = {}
        self._deadline: float | None = None
        self._thread = threading.Thread(target=self._run, name="specdec-engine")
        self.error: BaseException | None = None  # what ended the thread, if it was not a drain

    # --- HTTP side (any thread) -------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; from now on only it touches the engine."""
        self._thread.start()

    def ready(self, timeout_s: float | None = None) -> Engine:
        """Wait until the engine thread has its engine (built it, with a builder); return it, or raise
        what the builder raised."""
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the engine was not built within {timeout_s} s")
        if self.engine is None:
            raise self.error if self.error is not None else RuntimeError("the engine was not built")
        return self.engine

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs."""
        return self._thread.is_alive()

    def submit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        options: dict[str, Any],
        sink: Sink,
        arrival_s: float,
    ) -> None:
        """Queue a request (``options``: ``Engine.add_request``'s keywords); its events go to ``sink``."""
        self._commands.put(("submit", request_id, list(prompt_ids), options, sink, arrival_s))

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op if it is finished or unknown)."""
        self._commands.put(("abort", request_id))

    def drain(self, timeout_s: float) -> None:
        """Take no more requests, finish the running ones within ``timeout_s``, abort the rest, stop."""
        self._commands.put(("drain", time.perf_counter() + max(0.0, timeout_s)))

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the thread to end; True if it has."""
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # --- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._build is not None:
                self.engine = self._build()
        except BaseException as err:  # the builder's error goes to whoever waits in ready()
            self.error = err
            return
        finally:
            self._ready.set()
        try:
            while True:
                self._take_commands(block=not self.engine.has_unfinished())
                if self._deadline is not None and (
                    not self.engine.has_unfinished() or time.perf_counter() >= self._deadline
                ):
                    self._abort_all()
                    self._step()
                    self._publish_load()
                    return
                if self.engine.has_unfinished():
                    self._step()
                self._publish_load()
        except BaseException as err:  # a bug here: answer everyone, leave the thread
            log.exception("the engine thread stopped")
            self.error = err
            self._fail_all(APIError(500, f"the engine thread stopped: {err}", type="server_error"))

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple[Any, ...]) -> None:
        kind = command[0]
        if kind == "submit":
            self._submit(*command[1:])
        elif kind == "abort":
            entry = self._entries.get(command[1])
            if entry is not None:
                out = self.engine.abort(command[1])  # its final output: step() will not repeat it
                if out is not None:
                    self._dispatch(out)
        elif kind == "drain":
            self._deadline = command[1] if self._deadline is None else min(self._deadline, command[1])

    def _submit(
        self, request_id: str, prompt_ids: list[int], options: dict[str, Any], sink: Sink, arrival_s: float
    ) -> None:
        if self._deadline is not None:
            sink.put(Failed(APIError(503, "the server is shutting down", type="service_unavailable")))
            return
        try:
            self.engine.add_request(prompt_ids, request_id=request_id, **options)
        except ValueError as err:
            sink.put(Failed(from_engine_error(err)))
            return
        except Exception as err:
            log.exception("add_request failed")
            sink.put(Failed(APIError(500, f"the engine refused the request: {err}", type="server_error")))
            return
        self._entries[request_id] = _Entry(sink, RequestTrack(arrival_s, len(prompt_ids)))
        sink.put(ACCEPTED)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:  # the engine's own bug (a row's fault fails that row alone, in step)
            log.exception("an engine step failed outside any one request; its requests are aborted")
            error = APIError(500, f"the engine step failed: {err}", type="server_error")
            for request_id, entry in list(self._entries.items()):
                try:
                    out = self.engine.abort(request_id)
                    if out is not None and self.metrics is not None:
                        self.metrics.observe(entry.track, out)
                except Exception:
                    log.exception("abort after a failed step failed")
            self._fail_all(error)
            return
        for out in outputs:  # a request that failed alone ends here with finish_reason "error"
            self._dispatch(out)

    def _dispatch(self, out: RequestOutput) -> None:
        entry = self._entries.get(out.request_id)
        if entry is None:  # a request already failed (its sink has its error)
            return
        if self.metrics is not None:
            self.metrics.observe(entry.track, out)
        entry.sink.put(out)
        if out.finished:
            del self._entries[out.request_id]

    def _abort_all(self) -> None:
        for request_id in list(self._entries):
            out = self.engine.abort(request_id)
            if out is not None:
                self._dispatch(out)

    def _fail_all(self, error: APIError) -> None:
        for entry in self._entries.values():
            entry.sink.put(Failed(error))
        self._entries.clear()

    def _publish_load(self) -> None:
        if self.metrics is not None:
            engine = self.engine
            self.metrics.set_load(
                engine.num_running, engine.num_waiting, engine.max_num_seqs - len(engine.free_rows)
            )
