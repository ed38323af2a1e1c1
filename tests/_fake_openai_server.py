"""A fake OpenAI-compatible streaming server with known chunk timings, for ``specdec bench-serve``'s tests.

Every streamed request waits ``TTFT_S``, then sends ``CHUNKS`` token chunks of ``TOKENS_PER_CHUNK``
tokens (text ``"ab"``) ``GAP_S`` apart, an empty finishing chunk, the usage (with ``num_draft_tokens``
and ``num_accepted_tokens``) and ``data: [DONE]``; a chat stream opens with an empty role chunk sent
at once. The prompt (or the user message) picks a failure: ``fail-500`` (HTTP 500), ``drop`` (one
chunk, then the connection breaks), ``no-done`` (the stream ends without ``[DONE]``), ``error-event``
(an error event mid-stream), ``eos-only`` (after ``TTFT_S``, one empty finishing chunk: a response
whose one token is the end of sequence). ``/metrics`` counts, per answered request, ``DRAFTS`` drafts,
``DRAFT_TOKENS`` draft tokens and ``ACCEPTED`` accepted tokens under vLLM's names; ``bare=True``
serves no ``/metrics``. Run as a script (``--port``; ``-md FILE`` must exist; other llama-server flags
ignored) it stands in for ``llama-server`` (``llama=True``): usage without draft counts, the
request's ``timings`` on its last event, and ``/metrics`` under llama.cpp's names; with
``--spec-type`` (``speculates=True``) each request drafts ``LLAMA_DRAFTS`` times, ``LLAMA_DRAFT_N``
tokens of which ``LLAMA_ACCEPTED`` are accepted (``LLAMA_PER_POS`` at each position), reported as
llama-server does (``timings.draft_n``, ``timings.draft_n_accepted``,
``llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="k"}``); without it, none.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
import time
from typing import Any

TTFT_S, GAP_S, CHUNKS, TOKENS_PER_CHUNK = 0.05, 0.02, 4, 2
DRAFTS, DRAFT_TOKENS, ACCEPTED = 2, 8, 6
MODEL = "fake-model"
LLAMA_DRAFTS, LLAMA_DRAFT_N, LLAMA_ACCEPTED, LLAMA_PER_POS = 3, 6, 4, (2, 1, 1)


def build_app(*, bare: bool = False, llama: bool = False, speculates: bool = False) -> Any:
    """The Starlette app; ``app.state.bodies`` holds every request body received."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    counts = {"requests": 0}
    bodies: list[dict] = []

    async def completions(request: Request) -> Any:
        body = await request.json()
        bodies.append(body)
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if prompt == "fail-500":
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)

        def chunk(text: str, finish: str | None = None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": text} if role else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
            return "data: " + json.dumps({"choices": [choice], "usage": None}) + "\n\n"

        async def events() -> Any:
            if chat:
                yield chunk("", role=True)
            await asyncio.sleep(TTFT_S)
            if prompt == "eos-only":
                yield chunk("", "stop")
                yield "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 1}}) + "\n\n"
                yield "data: [DONE]\n\n"
                return
            for i in range(CHUNKS):
                if i:
                    await asyncio.sleep(GAP_S)
                yield chunk("ab")
                if prompt == "drop":
                    raise RuntimeError("the fake server drops the stream")
                if prompt == "error-event" and i == 1:
                    yield "data: " + json.dumps({"error": {"message": "engine failed", "code": 500}}) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
            yield chunk("", "length")
            counts["requests"] += 1
            usage = {
                "prompt_tokens": 3,
                "completion_tokens": CHUNKS * TOKENS_PER_CHUNK,
                "total_tokens": 3 + CHUNKS * TOKENS_PER_CHUNK,
                "num_draft_tokens": DRAFT_TOKENS,
                "num_accepted_tokens": ACCEPTED,
            }
            last: dict[str, Any] = {"choices": [], "usage": usage}
            if llama:  # llama-server: no draft counts in usage; its timings, draft_n only if it drafted
                del usage["num_draft_tokens"], usage["num_accepted_tokens"]
                last["timings"] = {"predicted_n": CHUNKS * TOKENS_PER_CHUNK, "predicted_ms": 1.0}
                if speculates:
                    last["timings"] |= {"draft_n": LLAMA_DRAFT_N, "draft_n_accepted": LLAMA_ACCEPTED}
            yield "data: " + json.dumps(last) + "\n\n"
            if prompt != "no-done":
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def llama_metrics(request: Request) -> Any:
        n, spec = counts["requests"], int(speculates)
        lines = ["# TYPE llamacpp:tokens_predicted_total counter", f"llamacpp:tokens_predicted_total {n * 8}"]
        for name, each in (
            ("spec_decode_num_draft_tokens_total", LLAMA_DRAFT_N),
            ("spec_decode_num_accepted_tokens_total", LLAMA_ACCEPTED),
            ("spec_decode_num_drafts_total", LLAMA_DRAFTS),
        ):
            lines += [f"# TYPE llamacpp:{name} counter", f"llamacpp:{name} {n * each * spec}"]
        if spec and n:  # llama-server lists the positions once a request has drafted
            name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
            lines += [f'{name}{{position="{k}"}} {n * c}' for k, c in enumerate(LLAMA_PER_POS)]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def metrics(request: Request) -> Any:
        n = counts["requests"]
        lines = [
            "# HELP vllm:spec_decode_num_drafts_total Draft steps",
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            f'vllm:spec_decode_num_drafts_total{{model_name="{MODEL}"}} {float(DRAFTS * n)}',
            f'vllm:spec_decode_num_drafts_created{{model_name="{MODEL}"}} 1.7e9',
            f'vllm:spec_decode_num_draft_tokens_total{{model_name="{MODEL}"}} {float(DRAFT_TOKENS * n)}',
            f'vllm:spec_decode_num_accepted_tokens_total{{model_name="{MODEL}"}} {float(ACCEPTED * n)}',
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{MODEL}",position="0"}} {n}',
            f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/models", lambda r: JSONResponse({"data": [{"id": MODEL, "object": "model"}]})),
        Route("/health", lambda r: JSONResponse({"status": "ok"})),
    ]
    if not bare:
        routes.append(Route("/metrics", llama_metrics if llama else metrics))
    app = Starlette(routes=routes)
    app.state.bodies = bodies
    return app


class ThreadedServer:
    """The app under uvicorn in a daemon thread on a free loopback port (``url``)."""

    def __init__(self, app: Any, port: int = 0) -> None:
        import uvicorn

        self.app = app
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def main(argv: list[str]) -> int:
    """Serve on ``--port`` until SIGTERM or SIGINT, then exit with status 0 (as llama-server does); a
    ``-md`` file that does not exist: status 1 at once (as llama-server's failed load)."""
    from pathlib import Path

    if "-md" in argv and not Path(argv[argv.index("-md") + 1]).is_file():
        print(f"failed to load the draft model {argv[argv.index('-md') + 1]}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    app = build_app(llama=True, speculates="--spec-type" in argv)
    server = ThreadedServer(app, port=int(argv[argv.index("--port") + 1]))
    stop.wait()
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
