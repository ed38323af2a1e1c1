"""``specdec serve``'s sampling controls through the official ``openai`` client: penalties,
``logit_bias``, ``min_p``, ``min_tokens`` and structured output (``response_format``, vLLM's
``guided_regex`` / ``guided_choice``) on a tiny random Llama with a byte tokenizer (``tests/_tiny.py``).
Greedy text with controls equals ``specdec.generate`` with the same controls; a schema-constrained
output that ends by itself is valid JSON for its schema; a schema or regex that does not compile is a
400 naming its field.
"""

from __future__ import annotations

import json
import re

import pytest
from _extras import SERVE, skip_module_without

skip_module_without(SERVE + ("openai", "jsonschema"))

import jsonschema  # noqa: E402
import openai  # noqa: E402
from test_serve import PROMPT, checkpoint, serving, target  # noqa: E402,F401  (fixtures)

import specdec  # noqa: E402
from specdec.logits import GrammarSpec  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
    "required": ["colour", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory, request):  # noqa: F811
    with serving(checkpoint, tmp_path_factory, request, "--gamma 3 --max-num-seqs 2 --api-key test-key") as s:
        yield s


def _text(target, tokens: list[int]) -> str:  # noqa: F811
    return target.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_penalties_bias_min_p_and_min_tokens_equal_generate(server, target):  # noqa: F811
    ids = list(target.tokenizer(PROMPT).input_ids)
    controls = {"presence_penalty": 1.2, "frequency_penalty": 0.4, "logit_bias": {"116": 5.0, "101": -100}}
    extra = {"repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 4}
    out = server.client().completions.create(
        model=server.model, prompt=PROMPT, max_tokens=24, temperature=0, **controls, extra_body=extra
    )
    bias = {int(k): v for k, v in controls["logit_bias"].items()}
    kw = {**controls, **extra, "logit_bias": bias}
    want = specdec.generate(target, [ids], drafter="none", max_new_tokens=24, temperature=0.0, **kw)
    assert out.choices[0].text == _text(target, want.token_ids[0])
    plain = specdec.generate(target, [ids], drafter="none", max_new_tokens=24, temperature=0.0)
    assert want.token_ids[0] != plain.token_ids[0]  # the controls change this text
    assert "e" not in out.choices[0].text  # 101 is "e" in the byte vocabulary: banned


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_is_valid_and_free_drafts_are_counted(server, target, stream):  # noqa: F811
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": SCHEMA}}
    kw = dict(model=server.model, messages=[{"role": "user", "content": "a flag"}], max_tokens=40)
    kw |= dict(temperature=0, response_format=fmt)
    if stream:
        chunks = list(
            client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        usage = chunks[-1].usage
    else:
        out = client.chat.completions.create(**kw)
        text, reason, usage = out.choices[0].message.content, out.choices[0].finish_reason, out.usage
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    extra = usage.model_extra or {}
    assert extra["num_draft_tokens"] > 0 and extra["num_accepted_tokens"] > 0  # the grammar's forced tokens


def test_json_object_regex_and_choice(server):
    client = server.client()
    base = dict(model=server.model, prompt=PROMPT, max_tokens=30, temperature=0)
    out = client.completions.create(**base, extra_body={"guided_regex": "(ab|cd)[0-9]{2}"})
    assert re.fullmatch("(ab|cd)[0-9]{2}", out.choices[0].text) and out.choices[0].finish_reason == "stop"
    out = client.completions.create(**base, extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].text in ("yes", "no")
    out = client.completions.create(**base, extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].text.lstrip().startswith("{")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
         "response_format.json_schema"),
        ({"guided_regex": "(ab"}, "guided_regex"),
        ({"guided_regex": "a", "guided_json": {"type": "string"}}, "guided_regex"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"logit_bias": {"999": 1}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"min_tokens": 50}, "min_tokens"),
    ],
)  # fmt: skip
def test_bad_controls_are_400s_naming_the_field(server, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=server.model, prompt=PROMPT, max_tokens=8, extra_body=body)
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body


def test_a_grammar_request_does_not_change_its_neighbours(server, target):  # noqa: F811
    """Two requests at once, one under a grammar: the other's greedy text equals it alone."""
    import concurrent.futures

    ids = list(target.tokenizer(PROMPT).input_ids)
    plain = _text(
        target,
        specdec.generate(target, [ids], drafter="none", max_new_tokens=20, temperature=0.0).token_ids[0],
    )
    client = server.client()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        a = pool.submit(
            client.completions.create, model=server.model, prompt=PROMPT, max_tokens=20, temperature=0,
            extra_body={"guided_regex": "[a-z ]{20}"},
        )  # fmt: skip
        b = pool.submit(
            client.completions.create, model=server.model, prompt=PROMPT, max_tokens=20, temperature=0
        )
        assert b.result().choices[0].text == plain
        assert re.fullmatch("[a-z ]{20}", a.result().choices[0].text)
    gram = GrammarSpec("regex", "[a-z ]{20}")
    alone = specdec.generate(target, [ids], drafter="none", max_new_tokens=20, temperature=0.0, grammar=gram)
    assert a.result().choices[0].text == _text(target, alone.token_ids[0])
