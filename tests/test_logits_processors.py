# ruff: noqa: F811  (fixtures imported from other test modules are test parameters here)
"""Logits processors (:mod:`specdec.logits`): their definitions against transformers' and OpenAI's, and
exactness under speculation in the engine: greedy requests with processors equal plain decoding with
the same processors for every drafter, while requests join and leave and their neighbours process
differently (or not at all); seeded sampled requests equal themselves alone.

The distribution checks are ``tests/statistical/test_processor_distribution.py``; structured output on
the real model is ``tests/test_structured_output.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _engine_drive import Arrival, drive
from _tiny import save_tiny_checkpoint
from test_eagle_slots import MAX_LEN, PROMPTS, tiny  # noqa: F401  (tiny: a fixture)
from test_engine_every_drafter import toy_corpus  # noqa: F401  (a fixture)
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

import specdec
from specdec.engine import Engine
from specdec.logits import GrammarSpec, Processors
from specdec.sampling import SamplingParams, sampling_probs

pytestmark = pytest.mark.usefixtures("one_thread")

V = 64
PROMPT = [3, 9, 9, 40, 5]


def _logits(seed: int = 0, T: int = 1) -> torch.Tensor:
    return torch.randn(T, V, generator=torch.Generator().manual_seed(seed)) * 3


def _processed(sampling: SamplingParams, output: list[int], path: list[int], stop=(), seed=0) -> torch.Tensor:
    p = Processors(sampling, PROMPT, vocab_size=V, stop_ids=stop)
    p.commit(output)
    return p.process(_logits(seed), [path])[0]


# --- definitions ------------------------------------------------------------------------------------


def test_repetition_penalty_is_transformers_over_prompt_and_output():
    output, path = [7, 12], [9, 30]
    got = _processed(SamplingParams(repetition_penalty=1.7), output, path)
    ids = torch.tensor([PROMPT + output + path])
    want = RepetitionPenaltyLogitsProcessor(1.7)(ids, _logits()[:1].clone())[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_presence_and_frequency_penalties_are_openais_over_the_output():
    output, path = [7, 12, 7], [30, 7]
    got = _processed(SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25), output, path)
    counts = torch.bincount(torch.tensor(output + path), minlength=V).float()
    want = _logits()[0] - 0.5 * (counts > 0).float() + 0.25 * counts  # prompt tokens not counted
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_logit_bias_adds_and_minus_100_bans():
    got = _processed(SamplingParams(logit_bias={4: 2.5, "8": -100, 11: -99}), [], [])
    want = _logits()[0].clone()
    want[4] += 2.5
    want[11] -= 99
    want[8] = float("-inf")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert sampling_probs(got[None], SamplingParams())[0, 8] == 0


@pytest.mark.parametrize("n_out", [0, 1, 2, 3])
def test_min_tokens_bans_the_stop_tokens_as_transformers(n_out):
    output = [7, 12, 30][:n_out]
    got = _processed(SamplingParams(min_tokens=3), output[:1], output[1:], stop=(2, 5))
    ids = torch.tensor([PROMPT + output])
    want = MinNewTokensLengthLogitsProcessor(len(PROMPT), 3, [2, 5])(ids, _logits()[:1].clone())[0]
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)])


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_is_transformers_after_temperature(min_p):
    logits = _logits(3)
    got = sampling_probs(logits, SamplingParams(temperature=0.7, min_p=min_p))
    warped = MinPLogitsWarper(min_p)(None, logits / 0.7)
    torch.testing.assert_close(got, torch.softmax(warped, -1), rtol=1e-5, atol=1e-7)
    assert 1 < int((got > 0).sum()) < V


def test_each_position_sees_its_own_path():
    """A block's position t is processed with the committed output and the drafts before t: row t of
    one call equals a call for that position alone."""
    s = SamplingParams(presence_penalty=1.0, repetition_penalty=1.3, min_tokens=3, logit_bias={5: 1.0})
    p = Processors(s, PROMPT, vocab_size=V, stop_ids=(2,))
    p.commit([7])
    drafts = [12, 7, 2]
    logits = _logits(1, T=4)
    block = p.process(logits, [drafts[:t] for t in range(4)])
    for t in range(4):
        alone = p.process(logits[t : t + 1], [drafts[:t]])
        torch.testing.assert_close(block[t : t + 1], alone, rtol=0, atol=0)
    assert not torch.equal(block[0], block[2])  # the path changes the processing


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5), ("frequency_penalty", float("nan")), ("repetition_penalty", 0),
        ("logit_bias", {1: 101}), ("logit_bias", {-1: 1.0}), ("logit_bias", [1, 2]), ("min_tokens", -1),
        ("min_p", 1.5),
    ],
)  # fmt: skip
def test_bad_settings_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_plugin_processor_must_return_a_row():
    p = Processors(SamplingParams(), PROMPT, vocab_size=V, custom=[lambda prompt, out, row: row[:3]])
    with pytest.raises(ValueError, match="logits processor must return"):
        p.process(_logits(), [[]])


def test_a_draft_position_is_processed_as_the_target_position_over_the_draft_vocabulary():
    """``process_draft`` over a draft vocabulary equals the full row's processing, read at its columns
    (the row outside it at −inf); a position where the processors allow none of it reads None."""
    sampling = SamplingParams(repetition_penalty=1.5, presence_penalty=0.7, logit_bias=((5, 2.0), (11, -100)))
    p = Processors(sampling, PROMPT, vocab_size=V)
    p.commit([5, 7])
    vocab_N = torch.tensor([2, 5, 7, 11, 30, 40])
    full_V = torch.full((V,), float("-inf"))
    full_V[vocab_N] = _logits(3)[0, vocab_N]
    path = [30, 5]
    want = p.process(full_V.unsqueeze(0), [path])[0, vocab_N]
    torch.testing.assert_close(p.process_draft(_logits(3)[0, vocab_N], path, vocab_N), want)
    torch.testing.assert_close(p.process_draft(_logits(3)[0], path), p.process(_logits(3), [path])[0])
    banned = Processors(
        SamplingParams(logit_bias=tuple((int(t), -100.0) for t in vocab_N)), PROMPT, vocab_size=V
    )
    assert banned.process_draft(_logits(3)[0, vocab_N], [], vocab_N) is None


# --- exact under speculation, under load ------------------------------------------------------------


def no_repeat(prompt_ids, output_ids, logits_V):
    """A plugin's processor: the last generated token may not come again at once."""
    if output_ids:
        logits_V = logits_V.clone()
        logits_V[output_ids[-1]] = float("-inf")
    return logits_V


CONTROLS: list[dict[str, Any]] = [
    {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.4},
    {},  # a neighbour without processors
    {"logit_bias": {20: 4.0, 21: -100, 22: -100}, "min_tokens": 6, "eos_token_ids": [27]},
    {"logits_processors": [no_repeat], "min_p": 0.1},
    {"repetition_penalty": 2.0, "logit_bias": {25: 2.0}},
]
LENGTHS = [9, 4, 12, 7, 10]


def _arrivals(temperature: float) -> list[Arrival]:
    out = []
    for i, (controls, n) in enumerate(zip(CONTROLS, LENGTHS, strict=True)):
        settings = {"max_new_tokens": n, "temperature": temperature, "seed": 50 + i, "ignore_eos": True}
        settings |= controls
        if "eos_token_ids" in controls:
            settings["ignore_eos"] = False
        if temperature:
            settings["top_k"] = 30
        out.append(Arrival(i, i, PROMPTS[i], settings))
    return out


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory) -> str:
    """A second tiny Llama, the ``model`` drafter's draft model."""
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("draft") / "draft", num_layers=2, seed=4))


def _engine(tiny, drafter: str, draft_model: str | None = None) -> Engine:  # noqa: F811
    options = {"weights": tiny["weights"]} if "eagle" in drafter else {}
    options |= {"sources": ["toy"]} if drafter in ("unigram", "bigram") else {}
    options |= {"model": draft_model, "backend": "llama"} if drafter == "model" else {}
    return Engine(
        tiny["target"], drafter=drafter, drafter_options=options, gamma=3, max_num_seqs=3,
        max_model_len=MAX_LEN, measure_cost=False,
    )  # fmt: skip


DRAFTERS = [
    "none",
    "ngram",
    "unigram",
    "bigram",
    "model",
    "qself",
    "layerskip",
    "eagle",
    "eagle-tree",
    "ngram-eagle",
    "ngram-eagle-tree",
    "ngram-eagle-auto",
]  # fmt: skip  (``model`` needs a draft model: tests/test_engine_drafters.py's fixture)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_with_processors_equals_plain_decoding_for_every_drafter(
    tiny,
    toy_corpus,
    draft_model,
    drafter,
):
    finals = drive(_engine(tiny, drafter, draft_model), _arrivals(0.0))
    target = tiny["target"]
    changed = 0
    for a in _arrivals(0.0):
        plain = specdec.generate(target, [a.prompt], drafter="none", **a.settings).token_ids[0]
        assert finals[a.key].token_ids == plain, (drafter, a.key)
        bare = {k: v for k, v in a.settings.items() if k in ("max_new_tokens", "temperature", "ignore_eos")}
        changed += plain != specdec.generate(target, [a.prompt], drafter="none", **bare).token_ids[0]
    assert changed >= 3  # the processors do change these outputs
    if drafter != "none":  # blocks of several positions were processed
        assert sum(f.metrics.num_drafted for f in finals.values()) > 0


@pytest.mark.parametrize("drafter", ["eagle", "eagle-tree"])
def test_seeded_sampled_requests_with_processors_equal_themselves_alone(tiny, drafter):  # noqa: F811
    finals = drive(_engine(tiny, drafter), _arrivals(0.9))
    for a in _arrivals(0.9):
        alone = drive(_engine(tiny, drafter), [Arrival(0, a.key, a.prompt, a.settings)])[a.key].token_ids
        assert finals[a.key].token_ids == alone, (drafter, a.key)


def test_min_tokens_and_bias_hold_in_the_output(tiny):  # noqa: F811
    a = _arrivals(0.0)[2]
    out = drive(_engine(tiny, "eagle"), [a])[a.key].token_ids
    assert 27 not in out[:6] and 21 not in out and 22 not in out


def _drafted(engine: Engine, arrival: Arrival) -> tuple[list[int], list[int]]:
    """The request's output, and every token the engine's drafter proposed for it."""
    proposed: list[int] = []
    propose = engine.drafter.propose

    def recording(call):
        proposal = propose(call)
        proposed.extend(proposal.tokens_T.tolist())
        return proposal

    engine.drafter.propose = recording
    return drive(engine, [arrival])[arrival.key].token_ids, proposed


@pytest.mark.parametrize("drafter", ["eagle", "model"])
def test_a_drafter_with_a_distribution_drafts_from_the_processed_one(tiny, draft_model, drafter):  # noqa: F811
    """Tokens a request's ``logit_bias`` bans are never drafted (the drafter's logits are processed at
    every draft position, ``DraftCall.processors``), and the output is plain decoding's."""
    settings = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    _, before = _drafted(_engine(tiny, drafter, draft_model), Arrival(0, 0, PROMPTS[0], settings))
    top = [t for t, _ in sorted(((t, before.count(t)) for t in set(before)), key=lambda x: -x[1])[:3]]
    assert top, "the drafter drafted nothing to ban"
    banned = settings | {"logit_bias": dict.fromkeys(top, -100)}
    out, after = _drafted(_engine(tiny, drafter, draft_model), Arrival(0, 0, PROMPTS[0], banned))
    assert after and not set(top) & set(after)
    target = tiny["target"]
    assert out == specdec.generate(target, [PROMPTS[0]], drafter="none", **banned).token_ids[0]


def test_add_request_refuses_bad_controls(tiny):  # noqa: F811
    engine = _engine(tiny, "none")
    with pytest.raises(ValueError, match="min_tokens must be at most max_new_tokens"):
        engine.add_request([1, 2], max_new_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="logit_bias: token id 999"):
        engine.add_request([1, 2], logit_bias={999: 1.0})
    with pytest.raises(ValueError, match="logits_processors"):
        engine.add_request([1, 2], logits_processors=[3])
    with pytest.raises(ValueError, match="grammar must be a specdec.logits.GrammarSpec"):
        engine.add_request([1, 2], grammar="{}")
    with pytest.raises(ValueError, match="guided_regex: the regex does not compile"):
        engine.add_request([1, 2], grammar=GrammarSpec("regex", "(ab", field="guided_regex"))
    assert not engine.has_unfinished()
