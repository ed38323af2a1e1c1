"""The HTTP side: an OpenAI-compatible FastAPI app over an :class:`~specdec.serve.worker.EngineWorker`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` true: server-sent
events through sse-starlette, ``data: {chunk}`` then ``data: [DONE]``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text); HEAD wherever GET is, and OPTIONS on every
route (204 with ``Allow``). With an API key, the ``/v1`` routes need ``Authorization: Bearer KEY``
(401 otherwise, unknown ``/v1`` paths included). Checks run in this order: key (401), draining (503),
body size (413), JSON (400), model (404), prompt size, stop count, roles, fields and context (400),
the waiting queue (429 with ``Retry-After``). The body is read on the loop and checked, parsed and
tokenised on the intake thread (:mod:`specdec.serve.intake`), so one large request does not stall
the others. A client that hangs up before its body is read ends its request quietly (one debug
line). With allowed origins, Starlette's ``CORSMiddleware`` answers CORS (none: no CORS headers).

A request holds a :class:`~specdec.serve.tickets.Ticket` per choice (per prompt and ``n``, each its
own engine request, each counted by the waiting-queue limit) from its admission to its end:
whatever ends it (the last token, an error, a client that disconnects mid-stream or while waiting
for a whole response) closes the tickets, which aborts the engine requests that had not finished, so
their cache rows are freed. A stream interleaves its choices' chunks as their tokens come
(:func:`_merged`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specdec.engine import RequestOutput
from specdec.engine.faults import error_message
from specdec.serve.choices import ChoiceOutput
from specdec.serve.cors import add_cors
from specdec.serve.errors import APIError, unavailable
from specdec.serve.intake import Intake, IntakeLimits
from specdec.serve.logprobs import TokenTexts
from specdec.serve.metrics import ServerMetrics
from specdec.serve.protocol import GenerationRequest, ServedModel, parse_chat, parse_completion
from specdec.serve.responses import ResponseShape, usage
from specdec.serve.tickets import Ticket, submit_choices
from specdec.serve.worker import EngineWorker, Failed

__all__ = ["ServerState", "build_app"]

log = logging.getLogger("specdec.serve")


@dataclass
class ServerState:
    """What the handlers share (all on the HTTP loop's thread)."""

    worker: EngineWorker
    model: ServedModel
    metrics: ServerMetrics
    max_num_seqs: int
    api_key: str | None = None
    max_waiting: int | None = None  # engine requests beyond the cache rows before 429 (None: no limit)
    retry_after_s: int = 1
    draining: bool = False
    unfinished: int = 0  # engine requests admitted whose last output has not arrived (the 429 check)
    open: int = 0  # tickets whose handler has not ended (shutdown waits for them to send their last bytes)
    started: int = 0  # unix time, for /v1/models
    intake: Intake | None = None  # None: build_app makes one with the model's default limits
    token_texts: TokenTexts | None = None  # per-token text for log-probabilities (built on first use)

    def texts(self) -> TokenTexts:
        """The tokenizer's cached per-token texts."""
        if self.token_texts is None:
            self.token_texts = TokenTexts(self.model.tokenizer)
        return self.token_texts

    def unavailable(self) -> APIError | None:
        """The 503 to answer now (draining, or no engine thread), else None."""
        if self.draining:
            return unavailable("the server is shutting down", self.retry_after_s)
        if not self.worker.alive:
            return unavailable("the engine thread is not running")
        return None


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


def _shutdown_abort() -> APIError:
    return unavailable("the request was aborted: the server is shutting down")


def _outputs(state: ServerState, gen: GenerationRequest, chat: bool) -> list[ChoiceOutput]:
    tokenizer = state.model.tokenizer
    return [ChoiceOutput(gen, c, tokenizer, state.texts(), chat=chat) for c in gen.choices()]


async def _whole(
    state: ServerState, request: Request, tickets: list[Ticket], shape: ResponseShape, gen: GenerationRequest
) -> Response:
    """Wait for every choice's last output; one response with all of them."""
    lasts: list[RequestOutput] = []
    try:
        for ticket in tickets:  # the choices run together; their outputs wait in their queues
            while True:
                item = await ticket.next(request)
                if item is None:  # the client left: close() aborts the requests
                    return Response(status_code=499)
                if isinstance(item, Failed):
                    raise item.error
                if item.finished:
                    lasts.append(item)
                    break
    finally:
        for ticket in tickets:
            ticket.close()
    # Decoding and formatting many choices' text and log-probabilities (lm-eval sends batches of
    # long echoed prompts) runs on a worker thread, not on the loop other clients' streams share.
    return await asyncio.to_thread(_whole_body, state, lasts, shape, gen)


def _whole_body(
    state: ServerState, lasts: list[RequestOutput], shape: ResponseShape, gen: GenerationRequest
) -> JSONResponse:
    """The response of a non-streamed request from its choices' last outputs."""
    choices, completion_tokens, errors = [], 0, []
    for out, choice in zip(lasts, _outputs(state, gen, shape.chat), strict=True):
        try:
            text, logprobs = choice.whole(out)
        except Exception as err:  # the choice fails alone: its text could not be made
            text, logprobs = "", None
            out = _failed_output(out, "detokenising", err)
        if out.finish_reason == "abort" and not choice.text.stopped:
            raise _shutdown_abort()
        if out.finish_reason == "error":
            errors.append(out.error)
        reason = "error" if out.finish_reason == "error" else choice.finish_reason(out)
        choices.append(
            shape.choice(
                text,
                reason,
                index=choice.index,
                logprobs=logprobs,
                error=out.error if reason == "error" else None,
            )
        )
        completion_tokens += len(out.token_ids) if gen.max_tokens else 0
    if len(errors) == len(lasts):  # nothing to answer with: the request failed
        raise APIError(500, f"the request failed: {errors[0]}", type="server_error")
    body = shape.full(
        choices, None, usage(gen.num_prompt_tokens, completion_tokens, [o.metrics for o in lasts])
    )
    return JSONResponse(body)


def _failed_output(out: RequestOutput, where: str, err: Exception) -> RequestOutput:
    """A choice's output as failed on the server's side (its text or log-probabilities could not be
    made): finish reason ``error`` with the message, its tokens as they were. Logged once."""
    message = error_message(where, err)
    log.warning("request %s failed alone: %s", out.request_id, message, exc_info=err)
    return dataclasses.replace(out, finished=True, finish_reason="error", error=message)


async def _merged(tickets: list[Ticket]) -> AsyncIterator[tuple[int, Any]]:
    """The choices' events as they come, as (choice position, event); each choice's until its last
    (finished or :class:`Failed`). Closing the generator stops the readers."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def read(i: int, ticket: Ticket) -> None:
        while True:
            item = await ticket.next()
            queue.put_nowait((i, item))
            if isinstance(item, Failed) or item.finished:
                return

    readers = [asyncio.create_task(read(i, t)) for i, t in enumerate(tickets)]
    try:
        while True:
            yield await queue.get()
    finally:
        for r in readers:
            r.cancel()


async def _events(
    state: ServerState, tickets: list[Ticket], shape: ResponseShape, gen: GenerationRequest
) -> AsyncIterator[str]:
    """The SSE ``data`` payloads of a streamed request; closing the tickets on any exit (a client
    that disconnects cancels this generator)."""
    extra = gen.include_usage
    choices = _outputs(state, gen, shape.chat)
    lasts: dict[int, RequestOutput] = {}
    events = _merged(tickets)
    try:
        if shape.chat:
            for c in choices:
                yield _dumps(shape.chunk("", role=True, with_usage=extra, index=c.index))
        failed = False
        while len(lasts) < len(tickets) and not failed:
            i, item = await events.__anext__()
            choice = choices[i]
            if i in lasts:  # a choice its stop string ended: the engine's abort output follows
                continue
            if isinstance(item, Failed):
                yield _dumps(item.error.body())
                failed = True
                continue
            try:
                piece, logprobs = choice.push(item)
            except Exception as err:  # the choice fails alone: its text could not be made
                piece, logprobs = "", None
                item = _failed_output(item, "detokenising", err)
            if item.finish_reason == "error":  # this choice ends; the others go on
                tickets[i].close()  # aborts the engine request where the server's side failed
                lasts[i] = item
                yield _dumps(
                    shape.chunk(
                        piece,
                        "error",
                        with_usage=extra,
                        index=choice.index,
                        logprobs=logprobs,
                        error=item.error,
                    )
                )
                continue
            if item.finish_reason == "abort" and not choice.text.stopped:
                if piece:
                    yield _dumps(shape.chunk(piece, with_usage=extra, index=choice.index))
                yield _dumps(_shutdown_abort().body())
                failed = True
                continue
            if item.finished or choice.text.stopped:
                tickets[i].close()  # aborts the request if the server's own stop check ended it first
                lasts[i] = item
                reason = choice.finish_reason(item)
                yield _dumps(
                    shape.chunk(piece, reason, with_usage=extra, index=choice.index, logprobs=logprobs)
                )
            elif piece or logprobs is not None:
                yield _dumps(shape.chunk(piece, with_usage=extra, index=choice.index, logprobs=logprobs))
        errors = [o.error for o in lasts.values() if o.finish_reason == "error"]
        if not failed and errors and len(errors) == len(tickets):  # every choice failed: the request did
            yield _dumps(APIError(500, f"the request failed: {errors[0]}", type="server_error").body())
            failed = True
        if extra and not failed:
            completion = sum(len(o.token_ids) for o in lasts.values()) if gen.max_tokens else 0
            metrics = [o.metrics for o in lasts.values()]
            yield _dumps(shape.usage_chunk(usage(gen.num_prompt_tokens, completion, metrics)))
        yield "[DONE]"
    finally:
        await events.aclose()
        for ticket in tickets:
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
    tickets = await submit_choices(state, gen, request_id, arrival_s)
    if not gen.stream:
        return await _whole(state, request, tickets, shape, gen)
    return EventSourceResponse(
        _events(state, tickets, shape, gen), sep="\n", background=BackgroundTask(_close_all, tickets)
    )


def _close_all(tickets: list[Ticket]) -> None:
    for ticket in tickets:
        ticket.close()


def build_app(
    state: ServerState,
    *,
    allowed_origins: Sequence[str] = (),
    allowed_methods: Sequence[str] = ("*",),
    allowed_headers: Sequence[str] = ("*",),
) -> FastAPI:
    """The FastAPI app over ``state`` (its worker must be started); CORS for ``allowed_origins``
    (:mod:`specdec.serve.cors`; none: no CORS headers)."""
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None)
    add_cors(app, allowed_origins, allowed_methods, allowed_headers)
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
        path = request.url.path if len(request.url.path) <= 200 else request.url.path[:200] + "..."
        error = APIError(err.status_code, f"{request.method} {path}: {err.detail}")
        error.headers.update(err.headers or {})
        return _error_response(error)

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, err: ClientDisconnect) -> Response:
        # The client hung up while sending its body: nothing was admitted, and nobody reads an answer.
        log.debug("%s %s: the client disconnected before its body was read", request.method, request.url.path)
        return Response(status_code=499)

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
