"""Every registered drafter runs in the engine as its one slot drafter, requests joining and leaving at
every step (``none``, ``ngram``, ``eagle-tree``, ``ngram-eagle-tree``, ``unigram``, ``bigram``: each
written once, over engine slots, with no adapter between it and the engine).
Greedy requests equal plain decoding alone; seeded sampled requests equal themselves alone.

(``eagle``, ``ngram-eagle``, ``ngram-eagle-auto``: ``tests/test_eagle_slots.py``; ``model``, ``qself``,
``layerskip``: ``tests/test_engine_drafters.py``.)
"""

from __future__ import annotations

from typing import Any

import pytest
from _engine_drive import Arrival, drive
from test_eagle_slots import (  # noqa: F401  (tiny: a fixture)
    MAX_LEN,
    assert_solo_tokens,
    churn,
    greedy,
    sampled,
    tiny,
)

from specdec.drafters import ngram_lm
from specdec.drafters.request_slots import CohortSlots, RequestSlots
from specdec.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")

TOY_DOCS = ["abc abd abe " * 20, "the cat sat on the mat " * 10]


@pytest.fixture
def toy_corpus(monkeypatch, tmp_path):
    """A tiny corpus as the only source of ``unigram`` / ``bigram``, and a private cache dir."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(ngram_lm.CORPUS_SOURCES, "toy", lambda: list(TOY_DOCS))


def _options(model: dict[str, Any], drafter: str) -> dict[str, Any]:
    if "eagle" in drafter:
        return {"weights": model["weights"]}
    if drafter in ("unigram", "bigram"):
        return {"sources": ["toy"]}
    return {}


def _engine(model: dict[str, Any], drafter: str) -> Engine:
    return Engine(
        model["target"],
        drafter=drafter,
        drafter_options=_options(model, drafter),
        gamma=3,
        max_num_seqs=3,
        max_model_len=MAX_LEN,
        measure_cost=False,
    )


@pytest.mark.parametrize("drafter", ["none", "ngram", "eagle-tree", "ngram-eagle-tree", "unigram", "bigram"])
@pytest.mark.parametrize("settings", [greedy, sampled])
def test_every_drafter_runs_with_requests_joining_and_leaving(tiny, toy_corpus, drafter, settings):  # noqa: F811
    together = _engine(tiny, drafter)
    assert not isinstance(together.drafter, (CohortSlots, RequestSlots))
    finals = drive(together, churn(settings))
    assert not any(together.drafter.active)  # every slot dropped
    if drafter != "none":
        assert sum(f.metrics.num_drafted for f in finals.values()) > 0
    assert_solo_tokens(finals, settings, tiny["target"], lambda: _engine(tiny, drafter))


@pytest.mark.parametrize("settings", [greedy, sampled])
def test_a_request_may_turn_speculation_off(tiny, settings):  # noqa: F811
    """``add_request(speculative=False)``: that request never drafts while its neighbours do, and
    emits what it emits alone with no drafter (greedy: plain decoding; sampled: its keyed stream)."""
    engine = _engine(tiny, "eagle-tree")
    arrivals = churn(settings)
    off = arrivals[2]
    arrivals[2] = Arrival(off.step, off.key, off.prompt, {**off.settings, "speculative": False})
    finals = drive(engine, arrivals)
    assert finals[off.key].metrics.num_drafted == 0
    assert sum(f.metrics.num_drafted for k, f in finals.items() if k != off.key) > 0
    alone = drive(_engine(tiny, "none"), [Arrival(0, off.key, off.prompt, off.settings)])[off.key]
    assert finals[off.key].token_ids == alone.token_ids
    with pytest.raises(ValueError, match="speculative must be a bool"):
        engine.add_request(off.prompt, speculative="no")
