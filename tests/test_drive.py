"""``specdec.loop.drive``, the one in-process driver (``specdec generate``, ``specdec bench`` with and
without ``--concurrency``, the experiments): arrivals together or staggered at a concurrency, an engine
reused across calls with each call's own metrics, the bench's one-engine-per-drafter methods equal to
``specdec.generate``, and bad arguments refused by name."""

from __future__ import annotations

import pytest
from _tiny import save_tiny_checkpoint

import specdec
from specdec.bench.interleave import Prompt, engine_method, method_engine
from specdec.engine import Engine
from specdec.loop import drive
from specdec.targets.llama import LlamaTarget

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [list(range(3, 3 + n)) for n in (5, 9, 4, 7, 6)]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return LlamaTarget.from_pretrained(save_tiny_checkpoint(tmp_path_factory.mktemp("drive") / "t", seed=2))


def _engine(target, drafter: str = "ngram", rows: int = 2) -> Engine:
    return Engine(target, drafter=drafter, gamma=3, max_num_seqs=rows, max_model_len=64, measure_cost=False)


def test_staggered_keeps_c_in_flight_and_every_arrival_gives_the_solo_tokens(target):
    solo = specdec.generate(target, PROMPTS, drafter="ngram", gamma=3, **GREEDY).token_ids
    engine = _engine(target)
    in_flight: list[int] = []
    step = engine.step

    def counted_step():
        in_flight.append(engine.num_running + engine.num_waiting)
        return step()

    engine.step = counted_step
    for arrival in ("together", "staggered"):
        in_flight.clear()
        out = drive(engine, PROMPTS, GREEDY, seeds=[0] * len(PROMPTS), concurrency=2, arrival=arrival)
        assert out.token_ids == solo
        assert max(in_flight) == 2
        assert out.finish_reasons == ["length"] * len(PROMPTS)
        assert all(m is not None and len(m.token_times_s) == 8 for m in out.requests)
    # staggered refills a row as soon as one frees up: two in flight until the last prompt is in
    assert in_flight == sorted(in_flight, reverse=True)


def test_a_reused_engine_reports_each_call_on_its_own(target):
    engine = _engine(target)
    first = drive(engine, PROMPTS[:2], GREEDY)
    steps_after_first = engine.stats["steps"]
    second = drive(engine, PROMPTS[:1], GREEDY)
    assert first.engine_stats["steps"] == steps_after_first
    assert second.engine_stats["steps"] == engine.stats["steps"] - steps_after_first
    assert second.metrics.num_generated_tokens == 8 and first.metrics.num_generated_tokens == 16


def test_the_bench_method_runs_one_engine_per_drafter_and_equals_generate(target):
    engine = method_engine(target, "ngram", gamma=3, max_model_len=64)
    assert engine.max_num_seqs == 1 and engine.drafter_name == "ngram"
    run = engine_method(engine, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(PROMPTS[:3]):
        result = run(Prompt("toy", i, ids), 7, 8)
        alone = specdec.generate(target, [ids], drafter="ngram", gamma=3, seed=7, **GREEDY)
        assert result.token_ids == alone.token_ids[0]
        assert result.metrics.num_generated_tokens == 8


@pytest.mark.parametrize(
    ("options", "word"),
    [
        ({"arrival": "poisson"}, "arrival"),
        ({"concurrency": 0}, "concurrency"),
        ({"concurrency": True}, "concurrency"),
        ({"seeds": [1]}, "seeds"),
    ],
)
def test_bad_arguments_are_refused_by_name(target, options, word):
    with pytest.raises(ValueError, match=word):
        drive(_engine(target), PROMPTS[:2], GREEDY, **options)
