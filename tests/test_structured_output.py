# ruff: noqa: F811  (fixtures imported from other test modules are test parameters here)
"""Structured output in the engine (:mod:`specdec.logits.grammar`, :mod:`specdec.engine.grammar_drafts`):
a request under a JSON schema or a regex emits what plain decoding (no drafts at all:
``speculative=False``) emits under the same grammar, for every drafter, while requests with and
without grammars join and leave; seeded sampled requests equal themselves alone; the grammar's forced
tokens are drafted for free and accepted; a finished grammar ends the request. On the tiny random
Llama (byte tokenizer), and on SmolLM2-135M with the default drafter (``model``).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from _engine_drive import Arrival, drive
from test_eagle_slots import MAX_LEN, PROMPTS, tiny  # noqa: F401  (tiny: a fixture)
from test_engine_every_drafter import toy_corpus  # noqa: F401  (a fixture)
from test_logits_processors import DRAFTERS, draft_model  # noqa: F401  (draft_model: a fixture)

from specdec.engine import Engine
from specdec.logits import GrammarSpec

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer"}},
    "required": ["colour", "size"],
    "additionalProperties": False,
}
GRAMMARS: list[GrammarSpec | None] = [
    GrammarSpec.json_schema(SCHEMA),
    None,  # a neighbour without a grammar
    GrammarSpec("regex", "(ab|cd)+[0-9]{2}"),
    GrammarSpec("json_object"),
    GrammarSpec("ebnf", 'root ::= "yes" | "no" | "maybe " [a-z]+'),
]
LENGTHS = [24, 6, 16, 20, 10]


def _arrivals(temperature: float, speculative: bool = True) -> list[Arrival]:
    out = []
    for i, (grammar, n) in enumerate(zip(GRAMMARS, LENGTHS, strict=True)):
        settings: dict[str, Any] = {"max_new_tokens": n, "temperature": temperature, "seed": 70 + i}
        settings |= {"grammar": grammar, "speculative": speculative}
        if temperature:
            settings["top_k"] = 40
        out.append(Arrival(i, i, PROMPTS[i], settings))
    return out


def _engine(tiny, drafter: str, slots: int = 3, draft_model: str | None = None) -> Engine:  # noqa: F811
    options = {"weights": tiny["weights"]} if "eagle" in drafter else {}
    options |= {"sources": ["toy"]} if drafter in ("unigram", "bigram") else {}
    options |= {"model": draft_model, "backend": "llama"} if drafter == "model" else {}
    return Engine(
        tiny["target"], drafter=drafter, drafter_options=options, gamma=3, max_num_seqs=slots,
        max_model_len=MAX_LEN, measure_cost=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plain(tiny):  # noqa: F811
    """Every arrival decoded alone with no drafts at all (free drafts off too)."""
    return {
        a.key: drive(_engine(tiny, "none", 1), [Arrival(0, a.key, a.prompt, a.settings)])[a.key]
        for a in _arrivals(0.0, speculative=False)
    }


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_under_a_grammar_equals_plain_decoding_for_every_drafter(
    tiny,
    toy_corpus,
    draft_model,
    plain,
    drafter,
):
    finals = drive(_engine(tiny, drafter, draft_model=draft_model), _arrivals(0.0))
    for key, alone in plain.items():
        assert finals[key].token_ids == alone.token_ids, (drafter, key)
        assert finals[key].finish_reason == alone.finish_reason
    assert finals[0].metrics.num_drafted > 0
    if "tree" not in drafter:  # a chain takes the schema's punctuation and keys as free drafts
        assert finals[0].metrics.num_accepted > 0
    assert plain[0].metrics.num_drafted == 0


def test_grammar_outputs_follow_their_grammars(tiny, plain):  # noqa: F811
    tok = tiny["target"].tokenizer
    text = {k: tok.decode(o.token_ids, skip_special_tokens=True) for k, o in plain.items()}
    assert text[0].startswith('{"colour": "')
    if plain[0].finish_reason != "length":
        assert json.loads(text[0])["colour"] in ("red", "green", "blue")
    assert re.fullmatch("(ab|cd)+[0-9]{0,2}", text[2])
    assert text[3].startswith("{")
    assert plain[4].finish_reason in ("eos", "grammar", "length")
    assert re.fullmatch("yes|no|maybe [a-z]*", text[4])


@pytest.mark.parametrize("drafter", ["ngram", "eagle-tree"])
def test_seeded_sampled_grammar_requests_equal_themselves_alone(tiny, drafter):  # noqa: F811
    finals = drive(_engine(tiny, drafter), _arrivals(0.9))
    for a in _arrivals(0.9):
        alone = drive(_engine(tiny, drafter), [Arrival(0, a.key, a.prompt, a.settings)])[a.key]
        assert finals[a.key].token_ids == alone.token_ids, (drafter, a.key)


def test_a_finished_grammar_ends_the_request(tiny):  # noqa: F811
    """With the end-of-sequence token ignored, a complete grammar still ends the request."""
    settings = {"max_new_tokens": 30, "temperature": 0.0, "ignore_eos": True}
    settings["grammar"] = GrammarSpec("regex", "ab[0-9]")
    final = drive(_engine(tiny, "ngram"), [Arrival(0, 0, PROMPTS[0], settings)])[0]
    assert final.finish_reason == "grammar"
    text = tiny["target"].tokenizer.decode(final.token_ids, skip_special_tokens=True)
    assert re.fullmatch("ab[0-9]", text)


@pytest.mark.model
def test_smollm2_json_schema_with_the_default_drafter_equals_plain_and_is_valid():
    import jsonschema
    import torch

    import specdec

    torch.set_num_threads(2)
    target = specdec.load_target("smollm2-135m")
    tok = target.tokenizer
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "Alice is 31 and lives in Paris. Describe her as JSON."}]
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)).input_ids
    grammar = GrammarSpec.json_schema(schema)
    outs = {}
    for drafter, speculative in (("none", False), ("default", True), ("eagle", True)):
        engine = specdec.Engine(target, drafter=drafter, gamma=4, max_num_seqs=1, measure_cost=False)
        settings = {"max_new_tokens": 64, "temperature": 0.0, "grammar": grammar, "speculative": speculative}
        outs[drafter] = drive(engine, [Arrival(0, 0, ids, settings)])[0]
    assert outs["default"].token_ids == outs["none"].token_ids == outs["eagle"].token_ids
    assert outs["default"].finish_reason == "eos"
    jsonschema.validate(json.loads(tok.decode(outs["default"].token_ids, skip_special_tokens=True)), schema)
    assert outs["default"].metrics.mean_accepted_tokens > 2.0


def test_the_bitmask_unpacking_equals_xgrammars_kernel():
    """The accelerator path's unpacking of the token bitmask masks what xgrammar's CPU kernel masks,
    bit 31 (the int32 sign) included."""
    import torch
    import xgrammar as xgr

    from specdec.logits.grammar import _bit, allowed_tokens

    V = 100
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (V + 31) // 32), dtype=torch.int32)
    bitmask[1, 0] = _bit(31)  # one token allowed in that word: the sign bit
    x = torch.randn(3, V)
    want = x.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=V)
    got = x.masked_fill(~allowed_tokens(bitmask, V), float("-inf"))
    assert torch.equal(got, want)
    assert bool(allowed_tokens(bitmask, V)[1, 31]) and not bool(allowed_tokens(bitmask, V)[1, 30])
