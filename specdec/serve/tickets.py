"""A request's engine requests on the HTTP side: their admission against ``--max-waiting``, and a
:class:`Ticket` for each from submission to its end.

**Admission counts engine requests.** Every choice of a request (per prompt and ``n``) is its own
engine request. A request of k choices is admitted when the unfinished engine requests, its own k
included, number at most ``max_num_seqs + max_waiting`` (the cache rows, and the queue behind them);
else it gets a 429 with ``Retry-After``, or a 400 where its k alone are more than that (no wait would
let it in). :func:`admit` checks and takes the k places in one synchronous call, before the request's
first ``await``, so concurrent requests on the loop never pass the check on the same free places.

**A ticket holds its place until the choice ends**: whatever ends it (its last output, a refusal, the
engine thread's failure, a client that disconnects mid-stream or while waiting, an error in the
handler) closes it, which gives the place back and aborts the engine request if it had not
finished, freeing its cache row.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from specdec.engine import RequestOutput
from specdec.serve.errors import APIError, bad_request, unavailable
from specdec.serve.protocol import GenerationRequest
from specdec.serve.worker import ACCEPTED, Failed, Sink

if TYPE_CHECKING:
    from starlette.requests import Request

    from specdec.serve.app import ServerState

__all__ = ["Ticket", "admit", "submit_choices"]

_POLL_S = 0.25  # how often a waiting handler checks the engine thread and the client


class Ticket:
    """One engine request of a request: its place in the admission count, its event queue, and
    :meth:`close` exactly once. Made by :func:`admit`; :meth:`submit` hands it to the engine thread."""

    def __init__(self, state: ServerState, request_id: str) -> None:
        self.state = state
        self.request_id = request_id
        self.sink = Sink(asyncio.get_running_loop())
        self.submitted = False
        self.finished = False
        self.closed = False
        state.unfinished += 1
        state.open += 1
        self.check_at = 0.0  # when to ask next whether the client is still there

    async def submit(self, prompt_ids: list[int], options: dict[str, Any], arrival_s: float) -> None:
        """Hand the engine request to the engine thread and wait until it is accepted; raise the
        refusal's error (the caller closes the ticket)."""
        self.state.worker.submit(self.request_id, prompt_ids, options, self.sink, arrival_s)
        self.submitted = True
        first = await self.next()
        if isinstance(first, Failed):
            raise first.error
        assert first == ACCEPTED, first

    async def next(self, request: Request | None = None) -> Any:
        """The next event; a :class:`Failed` 503 if the engine thread ended; None if ``request``'s
        client disconnected (checked every ``_POLL_S`` seconds while waiting)."""
        queue = self.sink.queue
        while True:
            if request is not None and time.monotonic() >= self.check_at:
                self.check_at = time.monotonic() + _POLL_S
                if await request.is_disconnected():
                    return None
            if queue.empty():
                try:
                    item = await asyncio.wait_for(queue.get(), _POLL_S)
                except asyncio.TimeoutError:
                    if not self.state.worker.alive and queue.empty():
                        return Failed(unavailable("the engine thread is not running"))
                    continue
            else:
                item = queue.get_nowait()
            if isinstance(item, Failed) or (isinstance(item, RequestOutput) and item.finished):
                self._finish()
            return item

    def _finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.state.unfinished -= 1

    def close(self) -> None:
        """End the engine request here: give its place back, abort it in the engine unless it
        finished; idempotent."""
        if self.closed:
            return
        self.closed = True
        self.state.open -= 1
        if not self.finished:
            if self.submitted:
                self.state.worker.abort(self.request_id)
            self._finish()


def admit(state: ServerState, gen: GenerationRequest, request_id: str) -> list[Ticket]:
    """A ticket per choice of ``gen`` (ids ``{request_id}-{index}`` where there are several), or the
    429 / 400 of the waiting-queue limit (the module doc). Synchronous: nothing runs in between."""
    choices = gen.choices()
    k = len(choices)
    if state.max_waiting is not None:
        slots, capacity = state.max_num_seqs, state.max_num_seqs + state.max_waiting
        if k > capacity:
            raise bad_request(
                f"this request has {k} choices (prompts x n), each its own engine request; this server "
                f"takes at most {capacity} at once ({slots} cache slots + --max-waiting {state.max_waiting})",
                "n" if gen.n > 1 else "prompt",
            )
        if state.unfinished + k > capacity:
            waiting = max(0, state.unfinished - slots)
            raise APIError(
                429,
                f"the waiting queue is full: {waiting} engine requests wait for {slots} cache slots, "
                f"at most {state.max_waiting} may (--max-waiting), and this request needs {k}",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(state.retry_after_s)},
            )
    return [Ticket(state, request_id if k == 1 else f"{request_id}-{c.index}") for c in choices]


async def submit_choices(
    state: ServerState, gen: GenerationRequest, request_id: str, arrival_s: float
) -> list[Ticket]:
    """Admit every choice of the request (:func:`admit`), then submit each as its own engine request;
    a refusal closes every ticket and raises."""
    tickets = admit(state, gen, request_id)
    try:
        for ticket, c in zip(tickets, gen.choices(), strict=True):
            await ticket.submit(c.prompt_ids, gen.engine_options(c.seed), arrival_s)
    except BaseException:
        for t in tickets:
            t.close()
        raise
    return tickets
