"""Reading experiment summaries (``paper/results/<experiment>.json``, schema ``specdec.summary/1``).

The paper reads these files and nothing else: it imports no project package and computes nothing.
The format is written by ``python -m experiments run NAME --publish`` (see docs/experiments.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

__all__ = ["SCHEMA", "load_summary", "load_summaries"]

SCHEMA = "specdec.summary/1"
_REQUIRED = {
    "experiment": str,
    "title": str,
    "command": str,
    "created_at": str,
    "smoke": bool,
    "complete": bool,
    "num_runs": int,
    "num_planned_runs": int,
    "machine": str,
    "tables": list,
    "figures": list,
}
_TABLE = {"name": str, "caption": str, "columns": list, "rows": list}
_COLUMN = {"key": str, "label": str, "format": str, "align": str}
_FIGURE = {"name": str, "caption": str, "xlabel": str, "ylabel": str, "series": list}
_SERIES = {"label": str, "x": list, "y": list, "style": str}


_IDENTIFIER = re.compile(r"[a-z0-9][a-z0-9-]*")
"""Names that become file names or LaTeX labels: ``experiment``, table and figure ``name``."""


def _identifier(value: str, where: str) -> None:
    if not _IDENTIFIER.fullmatch(value):
        raise ValueError(
            f"{where} must be an identifier ([a-z0-9-]+; file names come from it), got {value!r}"
        )


def _require(obj: Any, fields: dict[str, type], where: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(obj).__name__}")
    for key, kind in fields.items():
        if key not in obj:
            raise ValueError(f"{where} lacks the field {key!r}")
        if not isinstance(obj[key], kind):
            raise ValueError(f"{where}.{key} must be {kind.__name__}, got {type(obj[key]).__name__}")


def load_summary(path: Path) -> dict[str, Any]:
    """Read and check one summary; a malformed file raises ``ValueError`` naming the file and field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else None
        raise ValueError(f"{path}: expected schema {SCHEMA!r}, got {found!r}")
    _require(data, _REQUIRED, str(path))
    _identifier(data["experiment"], f"{path}: experiment")
    for kind, fields, parts, part_fields in (
        ("tables", _TABLE, "columns", _COLUMN),
        ("figures", _FIGURE, "series", _SERIES),
    ):
        for i, item in enumerate(data[kind]):
            where = f"{path}: {kind}[{i}]"
            _require(item, fields, where)
            _identifier(item["name"], f"{where}.name")
            for j, part in enumerate(item[parts]):
                _require(part, part_fields, f"{where}.{parts}[{j}]")
                if parts == "series" and len(part["x"]) != len(part["y"]):
                    raise ValueError(f"{where}.series[{j}]: x and y differ in length")
    return data


def load_summaries(results_dir: Path) -> dict[str, dict[str, Any]]:
    """Every ``*.json`` summary in ``results_dir`` by experiment name (sorted)."""
    results_dir = Path(results_dir)
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(results_dir.glob("*.json")):
        data = load_summary(path)
        if data["experiment"] in out:
            raise ValueError(f"{path}: a second summary for experiment {data['experiment']!r}")
        out[data["experiment"]] = data
    return out
