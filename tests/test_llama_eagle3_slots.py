"""The multi-slot probe of llama-server's EAGLE-3 (experiments/llama_eagle3_slots.py) against a fake
server whose acceptance falls when other requests are in flight."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from experiments.llama_eagle3_slots import _summary, main, probe


class _Fake(BaseHTTPRequestHandler):
    in_flight = 0
    most = 0
    lock = threading.Lock()

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["temperature"] == 0.0 and body["cache_prompt"] is False
        with _Fake.lock:
            _Fake.in_flight += 1
            _Fake.most = max(_Fake.most, _Fake.in_flight)
        time.sleep(0.2)  # the neighbours arrive while this one runs
        with _Fake.lock:
            busy = _Fake.in_flight > 1
        prompt = body["messages"][0]["content"]
        reply = {
            "choices": [
                {"message": {"content": f"echo {prompt}" + (" busy" if busy and prompt == "b" else "")}}
            ],
            "timings": {"draft_n": 12, "draft_n_accepted": 1 if busy else 6},
        }
        data = json.dumps(reply).encode()
        time.sleep(0.2)
        with _Fake.lock:
            _Fake.in_flight -= 1
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_each_prompt_alone_then_beside_others_with_its_own_counts(fake_server):
    _Fake.most = 0
    rows = probe(fake_server, ["a", "b", "c"], neighbours=2, max_tokens=8, model="m", say=lambda _: None)
    assert _Fake.most == 3  # the probe and its two neighbours were in flight together
    assert [r["prompt"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["alone"] == {"drafted": 12, "accepted": 6, "acceptance": 0.5}
        assert r["beside_others"] == {"drafted": 12, "accepted": 1, "acceptance": 1 / 12}
    assert [r["same_text"] for r in rows] == [True, False, True]
    summary = _summary(rows)
    assert summary["alone"] == {"drafted": 36, "accepted": 18, "acceptance": 0.5}
    assert summary["beside_others"]["accepted"] == 3
    assert summary["same_text"] == 2 and summary["prompts"] == 3


def test_bad_counts_are_value_errors():
    with pytest.raises(ValueError, match="--neighbours must be >= 1, got 0"):
        main(["--neighbours", "0"])


def test_without_a_llama_server_it_says_how_to_name_one(monkeypatch, capsys):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["--num-prompts", "1"]) == 2
    assert "LLAMA_SERVER" in capsys.readouterr().err
