"""A request fails alone (:mod:`specdec.engine.faults`): a drafter, a verification rule, a stop-string
check or a target forward that raises for one chosen row finishes that request with
``finish_reason`` ``"error"`` and a message, and every other request emits what it emits alone."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from _engine_drive import Arrival, drive
from test_eagle_slots import (  # noqa: F401  (tiny: a fixture)
    MAX_LEN,
    PROMPTS,
    greedy,
    sampled,
    tiny,
)

import specdec
from specdec.engine import Engine
from specdec.verify.exact import ExactVerify

pytestmark = pytest.mark.usefixtures("one_thread")

CHOSEN = 2  # the request that fails
LENGTHS = [9, 4, 12, 5, 7]


def _arrivals(settings) -> list[Arrival]:
    """Five requests on three rows arriving at steps 0..4; the chosen one has seed 999 (greedy too:
    the faulty rule below finds its row by its seed)."""
    out = []
    for i, n in enumerate(LENGTHS):
        s = settings(i, n)
        out.append(Arrival(i, i, PROMPTS[i], {**s, "seed": 999} if i == CHOSEN else s))
    return out


def _engine(model: dict[str, Any], drafter: str, **options: Any) -> Engine:
    return Engine(
        model["target"],
        drafter=drafter,
        drafter_options={"weights": model["weights"]} if "eagle" in drafter else {},
        gamma=3,
        max_num_seqs=3,
        max_model_len=MAX_LEN,
        measure_cost=False,
        **options,
    )


def _assert_failed_alone(finals: dict, settings, model: dict[str, Any], alone, message: str) -> None:
    """The chosen request failed with ``message``; every other one equals its solo run: plain decoding
    for greedy ones, itself alone in an engine of its own (``alone()``) for seeded sampled ones."""
    failed = finals[CHOSEN]
    assert failed.finished and failed.finish_reason == "error"
    assert message in failed.error, failed.error
    for a in _arrivals(settings):
        if a.key == CHOSEN:
            continue
        if settings is greedy:
            solo = specdec.generate(model["target"], [a.prompt], drafter="none", **a.settings).token_ids[0]
        else:
            solo = drive(alone(), [Arrival(0, a.key, a.prompt, a.settings)])[a.key].token_ids
        assert finals[a.key].finish_reason == "length", a.key
        assert finals[a.key].token_ids == solo, a.key
        assert finals[a.key].error is None


def _chosen_slot(engine: Engine) -> int | None:
    request = next((r for r in engine.requests.values() if r.params.seed == 999), None)
    return None if request is None else request.slot


@pytest.mark.parametrize("drafter", ["eagle", "ngram-eagle", "none"])
@pytest.mark.parametrize("settings", [greedy, sampled])
def test_a_drafter_that_raises_for_one_row(tiny, drafter, settings):  # noqa: F811
    engine = _engine(tiny, drafter)
    propose = engine.drafter.propose
    calls = []

    def faulty(call):
        calls.append(call.size)
        if _chosen_slot(engine) in call.slots and len(engine.requests[_key(engine)].generated) >= 2:
            raise RuntimeError("injected drafter fault")
        return propose(call)

    engine.drafter.propose = faulty
    finals = drive(engine, _arrivals(settings))
    if drafter != "none":
        assert max(calls) > 1  # the fault struck a call of several rows
    _assert_failed_alone(finals, settings, tiny, lambda: _engine(tiny, drafter), "injected drafter fault")
    assert "drafting failed: RuntimeError" in finals[CHOSEN].error
    assert not engine.has_unfinished() and len(engine.free_rows) == 3


def _key(engine: Engine) -> str:
    return next(k for k, r in engine.requests.items() if r.params.seed == 999)


class FaultyRule(ExactVerify):
    """The exact rule, raising for the row of seed 999 once it decides its fourth output token."""

    name = "faulty"

    def __call__(self, target_probs_BKV, draft_tokens_BK, draft_probs_BKV, **kwargs):
        noise, positions = kwargs.get("noise"), kwargs.get("positions_BK")
        if noise is not None and positions is not None:
            hit = (noise.seeds_B == 999) & (positions.amin(dim=1) >= 3)
            if bool(hit.any()):
                raise RuntimeError("injected rule fault")
        return super().__call__(target_probs_BKV, draft_tokens_BK, draft_probs_BKV, **kwargs)


@pytest.mark.parametrize("settings", [greedy, sampled])
def test_a_rule_that_raises_for_one_row(tiny, settings):  # noqa: F811
    engine = _engine(tiny, "eagle", verify=FaultyRule())
    finals = drive(engine, _arrivals(settings))
    _assert_failed_alone(
        finals, settings, tiny, lambda: _engine(tiny, "eagle", verify=FaultyRule()), "injected rule fault"
    )
    assert "the verification rule failed" in finals[CHOSEN].error
    assert len(finals[CHOSEN].token_ids) >= 3  # it failed mid-way, keeping what it had


@pytest.mark.parametrize("settings", [greedy, sampled])
def test_a_stop_string_check_that_raises_for_one_row(tiny, settings):  # noqa: F811
    """The chosen request's stop-string check raises once it has 3 tokens (its tokenizer, say)."""
    engine = _engine(tiny, "eagle")

    class Boom:
        def first_stop(self, tokens, num_old):
            if len(tokens) >= 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected stop-string fault")
            return None

    arrivals = _arrivals(settings)

    def before_step(step: int) -> None:
        for r in engine.requests.values():
            if r.params.seed == 999:
                r.stops = Boom()

    finals = drive(engine, arrivals, before_step=before_step)
    _assert_failed_alone(finals, settings, tiny, lambda: _engine(tiny, "eagle"), "injected stop-string fault")
    assert "the commit" in finals[CHOSEN].error


def test_a_target_forward_that_raises_for_one_row(tiny):  # noqa: F811
    """A verify forward that raises whenever the chosen row is in it: each row's forward again alone
    (the same cache entries), the chosen one fails; then a prefill forward likewise."""
    target = tiny["target"]
    engine = _engine(tiny, "eagle")
    forward = target.forward

    def faulty(tokens_BT, start_B, **kwargs):
        slot = _chosen_slot(engine)
        rows = kwargs.get("rows_B")
        request = engine.requests.get(_key(engine)) if slot is not None else None
        if rows is not None and slot in rows.tolist() and request is not None and len(request.generated) >= 2:
            raise RuntimeError("injected forward fault")
        return forward(tokens_BT, start_B, **kwargs)

    target.forward = faulty
    try:
        finals = drive(engine, _arrivals(greedy))
    finally:
        del target.forward
    _assert_failed_alone(finals, greedy, tiny, lambda: _engine(tiny, "eagle"), "injected forward fault")
    assert "the target's verify forward failed" in finals[CHOSEN].error


def test_a_prompt_too_small_for_float32_top_p_is_refused():
    """``top_p`` that is 0 in float32 (1e-320) is refused at the boundary, as such a temperature is;
    and a top-p mask never empties a row."""
    with pytest.raises(ValueError, match="top_p must be at least"):
        specdec.sampling.SamplingParams(temperature=1.0, top_p=1e-320)
    probs = specdec.sampling.logits_to_probs(torch.tensor([[0.0, 1.0, 2.0]]), 1.0, None, 2.0**-149)
    assert probs.tolist() == [[0.0, 0.0, 1.0]]


def test_the_engine_answers_a_failed_request_and_goes_on(tiny):  # noqa: F811
    """The failed request's output is reported once, with its message; the engine then holds none of
    it (its row is free) and later requests run."""
    engine = _engine(tiny, "none")
    rid = engine.add_request(PROMPTS[0], max_new_tokens=6, temperature=0.0, ignore_eos=True, seed=999)
    engine.step()  # prefilled: decoding from the next step
    engine.requests[rid].stops = type("S", (), {"first_stop": lambda *a: 1 / 0})()
    (out,) = engine.step()
    assert out.request_id == rid and out.finish_reason == "error" and "ZeroDivisionError" in out.error
    assert rid not in engine.requests and len(engine.free_rows) == 3
    later = engine.add_request(PROMPTS[1], max_new_tokens=4, temperature=0.0, ignore_eos=True)
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == later and o.error is None


def test_a_second_engine_on_a_busy_target_is_refused(tiny):  # noqa: F811
    """Each engine holds its target's KV cache: a second one (or ``specdec.generate``) while the first
    has requests would reset it under them, so it is refused; once the first is idle it is allowed,
    and the first takes the cache back at its next step."""
    target = tiny["target"]
    first = _engine(tiny, "none")
    first.add_request(PROMPTS[0], max_new_tokens=4, temperature=0.0, ignore_eos=True)
    first.step()
    with pytest.raises(ValueError, match="in use by another Engine"):
        _engine(tiny, "none")
    with pytest.raises(ValueError, match="in use by another Engine"):
        specdec.generate(target, [PROMPTS[1]], drafter="none", max_new_tokens=3, temperature=0.0)
    while first.has_unfinished():
        first.step()
    second = _engine(tiny, "none")  # the first is idle
    alone = specdec.generate(target, [PROMPTS[1]], drafter="none", max_new_tokens=3, temperature=0.0)
    rid = first.add_request(PROMPTS[1], max_new_tokens=3, temperature=0.0)
    got = []
    while first.has_unfinished():
        got += [t for o in first.step() for t in o.new_token_ids]
    assert got == alone.token_ids[0]
    assert rid not in first.requests
    del second


@pytest.mark.parametrize("device_paths", [False, True], ids=["host", "device-paths"])
def test_a_prefill_chunk_with_bad_logits_fails_its_row_alone(tiny, device_paths):  # noqa: F811
    """Non-finite logits at a prompt position a prefill returns (every position, for prompt
    log-probabilities) fail that request alone: checked on the host at once, or with the step's one
    read on the accelerator's paths; the other request equals its solo run."""
    from specdec.host_sync import accelerator_paths

    target = tiny["target"]
    engine = _engine(tiny, "none")
    forward = target.forward

    def poisoned(tokens_BT, start_B, **kwargs):
        out = forward(tokens_BT, start_B, **kwargs)
        slot, rows = _chosen_slot(engine), kwargs.get("rows_B")
        if kwargs.get("logits_index_BN") is not None and rows is not None and slot in rows.tolist():
            out.logits_BTV[rows.tolist().index(slot), 0, 3] = float("nan")
        return out

    settings = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True, "prompt_logprobs": 0}
    arrivals = [
        Arrival(0, "bad", PROMPTS[0], {**settings, "seed": 999}),
        Arrival(0, "good", PROMPTS[1], settings),
    ]
    target.forward = poisoned
    try:
        with accelerator_paths() if device_paths else contextlib.nullcontext():
            finals = drive(engine, arrivals)
    finally:
        del target.forward
    assert finals["bad"].finish_reason == "error" and "non-finite logits" in finals["bad"].error
    alone = drive(_engine(tiny, "none"), [Arrival(0, "good", PROMPTS[1], settings)])["good"]
    assert finals["good"].token_ids == alone.token_ids and finals["good"].error is None
    assert finals["good"].prompt_logprobs == alone.prompt_logprobs
