"""The HTTP side: an OpenAI-compatible FastAPI app over an :class:`~specdec.serve.worker.EngineWorker`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` true: server-sent
events through sse-starlette, ``data: {chunk}`` then ``data: [DONE]``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text); HEAD wherever GET is, and OPTIONS on every
route (204 with ``Allow``). With an API key, the ``/v1`` routes need ``Authorization: Bearer KEY``
(401 otherwise, unknown ``/v1`` paths included). Checks run in this order: key (401), draining (503),
body size (413), JSON (400), model (404), prompt size, stop count, roles, fields and context (400),
the waiting queue (429 with ``Retry-After``). The body is read on the loop and checked, parsed and
tokenised on the intake thread (:mod:`specdec.serve.intake`), so one large request does not stall
the others.

A request holds a :class:`Ticket` from submission to its end: whatever ends it (the last token,
an error, a client that disconnects mid-stream or while waiting for a whole response) closes the
ticket, which aborts the request in the engine unless it had finished, so its cache row is freed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.engine import RequestOutput
from specdec.serve.detokenize import TextStream
from specdec.serve.errors import APIError
from specdec.serve.intake import Intake, IntakeLimits
from specdec.serve.metrics import ServerMetrics
from specdec.serve.protocol import GenerationRequest, ServedModel, parse_chat, parse_completion
from specdec.serve.responses import FINISH_REASONS, ResponseShape, usage
from specdec.serve.worker import ACCEPTED, EngineWorker, Failed, Sink

__all__ = ["ServerState", "Ticket", "build_app"]

log = logging.getLogger("specdec.serve")

_POLL_S = 0.25  # how often a waiting handler checks the engine thread and the client


@dataclass
class ServerState:
    """What the handlers share (all on the HTTP loop's thread)."""

    worker: EngineWorker
    model: ServedModel
    metrics: ServerMetrics
    max_num_seqs: int
    api_key: str | None = None
    max_waiting: int | None = None  # requests beyond the cache rows before 429 (None: no limit)
    retry_after_s: int = 1
    draining: bool = False
    unfinished: int = 0  # requests submitted whose last output has not arrived (the 429 check)
    open: int = 0  # requests whose handler has not ended (shutdown waits for them to send their last bytes)
    started: int = 0  # unix time, for /v1/models
    intake: Intake | None = None  # None: build_app makes one with the model's default limits

    def unavailable(self) -> APIError | None:
        """The 503 to answer now (draining, or no engine thread), else None."""
        if self.draining:
            return _unavailable("the server is shutting down", self.retry_after_s)
        if not self.worker.alive:
            return _unavailable("the engine thread is not running")
        return None


def _unavailable(message: str, retry_after_s: int | None = None) -> APIError:
    headers = {} if retry_after_s is None else {"Retry-After": str(retry_after_s)}
    return APIError(503, message, type="service_unavailable", headers=headers)


class Ticket:
    """One submitted request on the HTTP side: its event queue, and :meth:`close` exactly once."""

    def __init__(self, state: ServerState, request_id: str, sink: Sink) -> None:
        self.state = state
        self.request_id = request_id
        self.sink = sink
        self.finished = False
        self.closed = False
        state.unfinished += 1
        state.open += 1
        self.check_at = 0.0  # when to ask next whether the client is still there

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
                        return Failed(_unavailable("the engine thread is not running"))
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
        """End the request here: abort it in the engine unless it finished; idempotent."""
        if self.closed:
            return
        self.closed = True
        self.state.open -= 1
        if not self.finished:
            self.state.worker.abort(self.request_id)
            self._finish()


def _dumps(body: Any) -> str:
    return json.dumps(body, separators=(",", ":"))


def _key_error(state: ServerState, request: Request) -> APIError | None:
    """The 401 for a request without the server's key (None: no key set, or the right one)."""
    if state.api_key is None:
        return None
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        key.strip().encode("latin-1"), state.api_key.encode()
    ):
        return APIError(
            401, "Incorrect API key provided", type="authentication_error", code="invalid_api_key"
        )
    return None


def _check_key(state: ServerState, request: Request) -> None:
    error = _key_error(state, request)
    if error is not None:
        raise error


def _error_response(error: APIError) -> Response:
    """An error body in ASCII JSON: a message that quotes client input stays encodable."""
    return Response(
        json.dumps(error.body()),
        status_code=error.status,
        headers=error.headers,
        media_type="application/json",
    )


async def _submit(state: ServerState, gen: GenerationRequest, request_id: str, arrival_s: float) -> Ticket:
    """Hand the request to the engine thread and wait until it is accepted (or refused: raise)."""
    if state.max_waiting is not None and state.unfinished - state.max_num_seqs >= state.max_waiting:
        raise APIError(
            429,
            f"the waiting queue is full ({state.max_waiting} requests wait for {state.max_num_seqs} slots)",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(state.retry_after_s)},
        )
    ticket = Ticket(state, request_id, Sink(asyncio.get_running_loop()))
    try:
        state.worker.submit(request_id, gen.prompt_ids, gen.engine_options(), ticket.sink, arrival_s)
        first = await ticket.next()
    except BaseException:
        ticket.close()
        raise
    if isinstance(first, Failed):
        ticket.close()
        raise first.error
    assert first == ACCEPTED, first
    return ticket


def _finish_reason(out: RequestOutput, text: TextStream) -> str:
    return "stop" if text.stopped else FINISH_REASONS[out.finish_reason or "abort"]


def _shutdown_abort() -> APIError:
    return _unavailable("the request was aborted: the server is shutting down")


async def _whole(
    state: ServerState, request: Request, ticket: Ticket, shape: ResponseShape, gen: GenerationRequest
) -> Response:
    text = TextStream(state.model.tokenizer, gen.stop)
    try:
        while True:
            item = await ticket.next(request)
            if item is None:  # the client left: close() aborts the request
                return Response(status_code=499)
            if isinstance(item, Failed):
                raise item.error
            if item.finished:
                break
    finally:
        ticket.close()
    text.push(item.token_ids, True)
    if item.finish_reason == "abort" and not text.stopped:
        raise _shutdown_abort()
    body = shape.full(
        text.text, _finish_reason(item, text), usage(len(gen.prompt_ids), len(item.token_ids), item.metrics)
    )
    return JSONResponse(body)


async def _events(
    ticket: Ticket, shape: ResponseShape, gen: GenerationRequest, tokenizer: Any
) -> AsyncIterator[str]:
    """The SSE ``data`` payloads of a streamed request; closing the ticket on any exit (a client that
    disconnects cancels this generator)."""
    text = TextStream(tokenizer, gen.stop)
    extra = gen.include_usage
    try:
        if shape.chat:
            yield _dumps(shape.chunk("", role=True, with_usage=extra))
        while True:
            item = await ticket.next()
            if isinstance(item, Failed):
                yield _dumps(item.error.body())
                break
            piece = text.push(item.new_token_ids, item.finished)
            if item.finish_reason == "abort" and not text.stopped:
                if piece:
                    yield _dumps(shape.chunk(piece, with_usage=extra))
                yield _dumps(_shutdown_abort().body())
                break
            if item.finished or text.stopped:
                ticket.close()  # aborts the request if the server's own stop check ended it first
                yield _dumps(shape.chunk(piece, _finish_reason(item, text), with_usage=extra))
                if extra:
                    yield _dumps(
                        shape.usage_chunk(usage(len(gen.prompt_ids), len(item.token_ids), item.metrics))
                    )
                break
            if piece:
                yield _dumps(shape.chunk(piece, with_usage=extra))
        yield "[DONE]"
    finally:
        ticket.close()


async def _generate(state: ServerState, request: Request, *, chat: bool) -> Response:
    arrival_s = time.perf_counter()
    _check_key(state, request)
    refusal = state.unavailable()
    if refusal is not None:
        raise refusal
    parse = parse_chat if chat else parse_completion
    gen = await state.intake.parse(request, lambda body: parse(body, state.model), chat=chat)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    shape = ResponseShape(chat=chat, request_id=request_id, model=state.model.name, created=int(time.time()))
    ticket = await _submit(state, gen, request_id, arrival_s)
    if not gen.stream:
        return await _whole(state, request, ticket, shape, gen)
    return EventSourceResponse(
        _events(ticket, shape, gen, state.model.tokenizer), sep="\n", background=BackgroundTask(ticket.close)
    )


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app over ``state`` (its worker must be started)."""
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    state.started = int(time.time())
    if state.intake is None:
        state.intake = Intake(IntakeLimits.for_model(state.model), state.model.name)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> Response:
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> Response:
        if request.url.path.startswith("/v1/") or request.url.path == "/v1":
            refusal = _key_error(state, request)  # with a key, unknown /v1 paths are not revealed
            if refusal is not None:
                return _error_response(refusal)
        error = APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}")
        error.headers.update(err.headers or {})
        return _error_response(error)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> Response:
        log.exception("internal error on %s", request.url.path)
        error = APIError(500, f"internal server error: {type(err).__name__}: {err}", type="server_error")
        return _error_response(error)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        refusal = state.unavailable()
        if refusal is not None:
            return JSONResponse(refusal.body(), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        text, content_type = state.metrics.render()
        return Response(text, media_type=content_type)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request) -> JSONResponse:
        _check_key(state, request)
        card = {
            "id": state.model.name,
            "object": "model",
            "created": state.started,
            "owned_by": "specdec",
            "max_model_len": state.model.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, chat=True)

    _answer_options(app)
    return app


def _answer_options(app: FastAPI) -> None:
    """OPTIONS on every route's path: 204 with ``Allow`` (its methods, OPTIONS included); call it
    after the routes are added."""
    allowed: dict[str, set[str]] = {}
    for route in app.routes:
        if isinstance(route, APIRoute):
            allowed.setdefault(route.path, set()).update(route.methods)
    for path, methods in allowed.items():
        allow = ", ".join(sorted(methods | {"OPTIONS"}))
        app.add_api_route(path, _options(allow), methods=["OPTIONS"], include_in_schema=False)


def _options(allow: str) -> Any:
    """An OPTIONS endpoint answering ``Allow: allow``."""

    async def options() -> Response:
        return Response(status_code=204, headers={"Allow": allow})

    return options
