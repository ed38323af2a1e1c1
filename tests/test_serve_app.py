"""The HTTP side of ``specdec serve`` in process, over a stub engine thread the test drives: the
waiting-queue limit counts every choice and holds under concurrent requests, each place is given
back however its choice ends (finished, refused, the client gone), a client that hangs up mid-upload
ends quietly, and CORS headers come only for the allowed origins.

The app is called through httpx's ``ASGITransport`` or, where a test needs a client that disconnects,
through the ASGI interface directly. No model runs: :class:`StubWorker` accepts every request and
holds it until the test finishes it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
from _extras import SERVE, skip_module_without

skip_module_without(SERVE)

import httpx  # noqa: E402
from _tiny import byte_tokenizer  # noqa: E402

from specdec.engine import RequestMetrics, RequestOutput  # noqa: E402
from specdec.serve.app import ServerState, build_app  # noqa: E402
from specdec.serve.errors import bad_request  # noqa: E402
from specdec.serve.metrics import ServerMetrics  # noqa: E402
from specdec.serve.protocol import ServedModel  # noqa: E402
from specdec.serve.worker import ACCEPTED, Failed, Sink  # noqa: E402

SLOTS, MAX_WAITING = 2, 3  # at most 5 engine requests admitted at once
KEY = "k"


class StubWorker:
    """:class:`~specdec.serve.worker.EngineWorker`'s interface: every request is accepted (unless
    ``refuse(request_id)``) and waits until :meth:`finish`; aborts are recorded."""

    alive = True

    def __init__(self, refuse: Callable[[str], bool] = lambda rid: False) -> None:
        self.refuse = refuse
        self.sinks: dict[str, Sink] = {}
        self.submitted: list[str] = []
        self.aborted: list[str] = []

    def submit(self, request_id: str, prompt_ids: Any, options: Any, sink: Sink, arrival_s: float) -> None:
        self.submitted.append(request_id)
        if self.refuse(request_id):
            sink.put(Failed(bad_request("refused by the stub", "prompt")))
            return
        self.sinks[request_id] = sink
        sink.put(ACCEPTED)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.sinks.pop(request_id, None)

    def finish_all(self) -> None:
        """Every held request's last output: one token, finish reason ``length``."""
        for request_id, sink in list(self.sinks.items()):
            sink.put(RequestOutput(request_id, [65], [65], True, "length", RequestMetrics()))
        self.sinks.clear()


def make_state(worker: StubWorker, *, max_waiting: int | None = MAX_WAITING) -> ServerState:
    model = ServedModel(name="tiny", max_model_len=64, reserved=4, vocab_size=259, tokenizer=byte_tokenizer())
    return ServerState(
        worker=worker,  # type: ignore[arg-type]
        model=model,
        metrics=ServerMetrics("tiny", SLOTS),
        max_num_seqs=SLOTS,
        api_key=KEY,
        max_waiting=max_waiting,
    )


def client(app: Any) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", headers=headers)


def body(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 2, **fields}


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Let the loop run until ``condition()`` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.005)


# --- the waiting-queue limit counts engine requests --------------------------------------------------


def test_a_request_of_n_choices_takes_n_places():
    async def main() -> None:
        worker = StubWorker()
        state = make_state(worker)
        async with client(build_app(state)) as http:
            r = await http.post("/v1/completions", json=body(n=SLOTS + MAX_WAITING + 1))
            assert r.status_code == 400, r.text  # more than could ever be admitted: no wait helps
            error = r.json()["error"]
            assert error["param"] == "n" and "at most 5 at once" in error["message"], error
            r = await http.post("/v1/completions", json=body(prompt=["a"] * 6))
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            held = asyncio.create_task(http.post("/v1/completions", json=body(n=4)))
            await until(lambda: len(worker.sinks) == 4)
            r = await http.post("/v1/completions", json=body(n=2))  # 4 + 2 > 5
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "rate_limit_exceeded"
            assert "this request needs 2" in r.json()["error"]["message"]
            one = asyncio.create_task(http.post("/v1/completions", json=body()))  # 4 + 1 = 5: admitted
            await until(lambda: len(worker.sinks) == 5)
            assert (await http.post("/v1/completions", json=body())).status_code == 429
            worker.finish_all()
            assert [c["index"] for c in (await held).json()["choices"]] == [0, 1, 2, 3]
            assert (await one).status_code == 200
            assert state.unfinished == 0 and state.open == 0
            again = asyncio.create_task(http.post("/v1/completions", json=body(n=5)))
            await until(lambda: len(worker.sinks) == 5)
            worker.finish_all()
            assert (await again).status_code == 200

    asyncio.run(main())


def test_concurrent_requests_cannot_pass_the_check_together():
    """Ten requests of 2 choices at once, 5 places: exactly 2 are admitted (their 4 choices), the
    others get 429, whatever the interleaving of their intake."""

    async def main() -> None:
        worker = StubWorker()
        state = make_state(worker)
        async with client(build_app(state)) as http:
            tasks = [asyncio.create_task(http.post("/v1/completions", json=body(n=2))) for _ in range(10)]
            try:
                # the places are taken at once; the admitted requests' choices reach the worker after
                await until(lambda: sum(t.done() for t in tasks) == 8 and len(worker.sinks) == 4)
                assert state.unfinished == 4
                refused = [t.result() for t in tasks if t.done()]
                assert all(r.status_code == 429 for r in refused), [r.text for r in refused]
            finally:  # a failed check must not leave requests held (asyncio.run would wait on them)
                worker.finish_all()
            statuses = sorted([(await t).status_code for t in tasks])
            assert statuses == [200] * 2 + [429] * 8
            assert state.unfinished == 0 and state.open == 0

    asyncio.run(main())


def test_no_limit_admits_everything():
    async def main() -> None:
        worker = StubWorker()
        state = make_state(worker, max_waiting=None)
        async with client(build_app(state)) as http:
            held = asyncio.create_task(http.post("/v1/completions", json=body(n=128)))
            await until(lambda: len(worker.sinks) == 128)
            worker.finish_all()
            assert (await held).status_code == 200 and state.unfinished == 0

    asyncio.run(main())


def test_a_refused_choice_gives_every_place_back():
    """The engine refuses the second choice: the first, already accepted, is aborted; no place stays
    taken."""

    async def main() -> None:
        worker = StubWorker(refuse=lambda rid: rid.endswith("-1"))
        state = make_state(worker)
        async with client(build_app(state)) as http:
            r = await http.post("/v1/completions", json=body(n=3))
            assert r.status_code == 400 and "refused by the stub" in r.text
            assert [rid[-2:] for rid in worker.submitted] == ["-0", "-1"]  # the third was never sent
            assert [rid[-2:] for rid in worker.aborted] == ["-0"]
            assert state.unfinished == 0 and state.open == 0

    asyncio.run(main())


# --- a client that leaves: the ASGI interface driven by hand ------------------------------------------


async def call(
    app: Any, raw: bytes, *, path: str = "/v1/completions", declared: int | None = None, leave: asyncio.Event
) -> list[dict[str, Any]]:
    """POST ``raw`` to ``app`` as one ASGI request; once ``leave`` is set, the client disconnects
    (``declared``: a Content-Length larger than ``raw``, so that the body ends early). The messages
    the app sent."""
    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json")]
    headers.append((b"content-length", str(len(raw) if declared is None else declared).encode()))
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("test", 80),
    }  # fmt: skip
    sent: list[dict[str, Any]] = []
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": raw, "more_body": declared is not None}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def test_a_client_that_hangs_up_mid_upload_ends_quietly(caplog):
    """Starlette raises ``ClientDisconnect`` from the body read: no 500, no traceback, nothing
    admitted (before, each such connection logged "internal error" and two tracebacks)."""

    async def main() -> list[dict[str, Any]]:
        worker = StubWorker()
        state = make_state(worker)
        app = build_app(state)
        leave = asyncio.Event()
        leave.set()
        sent = await call(app, b'{"prompt": "a long pro', declared=10_000, leave=leave)
        assert worker.submitted == [] and state.unfinished == 0
        return sent

    with caplog.at_level(logging.DEBUG, logger="specdec.serve"):
        sent = asyncio.run(main())
    assert sent[0]["status"] == 499
    problems = [r for r in caplog.records if r.levelno >= logging.INFO or r.exc_info]
    assert problems == [], [r.getMessage() for r in problems]
    assert [r.getMessage() for r in caplog.records] == [
        "POST /v1/completions: the client disconnected before its body was read"
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_that_leaves_while_waiting_gives_its_places_back(stream):
    async def main() -> None:
        worker = StubWorker()
        state = make_state(worker)
        app = build_app(state)
        leave = asyncio.Event()
        raw = json.dumps(body(n=3, stream=stream)).encode()
        handler = asyncio.create_task(call(app, raw, leave=leave))
        await until(lambda: len(worker.sinks) == 3)
        assert state.unfinished == 3
        leave.set()
        await asyncio.wait_for(handler, 10)
        assert state.unfinished == 0 and state.open == 0 and len(worker.aborted) == 3

    asyncio.run(main())


# --- CORS ---------------------------------------------------------------------------------------------


def test_cors_headers_only_for_the_allowed_origins():
    async def main() -> None:
        ui = "http://ui.example:3000"
        allowed = build_app(make_state(StubWorker()), allowed_origins=(ui,))
        async with client(allowed) as http:
            r = await http.get("/health", headers={"Origin": ui})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ui
            r = await http.get("/health", headers={"Origin": "http://other.example"})
            assert "access-control-allow-origin" not in r.headers
            preflight = {
                "Origin": ui,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            }
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=allowed), base_url="http://t"
            ) as bare:
                r = await bare.options("/v1/completions", headers=preflight)  # no key: browsers send none
            assert r.status_code == 200, r.text
            assert r.headers["access-control-allow-origin"] == ui
            assert "POST" in r.headers["access-control-allow-methods"]
            assert "authorization" in r.headers["access-control-allow-headers"].lower()
        plain = build_app(make_state(StubWorker()))
        async with client(plain) as http:
            r = await http.get("/health", headers={"Origin": ui})
            assert not any(h.startswith("access-control-") for h in r.headers)
            r = await http.options(
                "/v1/completions", headers={"Origin": ui, "Access-Control-Request-Method": "POST"}
            )
            assert r.status_code == 204 and not any(h.startswith("access-control-") for h in r.headers)

    asyncio.run(main())


def test_cors_flags_reach_the_config_and_bad_values_name_the_flag(monkeypatch):
    import specdec.serve.server as server
    from specdec.cli import main
    from specdec.serve.cors import check_cors

    seen: dict[str, Any] = {}
    monkeypatch.setattr(server, "serve", lambda config: seen.setdefault("config", config) and 0)
    main(
        [
            "serve",
            "--allowed-origins",
            '["http://a.example"]',
            "http://b.example:8080",
            "--allowed-methods",
            "GET",
            "post",
        ]
    )
    config = seen["config"]
    assert config.allowed_origins == ("http://a.example", "http://b.example:8080")
    assert (config.allowed_methods, config.allowed_headers) == (("GET", "post"), ("*",))
    assert config.chat_content_special_tokens is False
    seen.clear()
    main(["serve", "--chat-content-special-tokens"])
    assert seen["config"].chat_content_special_tokens is True and seen["config"].allowed_origins == ()
    for origins, methods, headers, flag in (
        (["http://a.example/"], ["*"], ["*"], "--allowed-origins"),
        (["a.example"], ["*"], ["*"], "--allowed-origins"),
        (["*"], ["GET POST"], ["*"], "--allowed-methods"),
        (["*"], ["*"], ["bad header"], "--allowed-headers"),
        ("http://a.example", ["*"], ["*"], "--allowed-origins"),
    ):
        with pytest.raises(ValueError, match=flag):
            check_cors(origins, methods, headers)
    with pytest.raises(ValueError, match="--allowed-origins"):
        server.ServeConfig(allowed_origins=("http://a.example/",))
