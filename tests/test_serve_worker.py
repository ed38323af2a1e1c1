"""The server's engine thread builds its engine itself (specdec/serve/worker.py: the native kernels'
OpenMP teams belong to the thread that starts them, so loading and cost-model forwards must run on the
thread that decodes)."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("prometheus_client", reason="needs the [serve] extra (pip install -e '.[serve]')")

from _tiny import TableTarget, random_table  # noqa: E402

from specdec.engine import Engine  # noqa: E402
from specdec.serve.worker import ACCEPTED, EngineWorker, Sink  # noqa: E402


def test_a_builder_runs_on_the_engine_thread_and_the_worker_decodes_there():
    seen: dict[str, str] = {}

    class Recording(TableTarget):
        def forward(self, tokens_BT, start_B, *, rows_B=None, logits_index_BN=None):
            seen.setdefault("forward", threading.current_thread().name)
            return super().forward(tokens_BT, start_B, rows_B=rows_B, logits_index_BN=logits_index_BN)

    def build() -> Engine:
        seen["build"] = threading.current_thread().name
        return Engine(Recording(random_table(16, seed=2)), drafter="none", max_num_seqs=2)

    worker = EngineWorker(build)
    worker.start()
    engine = worker.ready(30.0)
    assert isinstance(engine, Engine) and seen["build"] == "specdec-engine"
    assert seen["forward"] == "specdec-engine"  # the cost model's forwards too

    async def one_request() -> list:
        sink = Sink(asyncio.get_running_loop())
        worker.submit("r1", [1, 2, 3], {"max_new_tokens": 4, "temperature": 0.0}, sink, 0.0)
        items = [await asyncio.wait_for(sink.get(), 30)]
        while not getattr(items[-1], "finished", False):
            items.append(await asyncio.wait_for(sink.get(), 30))
        return items

    items = asyncio.run(one_request())
    assert items[0] == ACCEPTED and len(items[-1].token_ids) == 4
    worker.drain(0.0)
    assert worker.join(30.0)


def test_a_builder_that_fails_raises_in_ready():
    def build() -> Engine:
        raise ValueError("--target nowhere: no such checkpoint")

    worker = EngineWorker(build)
    worker.start()
    with pytest.raises(ValueError, match="no such checkpoint"):
        worker.ready(30.0)
    assert worker.join(30.0)


def test_a_prompt_aborted_during_its_prefill_counts_its_tokens():
    """``vllm:prompt_tokens`` counts every admitted prompt once, however it ends: aborted mid-prefill
    (no token yet), aborted while waiting for a slot, or finished after several outputs."""
    from prometheus_client.parser import text_string_to_metric_families

    from specdec.serve.metrics import RequestTrack, ServerMetrics

    engine = Engine(
        TableTarget(random_table(16, seed=2)),
        drafter="none",
        gamma=0,
        max_num_seqs=1,
        prefill_chunk=4,
        max_num_batched_tokens=8,
        measure_cost=False,
    )
    metrics = ServerMetrics("tiny", 1)
    prompts = {"mid": [1, 2, 3, 4, 5] * 8, "queued": [6, 7, 8], "done": [9, 10]}
    tracks = {rid: RequestTrack(0.0, len(ids)) for rid, ids in prompts.items()}
    for rid, ids in prompts.items():
        engine.add_request(ids, request_id=rid, max_new_tokens=4, temperature=0.0, ignore_eos=True)
    assert engine.step() == []  # a few of the 40 prompt tokens prefilled; the others wait for the row
    assert 0 < engine.requests["mid"].num_prefilled < 40
    for rid in ("mid", "queued"):
        out = engine.abort(rid)
        assert out.finished and out.finish_reason == "abort" and out.token_ids == []
        metrics.observe(tracks[rid], out)
    outputs = 0
    while engine.has_unfinished():
        for out in engine.step():
            metrics.observe(tracks[out.request_id], out)
            outputs += 1
    assert outputs > 1  # "done" reported several times, counted once

    text = metrics.render()[0].decode()
    values = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.labels.get("position")
    }
    assert values["vllm:prompt_tokens_total"] == 40 + 3 + 2
    assert values["vllm:generation_tokens_total"] == 4
