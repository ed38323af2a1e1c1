"""The sampling controls of a request body: ``min_p``, the penalties, ``logit_bias``, ``min_tokens`` and
structured output (``response_format``; vLLM's ``guided_json``, ``guided_regex``, ``guided_grammar``,
``guided_choice``), checked here (a 400 naming the field) and handed to ``Engine.add_request``
(:mod:`specdec.logits`). A grammar is compiled where the request enters the engine: one that does
not compile is a 400 naming its field (:func:`specdec.serve.errors.from_engine_error`).

``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any JSON object),
or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` (OpenAI's form;
``"schema"`` directly in ``response_format`` is taken too, as llama-server does). At most one
structured-output field per request.
"""

from __future__ import annotations

import math
import re
from typing import Any

from specdec.logits import GrammarSpec
from specdec.serve.errors import bad_request

__all__ = ["STRUCTURED_FIELDS", "parse_controls"]

STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice")


def _number(
    body: dict[str, Any], name: str, low: float, high: float, *, open_low: bool = False
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (open_low and value == low):
        what = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise bad_request(f"{name} must be a number in {what}, got {value!r:.80}", name)
    return float(value)


def _logit_bias(body: dict[str, Any], vocab_size: int) -> dict[int, float] | None:
    value = body.get("logit_bias")
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise bad_request(
            f"logit_bias must be an object of token id to bias, got {value!r:.80}", "logit_bias"
        )
    out = {}
    for key, bias in value.items():
        where = f"logit_bias.{key}"
        token = int(key) if isinstance(key, str) and key.isdigit() else key if isinstance(key, int) else None
        if token is None or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise bad_request(
                f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r:.40}", "logit_bias"
            )
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not -100 <= bias <= 100:
            raise bad_request(f"{where} must be a number in [-100, 100], got {bias!r:.40}", where)
        out[token] = float(bias)
    return out


def _response_format(value: Any) -> GrammarSpec | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request(
            "response_format must be an object with a type (text, json_object, json_schema), got "
            f"{value!r:.80}",
            "response_format",
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", field="response_format")
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type must be text, json_object or json_schema, got {kind!r:.40}",
            "response_format.type",
        )
    inner = value.get("json_schema")
    schema = inner.get("schema") if isinstance(inner, dict) else value.get("schema")
    if schema is None:
        raise bad_request(
            "response_format.json_schema.schema is required for type json_schema",
            "response_format.json_schema",
        )
    try:
        return GrammarSpec.json_schema(schema, field="response_format.json_schema")
    except ValueError as err:
        raise bad_request(str(err), "response_format.json_schema") from None


def _structured(body: dict[str, Any]) -> GrammarSpec | None:
    given = [f for f in STRUCTURED_FIELDS if body.get(f) is not None]
    if given == ["response_format"] or not given:
        return None if not given else _response_format(body["response_format"])
    if "response_format" in given and body["response_format"] == {"type": "text"}:
        given.remove("response_format")
    if len(given) > 1:
        raise bad_request(f"give at most one of {', '.join(given)}", given[1])
    name = given[0]
    value = body[name]
    try:
        if name == "guided_json":
            return GrammarSpec.json_schema(value, field=name)
        if name == "guided_choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError(
                    f"guided_choice must be a non-empty list of non-empty strings, got {value!r:.80}"
                )
            return GrammarSpec("regex", "|".join(f"({re.escape(c)})" for c in value), name)
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r:.80}")
        return GrammarSpec("regex" if name == "guided_regex" else "ebnf", value, name)
    except ValueError as err:
        raise bad_request(str(err), name) from None


def parse_controls(body: dict[str, Any], vocab_size: int, max_tokens: int) -> dict[str, Any]:
    """``Engine.add_request``'s keywords for the body's sampling controls (absent fields: none)."""
    out: dict[str, Any] = {
        "min_p": _number(body, "min_p", 0.0, 1.0),
        "presence_penalty": _number(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", -2.0, 2.0),
        "repetition_penalty": _number(body, "repetition_penalty", 0.0, math.inf, open_low=True),
        "logit_bias": _logit_bias(body, vocab_size),
    }
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        if (
            not isinstance(min_tokens, int)
            or isinstance(min_tokens, bool)
            or not 0 <= min_tokens <= max_tokens
        ):
            raise bad_request(
                f"min_tokens must be an integer in [0, max_tokens = {max_tokens}], got {min_tokens!r:.80}",
                "min_tokens",
            )
        out["min_tokens"] = min_tokens
    grammar = _structured(body)
    if grammar is not None:
        out["grammar"] = grammar
    return {k: v for k, v in out.items() if v is not None}
