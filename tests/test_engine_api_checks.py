"""``Engine.add_request`` / ``Engine.abort`` at their boundary: a wrong type is a ``ValueError`` naming
the argument (never a raw ``TypeError``), numpy scalars count as the Python numbers they hold, an
automatic request id never collides with one a caller chose, a prompt that alone overflows the
context is blamed on the prompt, and an abort is reported exactly once.

A tiny random Llama (``tests/_tiny.py``), one per module; nothing here decodes more than a few tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _tiny import byte_tokenizer, save_tiny_checkpoint

from specdec.engine import Engine, RequestOutput
from specdec.engine.request import RequestStatus
from specdec.serve.errors import from_engine_error
from specdec.targets.llama import LlamaTarget

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LEN = 64
GAMMA = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> LlamaTarget:
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("api") / "tiny", tokenizer=byte_tokenizer())
    return LlamaTarget.from_pretrained(path)


def make_engine(target: Any) -> Engine:
    return Engine(
        target, drafter="ngram", gamma=GAMMA, max_num_seqs=2, max_model_len=MAX_LEN, measure_cost=False
    )


def run(engine: Engine) -> dict[str, list[RequestOutput]]:
    """Step until idle; every output, by request id."""
    seen: dict[str, list[RequestOutput]] = {}
    for _ in range(500):
        if not engine.has_unfinished():
            return seen
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"stop_strings": 5}, "stop_strings"),
        ({"stop_strings": 5.5}, "stop_strings"),
        ({"stop_strings": [b"x"]}, "stop_strings"),
        ({"stop_strings": {"a": 1}}, "stop_strings"),
        ({"eos_token_ids": 5}, "eos_token_ids"),
        ({"eos_token_ids": "5"}, "eos_token_ids"),
        ({"eos_token_ids": [5, None]}, "eos_token_ids"),
        ({"eos_token_ids": [True]}, "eos_token_ids"),
        ({"eos_token_ids": {"a": 1}}, "eos_token_ids"),
        ({"temperature": np.bool_(True)}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_k": np.float32(3.0)}, "top_k"),
        ({"top_p": np.float64(1.5)}, "top_p"),
        ({"max_new_tokens": np.float64(3.0)}, "max_new_tokens"),
    ],
)
def test_wrong_types_are_value_errors_naming_the_argument(target, options, name):
    engine = make_engine(target)
    with pytest.raises(ValueError, match=f"^{name}"):
        engine.add_request([1, 2, 3], **{"max_new_tokens": 4, **options})
    assert not engine.requests and engine.num_waiting == 0  # nothing half-added


def test_numpy_scalars_are_taken_as_python_numbers(target):
    """Numpy scalars where ints and floats go give the very request the Python numbers give."""
    settings = {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3, "max_new_tokens": 6}
    as_numpy = {
        "temperature": np.float32(0.7),  # not a Python float: float32(0.7) != 0.7 exactly
        "top_k": np.int64(5),
        "top_p": np.float64(0.9),
        "seed": np.uint64(3),
        "max_new_tokens": np.int32(6),
    }
    prompt = [5, 6, 7, 5, 6, 7]
    engine = make_engine(target)
    plain = engine.add_request(prompt, request_id="plain", **settings, eos_token_ids=[258])
    numpy = engine.add_request(
        np.array(prompt, dtype=np.int32),
        request_id="numpy",
        **as_numpy,
        eos_token_ids=np.array([258]),
    )
    listed = engine.add_request([np.int16(t) for t in prompt], request_id="listed", **settings)
    a, b = engine.requests[plain], engine.requests[numpy]
    assert b.prompt_ids == a.prompt_ids == engine.requests[listed].prompt_ids
    assert all(type(t) is int for t in b.prompt_ids)
    assert b.params.sampling.top_k == 5 and type(b.params.sampling.top_k) is int
    assert type(b.params.sampling.temperature) is float and b.params.sampling.temperature == float(
        np.float32(0.7)
    )
    assert b.params.eos_token_ids == a.params.eos_token_ids == frozenset({258})
    assert b.params.seed == a.params.seed and b.params.max_new_tokens == 6
    outs = run(engine)
    final = {rid: o[-1] for rid, o in outs.items()}
    assert final["plain"].token_ids == final["listed"].token_ids  # same settings: same tokens
    assert all(f.finished and len(f.token_ids) >= 1 for f in final.values())


def test_automatic_ids_never_collide_with_chosen_ones(target):
    engine = make_engine(target)
    chosen = [engine.add_request([1, 2], request_id=f"req-{i}", max_new_tokens=4) for i in (0, 1, 3)]
    automatic = [engine.add_request([1, 2], max_new_tokens=4) for _ in range(3)]  # no id given: none may fail
    assert len(set(chosen + automatic)) == 6 and not set(automatic) & set(chosen)
    assert all(rid in engine.requests for rid in chosen + automatic)
    with pytest.raises(ValueError, match="request_id 'req-0' is already"):
        engine.add_request(
            [1, 2], request_id="req-0", max_new_tokens=4
        )  # a caller's own duplicate is still refused


def test_abort_is_reported_once(target):
    """abort() returns the final output; no later step() returns that request again (waiting or
    running, and a second abort finds nothing)."""
    engine = make_engine(target)
    ids = [
        engine.add_request([i + 1] * 8, max_new_tokens=40, temperature=0.0, ignore_eos=True) for i in range(3)
    ]
    assert engine.num_waiting == 3
    seen: dict[str, list[RequestOutput]] = {}
    for _ in range(3):  # two rows run and emit tokens, the third waits
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    running, waiting = ids[0], ids[2]
    assert seen[running] and waiting not in seen
    assert engine.requests[waiting].status is RequestStatus.WAITING
    reports = {rid: engine.abort(rid) for rid in (running, waiting)}
    for rid, out in reports.items():
        assert out is not None and out.finished and out.finish_reason == "abort" and out.new_token_ids == []
        assert engine.abort(rid) is None  # already reported
    streamed = [t for o in seen[running] for t in o.new_token_ids]
    assert reports[running].token_ids == streamed and streamed
    rest = run(engine)
    assert running not in rest and waiting not in rest  # never again from step()
    assert rest[ids[1]][-1].finished and rest[ids[1]][-1].finish_reason != "abort"
    assert not engine.requests and len(engine.free_rows) == 2
    with pytest.raises(ValueError, match="request_id must be a string"):
        engine.abort(7)


def test_a_prompt_that_alone_overflows_is_blamed_on_the_prompt(target):
    engine = make_engine(target)
    room = MAX_LEN - (GAMMA + 1)  # prompt + new tokens
    with pytest.raises(ValueError, match="^max_new_tokens: the prompt") as err:
        engine.add_request([1] * (room - 5), max_new_tokens=6)
    api = from_engine_error(err.value)
    assert api.param == "max_tokens" and api.code == "context_length_exceeded"
    with pytest.raises(ValueError, match="^prompt_ids: the prompt") as err:
        engine.add_request([1] * MAX_LEN, max_new_tokens=1)  # no room left for one token
    api = from_engine_error(err.value)
    assert api.param == "prompt" and api.code == "context_length_exceeded"
    assert api.message.startswith(f"prompt: the prompt ({MAX_LEN} tokens)")
    # one new token is the prompt's last position's: no draft slots kept, the context fills
    engine.add_request([1] * (MAX_LEN - 1), max_new_tokens=1)  # exactly fits
    assert engine.num_waiting == 1
    with pytest.raises(ValueError, match="^max_new_tokens: the prompt"):
        engine.add_request([1] * room, max_new_tokens=2)  # two tokens decode: draft slots kept
