"""A request fails alone in the server: a drafter fault in one engine row, or a detokeniser fault in
one choice, finishes that choice with ``finish_reason`` ``"error"`` and a message, and every other
request's text equals what it was alone. A sampling value the float32 kernels cannot represent is a
400, not a fault.

In process: the app (``build_app``) over a real engine thread (``EngineWorker``) on a tiny random
Llama with a byte-level tokenizer, called through httpx's ``ASGITransport``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from _extras import SERVE, skip_module_without

skip_module_without(SERVE)

import httpx  # noqa: E402
from _tiny import byte_tokenizer, save_tiny_checkpoint  # noqa: E402

import specdec  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.serve import choices as serve_choices  # noqa: E402
from specdec.serve.app import ServerState, build_app  # noqa: E402
from specdec.serve.metrics import ServerMetrics  # noqa: E402
from specdec.serve.protocol import ServedModel  # noqa: E402
from specdec.serve.worker import EngineWorker  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SLOTS, GAMMA, MAX_LEN = 4, 3, 128
BAD_SEED = 999  # the engine row whose drafting raises
BAD_TEXT_SEED = 777  # the choice whose text cannot be made


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The app over a real engine thread; the engine's drafter raises for the row of seed 999 once
    that row has two tokens."""
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("faults") / "tiny", tokenizer=byte_tokenizer())
    target = specdec.load_target(str(path))

    def build() -> Engine:
        return Engine(
            target,
            drafter="ngram",
            gamma=GAMMA,
            max_num_seqs=SLOTS,
            max_model_len=MAX_LEN,
            measure_cost=False,
        )

    worker = EngineWorker(build)
    worker.start()
    engine = worker.ready(60.0)
    propose = engine.drafter.propose

    def faulty(call):
        bad = [
            r.slot for r in engine.requests.values() if r.params.seed == BAD_SEED and len(r.generated) >= 2
        ]
        if any(s in call.slots for s in bad):
            raise RuntimeError("injected drafter fault")
        return propose(call)

    engine.drafter.propose = faulty
    model = ServedModel(
        name="tiny", max_model_len=MAX_LEN, reserved=GAMMA + 1, vocab_size=int(target.vocab_size),
        tokenizer=target.tokenizer,
    )  # fmt: skip
    state = ServerState(worker=worker, model=model, metrics=ServerMetrics("tiny", SLOTS), max_num_seqs=SLOTS)
    yield build_app(state)
    worker.drain(0.0)
    worker.join(30.0)


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


def body(seed: int, **fields: Any) -> dict[str, Any]:
    prompt = "abc abd abe abc abd abe abc ab" if seed % 2 else "the cat sat on the mat. the cat"
    return {
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0.8,
        "seed": seed,
        "ignore_eos": True,
        **fields,
    }


def events(text: str) -> list[Any]:
    """A stream's ``data`` payloads, parsed (``[DONE]`` as the string)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_row_that_fails_in_the_engine_fails_alone(served):
    async def main() -> None:
        async with client(served) as http:
            alone = {}
            for seed in (1, 2):
                r = await http.post("/v1/completions", json=body(seed))
                alone[seed] = r.json()["choices"][0]["text"]
            together = await asyncio.gather(
                http.post("/v1/completions", json=body(1)),
                http.post("/v1/completions", json=body(BAD_SEED)),
                http.post("/v1/completions", json=body(2, stream=True)),
                http.post("/v1/completions", json=body(BAD_SEED, stream=True)),
                http.post("/v1/completions", json=body(BAD_SEED, n=2)),
            )
        one, bad, two, bad_stream, pair = together
        assert one.status_code == 200 and one.json()["choices"][0]["text"] == alone[1]
        assert one.json()["choices"][0]["finish_reason"] == "length"
        # a request whose only choice failed: a 500 naming where and what
        assert bad.status_code == 500, bad.text
        assert "drafting failed: RuntimeError: injected drafter fault" in bad.json()["error"]["message"]
        streamed = events(two.text)
        assert "".join(e["choices"][0]["text"] for e in streamed[:-1]) == alone[2]
        assert streamed[-2]["choices"][0]["finish_reason"] == "length" and streamed[-1] == "[DONE]"
        failed = events(bad_stream.text)
        last = failed[-3]["choices"][0]
        assert last["finish_reason"] == "error" and "injected drafter fault" in last["error"]["message"]
        assert "injected drafter fault" in failed[-2]["error"]["message"] and failed[-1] == "[DONE]"
        # n = 2: choice 0 has the bad seed, choice 1 another (mix_seed): one fails, one answers
        assert pair.status_code == 200, pair.text
        first, second = pair.json()["choices"]
        assert first["finish_reason"] == "error" and "injected drafter fault" in first["error"]["message"]
        assert second["finish_reason"] == "length" and len(second["text"]) > 0

    asyncio.run(main())


def test_a_choice_whose_text_cannot_be_made_fails_alone(served, monkeypatch):
    whole, push = serve_choices.ChoiceOutput.whole, serve_choices.ChoiceOutput.push

    def check(self: Any) -> None:
        if self.choice.seed == BAD_TEXT_SEED:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokeniser fault")

    monkeypatch.setattr(
        serve_choices.ChoiceOutput, "whole", lambda self, out: check(self) or whole(self, out)
    )
    monkeypatch.setattr(serve_choices.ChoiceOutput, "push", lambda self, out: check(self) or push(self, out))

    async def main() -> None:
        async with client(served) as http:
            alone = (await http.post("/v1/completions", json=body(1))).json()["choices"][0]["text"]
            good, bad, bad_stream = await asyncio.gather(
                http.post("/v1/completions", json=body(1)),
                http.post("/v1/completions", json=body(BAD_TEXT_SEED)),
                http.post("/v1/completions", json=body(BAD_TEXT_SEED, stream=True)),
            )
            assert good.status_code == 200 and good.json()["choices"][0]["text"] == alone
            assert bad.status_code == 500
            assert "detokenising failed: UnicodeDecodeError" in bad.json()["error"]["message"]
            failed = events(bad_stream.text)
            assert failed[0]["choices"][0]["finish_reason"] == "error"
            assert "injected detokeniser fault" in failed[0]["choices"][0]["error"]["message"]
            again = await http.post("/v1/completions", json=body(1))  # the engine goes on
            assert again.json()["choices"][0]["text"] == alone

    asyncio.run(main())


def test_a_top_p_that_is_zero_in_float32_is_a_400(served):
    async def main() -> None:
        async with client(served) as http:
            for top_p in (1e-320, 5e-324):
                r = await http.post("/v1/completions", json=body(1, top_p=top_p))
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == "top_p"
            assert (await http.post("/v1/completions", json=body(1, top_p=2.0**-149))).status_code == 200

    asyncio.run(main())
