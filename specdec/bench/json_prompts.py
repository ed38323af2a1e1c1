"""The ``json`` prompt set of ``specdec bench-serve``: schema-constrained chat prompts, and the check of
what the servers answer to them.

For ``--num-prompts n`` the set holds 2n prompts, built from the records behind the held-out prompts
the ``humaneval`` and ``mtbench`` sets take for that n (:func:`specdec.prompt_sets.load_prompts`): first
the n HumanEval tasks, then the n MT-Bench questions, each a chat user turn with a small JSON schema
(Draft 2020-12; every object closed, every field required). The schema goes in the request body as
OpenAI's ``response_format``, ``{"type": "json_schema", "json_schema": {"name": ..., "schema": ...}}``,
the form both ``specdec serve`` and llama-server take on ``/v1/chat/completions``. The variant
alternates along each source's picks:

- HumanEval ``function``: "Describe the function below as JSON": ``function_name``, ``arguments``
  (``name`` and ``type`` of each), ``returns``, ``summary``;
- HumanEval ``examples``: "Give examples of calls to the function below as JSON": ``function_name``
  and 1 to 3 ``examples`` (``call``, ``result``);
- MT-Bench ``answer``: "Answer as JSON": ``topic`` (one of the eight MT-Bench categories),
  ``answer``, ``confidence`` (low, medium or high);
- MT-Bench ``outline``: "Outline an answer as JSON": ``title`` and 1 to 5 ``key_points``.

:func:`json_validity` judges a level's outputs: a completed request whose finish reason is
``"stop"`` counts as valid when its full text parses as JSON and validates against its schema
(``jsonschema``), else invalid; one that hit ``max_tokens`` (``"length"``) counts apart, whatever its
text.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SchemaPrompt",
    "SCHEMA_PROMPT_SETS",
    "MTBENCH_TOPICS",
    "json_prompts",
    "load_schema_prompts",
    "schema_of",
    "is_valid_output",
    "json_validity",
]

MTBENCH_TOPICS = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
"""MT-Bench's eight question categories: the ``topic`` enum of the ``answer`` schema."""


def _closed(properties: dict[str, Any]) -> dict[str, Any]:
    """An object schema with every property required and no other property allowed."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


_STRING = {"type": "string"}
SCHEMAS: dict[str, dict[str, Any]] = {
    "function": _closed(
        {
            "function_name": _STRING,
            "arguments": {"type": "array", "items": _closed({"name": _STRING, "type": _STRING})},
            "returns": _STRING,
            "summary": _STRING,
        }
    ),
    "examples": _closed(
        {
            "function_name": _STRING,
            "examples": {
                "type": "array",
                "items": _closed({"call": _STRING, "result": _STRING}),
                "minItems": 1,
                "maxItems": 3,
            },
        }
    ),
    "answer": _closed(
        {
            "topic": {"enum": list(MTBENCH_TOPICS)},
            "answer": _STRING,
            "confidence": {"enum": ["low", "medium", "high"]},
        }
    ),
    "outline": _closed(
        {
            "title": _STRING,
            "key_points": {"type": "array", "items": _STRING, "minItems": 1, "maxItems": 5},
        }
    ),
}
"""The schemas by variant name (module doc); a prompt's schema is a copy of its variant's."""

_INSTRUCTIONS = {
    "function": "Describe the function below as JSON: its function_name, its arguments (the name and "
    "type of each), what it returns and a one-sentence summary.",
    "examples": "Give examples of calls to the function below as JSON: its function_name and one to "
    "three examples, each a call and its result.",
    "answer": "Answer the question below as JSON: its topic (one of "
    + ", ".join(MTBENCH_TOPICS)
    + "), your answer, and your confidence (low, medium or high).",
    "outline": "Outline an answer to the question below as JSON: a title and one to five key_points.",
}


@dataclass(frozen=True, kw_only=True)
class SchemaPrompt:
    """One prompt of a schema set: a chat user turn, where it comes from, and the JSON schema its answer
    must follow."""

    source: str
    """``humaneval/<task_id>`` or ``mtbench/<question_id>``."""
    variant: str
    """A key of :data:`SCHEMAS`; also the schema's ``name`` in ``response_format``."""
    prompt: str
    schema: Mapping[str, Any]

    def response_format(self) -> dict[str, Any]:
        """The request body's ``response_format``: OpenAI's ``json_schema`` form."""
        return {"type": "json_schema", "json_schema": {"name": self.variant, "schema": dict(self.schema)}}


def _picked(set_name: str, records: Sequence[dict], text_of: Callable[[dict], str], n: int) -> list[dict]:
    """The records behind the ``n`` prompts :func:`~specdec.prompt_sets.load_prompts` takes of a set
    (each prompt's text names one record), in its order."""
    from specdec.prompt_sets import load_prompts

    by_text = {text_of(r): r for r in records}
    return [by_text[text] for text in load_prompts(set_name, n)]


def _prompt(source: str, variant: str, subject: str) -> SchemaPrompt:
    text = f"{_INSTRUCTIONS[variant]}\n\n{subject}"
    return SchemaPrompt(source=source, variant=variant, prompt=text, schema=copy.deepcopy(SCHEMAS[variant]))


def json_prompts(num_prompts: int) -> list[SchemaPrompt]:
    """The ``json`` set for ``--num-prompts`` ``num_prompts``: 2 × ``num_prompts`` prompts (fewer when
    it exceeds a source's size: all of that source), HumanEval's first (module doc)."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    from specdec.prompt_sets import humaneval_tasks, mtbench_questions

    tasks = _picked("humaneval", humaneval_tasks(), lambda t: t["prompt"], num_prompts)
    questions = _picked("mtbench", mtbench_questions(), lambda q: q["turns"][0], num_prompts)
    return [
        _prompt(
            f"humaneval/{t['task_id']}",
            ("function", "examples")[i % 2],
            f"```python\n{t['prompt'].strip()}\n```",
        )
        for i, t in enumerate(tasks)
    ] + [
        _prompt(f"mtbench/{q['question_id']}", ("answer", "outline")[i % 2], q["turns"][0])
        for i, q in enumerate(questions)
    ]


SCHEMA_PROMPT_SETS: dict[str, Callable[[int], list[SchemaPrompt]]] = {"json": json_prompts}
"""Prompt sets whose requests carry a JSON schema: name → builder for ``--num-prompts``. Chat sets
(``--endpoint chat`` only)."""


def load_schema_prompts(name: str, num_prompts: int) -> list[SchemaPrompt]:
    """The prompts of a schema set for ``num_prompts``; a ``ValueError`` naming the known sets for an
    unknown one."""
    if name not in SCHEMA_PROMPT_SETS:
        raise ValueError(f"unknown schema prompt set {name!r}; known: {', '.join(SCHEMA_PROMPT_SETS)}")
    return SCHEMA_PROMPT_SETS[name](num_prompts)


def schema_of(response_format: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The JSON schema of a request body's ``response_format`` (OpenAI's ``json_schema`` form, or
    ``"schema"`` directly in it); None for none."""
    if not response_format or response_format.get("type") != "json_schema":
        return None
    inner = response_format.get("json_schema")
    schema = inner.get("schema") if isinstance(inner, Mapping) else response_format.get("schema")
    return schema if isinstance(schema, Mapping) else None


def is_valid_output(text: str, schema: Mapping[str, Any]) -> bool:
    """Whether ``text`` is one JSON value (surrounding whitespace allowed) that ``schema`` (Draft
    2020-12) accepts."""
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def json_validity(
    schemas: Sequence[Mapping[str, Any] | None], results: Sequence[Any]
) -> tuple[dict[str, int | None], list[bool | None]]:
    """A level's structured-output counts, and each result's verdict.

    ``schemas[i]``: the schema request ``i`` carried (None: none); ``results``: the level's
    :class:`~specdec.bench.serve_load.RequestResult` (``index`` into ``schemas``, ``ok``, ``text``,
    ``finish_reason``). Counts over the completed requests that carried a schema: ``json_valid``
    (finish reason ``"stop"``, text valid), ``json_invalid`` (``"stop"``, text not valid),
    ``json_length`` (``"length"``); all three None when no request carried one. Verdicts: True / False
    for a ``"stop"`` output with a schema, None for any other."""
    counts: dict[str, int | None] = {"json_valid": None, "json_invalid": None, "json_length": None}
    verdicts: list[bool | None] = [None] * len(results)
    if not any(s is not None for s in schemas):
        return counts, verdicts
    counts = {"json_valid": 0, "json_invalid": 0, "json_length": 0}
    for k, r in enumerate(results):
        schema = schemas[r.index]
        if schema is None or not r.ok:
            continue
        if r.finish_reason == "length":
            counts["json_length"] += 1
        elif r.finish_reason == "stop":
            verdicts[k] = is_valid_output(r.text, schema)
            counts["json_valid" if verdicts[k] else "json_invalid"] += 1
    return counts, verdicts
