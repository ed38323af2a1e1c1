"""A run's ``result.json`` read back: its structure checked, its fields named when a summary misreads them.

- :func:`read_result` checks the file's structure (``{"run_id": str, "result": {...}}``) and raises
  ``ValueError`` naming the file and the field on anything else, a file that is not JSON included.
- The result it returns is a :class:`ResultFields`: a plain ``dict`` (nested objects too) except that
  asking for a field it lacks raises :class:`ResultFieldError`, a ``KeyError`` that is also a
  ``ValueError`` and names the file and the field (``result.methods[2].speedup``).
- :func:`odd_fields` finds the runs whose results differ in structure from the other runs of their
  config type (a field missing, or a string where the others have a number): what the runner names
  when an experiment's ``summarize`` fails with a ``TypeError`` on them.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ResultFieldError", "ResultFields", "read_json", "read_result", "odd_fields"]


class ResultFieldError(ValueError, KeyError):
    """A field a summary asked for is not in a run's ``result.json`` (the message names both)."""

    __str__ = ValueError.__str__  # KeyError's own would print the message in quotes


class ResultFields(dict):
    """A run's result (or an object inside it): a ``dict`` whose missing fields raise a named error."""

    def __init__(self, data: Mapping[str, Any], path: Path, where: str) -> None:
        super().__init__((k, _wrap(v, path, f"{where}.{k}")) for k, v in data.items())
        self._path = path
        self._where = where

    def __missing__(self, key: Any) -> Any:
        raise ResultFieldError(
            f"{self._path}: field {self._where}.{key} is missing (fields there: {sorted(self)}); "
            "redo the run (delete its folder) or fix the experiment's summarize"
        )


def _wrap(value: Any, path: Path, where: str) -> Any:
    if isinstance(value, Mapping):
        return ResultFields(value, path, where)
    if isinstance(value, list):
        return [_wrap(v, path, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def read_json(path: Path) -> Any:
    """The JSON value in the file at ``path``; ``ValueError`` naming the file if it cannot be read."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read the file ({err})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None


def read_result(path: Path, run_id: str) -> ResultFields:
    """The ``result`` of the ``result.json`` at ``path`` of run ``run_id``, its structure checked."""
    path = Path(path)
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: expected a JSON object with fields run_id and result, got {_article(_kind(data))}"
        )
    for name, kind in (("run_id", str), ("result", dict)):
        if name not in data:
            raise ValueError(f"{path}: field {name} is missing (fields: {sorted(data)})")
        if not isinstance(data[name], kind):
            expected = "a string" if kind is str else "an object"
            raise ValueError(f"{path}: field {name} must be {expected}, got {_article(_kind(data[name]))}")
    if data["run_id"] != run_id:
        raise ValueError(f"{path}: field run_id is {data['run_id']!r}, expected {run_id!r}")
    return ResultFields(data["result"], path, "result")


def _kind(value: Any) -> str:
    """The JSON kind of a value: object, array, string, number, bool or null."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _shape(value: Any, where: str, out: dict[str, str]) -> dict[str, str]:
    """``field path -> JSON kind`` for every field of a result (array items merged as ``[]``)."""
    out[where] = _kind(value)
    if isinstance(value, Mapping):
        for key, item in value.items():
            _shape(item, f"{where}.{key}", out)
    elif isinstance(value, list):
        for item in value:
            _shape(item, f"{where}[]", out)
    return out


def odd_fields(results: Sequence[tuple[Path, str, Mapping[str, Any]]]) -> list[str]:
    """Each field where a result differs from most results of its group, as ``"FILE: field F is ..."``.

    ``results`` holds ``(result.json path, group, result)``; a group (a config type) is compared
    only within itself, and only when it has two results or more. Null is never odd, either way
    (runs return null for what they could not measure), and nothing under an odd or null field is
    named again.
    """
    groups: dict[str, list[tuple[Path, dict[str, str]]]] = {}
    for path, group, result in results:
        groups.setdefault(group, []).append((path, _shape(result, "result", {})))
    odd: list[str] = []
    for members in groups.values():
        if len(members) < 2:
            continue
        covered: list[list[str]] = [[] for _ in members]  # per result: fields odd or null so far
        for field in sorted({f for _, shape in members for f in shape}):  # a parent before its fields
            kinds = [shape.get(field, "missing") for _, shape in members]
            counts = Counter(k for k in kinds if k != "null")
            usual, count = counts.most_common(1)[0] if counts else ("null", 0)
            for (path, _), kind, done in zip(members, kinds, covered, strict=True):
                if any(field.startswith(parent + ".") or field.startswith(parent + "[]") for parent in done):
                    continue
                if kind == "null" or (kind != usual and count * 2 > len(members)):
                    done.append(field)
                    if kind != "null":
                        odd.append(f"{path}: field {field} {_differs(kind, usual)}")
    return odd


def _differs(kind: str, usual: str) -> str:
    if usual == "missing":
        return f"is {_article(kind)}, and the other runs have no such field"
    if kind == "missing":
        return f"is missing (the other runs: {_article(usual)})"
    return f"is {_article(kind)} (the other runs: {_article(usual)})"


def _article(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"
