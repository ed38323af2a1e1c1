"""The one results schema: tables and figure data, with where and how they were made, as one JSON file.

Every result file of the project is a :func:`summary_document`: an experiment's summary (its
``summarize`` function turns finished runs into a :class:`Summary`; the runner writes
``<out>/<experiment>/summary.json`` and ``--publish`` copies it to ``paper/results/``), and the
benchmarks' files (``specdec bench``'s ``bench.json``, the MoE and kernel benchmarks), which add
their raw measurements beside the tables. ``python -m paper build`` reads ``paper/results/*.json``.
The JSON layout (``"schema": "specdec.summary/1"``)::

    {"schema", "experiment", "title", "description", "command", "created_at", "smoke", "complete",
     "num_runs", "num_planned_runs", "missing_run_ids", "machine", "env", "notes",
     "tables":  [{"name", "caption", "columns": [{"key", "label", "format", "align"}],
                 "rows": [{key: value}]}],
     "figures": [{"name", "caption", "xlabel", "ylabel", "logx", "logy", "ymin", "ymax",
                  "series": [{"label", "x": [...], "y": [...], "style", "group"}]}]}

``format`` is a Python format spec (``".2f"``) applied by the paper to numbers; ``style`` is one of
``line``, ``dashed``, ``markers``, ``line+markers``, ``step``; series with the same ``group`` share a
colour. ``notes`` is text, or a list of lines (a benchmark's notes). ``env`` holds the versions
and, as ``git_commit`` / ``git_dirty``, the commit the numbers come from.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "SCHEMA",
    "Column",
    "Table",
    "Series",
    "Figure",
    "Summary",
    "summary_document",
    "check_experiment_name",
    "utc_now",
    "atomic_write_text",
    "write_json",
    "write_results",
    "default_publish_dir",
    "publish_summary",
    "table_from_rows",
    "series_from_rows",
    "series_from_points",
]

SCHEMA = "specdec.summary/1"
SERIES_STYLES = ("line", "dashed", "markers", "line+markers", "step")


@dataclass(frozen=True, kw_only=True)
class Column:
    """A table column: the row key it shows, its LaTeX header, a format spec for numbers, alignment."""

    key: str
    label: str
    format: str = ""
    align: str = "r"

    def __post_init__(self) -> None:
        if self.align not in ("l", "c", "r"):
            raise ValueError(f"Column.align must be 'l', 'c' or 'r', got {self.align!r}")
        if self.format and not any(_formats(v, self.format) for v in (1, 1.0)):
            raise ValueError(f"Column.format must be a Python format spec for numbers, got {self.format!r}")


@dataclass(frozen=True, kw_only=True)
class Table:
    """A table: rows are mappings from column keys to values (missing keys print as a dash)."""

    name: str
    caption: str
    columns: tuple[Column, ...]
    rows: tuple[Mapping[str, Any], ...]

    def __post_init__(self) -> None:
        _check_name(self.name, "Table.name")
        object.__setattr__(self, "columns", tuple(self.columns))
        object.__setattr__(self, "rows", tuple(dict(r) for r in self.rows))


@dataclass(frozen=True, kw_only=True)
class Series:
    """One curve of a figure."""

    label: str
    x: tuple[float, ...]
    y: tuple[float, ...]
    style: str = "line"
    group: str | None = None

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"Series {self.label!r}: x has {len(self.x)} points, y has {len(self.y)}")
        if self.style not in SERIES_STYLES:
            raise ValueError(f"Series.style must be one of {SERIES_STYLES}, got {self.style!r}")
        object.__setattr__(self, "x", tuple(float(v) for v in self.x))
        object.__setattr__(self, "y", tuple(float(v) for v in self.y))


@dataclass(frozen=True, kw_only=True)
class Figure:
    """A line/marker plot given entirely by its data (the paper draws it; it computes nothing)."""

    name: str
    caption: str
    xlabel: str
    ylabel: str
    series: tuple[Series, ...]
    logx: bool = False
    logy: bool = False
    ymin: float | None = None
    ymax: float | None = None

    def __post_init__(self) -> None:
        _check_name(self.name, "Figure.name")
        object.__setattr__(self, "series", tuple(self.series))


@dataclass(frozen=True, kw_only=True)
class Summary:
    """What an experiment's ``summarize`` returns: tables, figures and notes."""

    title: str
    tables: tuple[Table, ...] = ()
    figures: tuple[Figure, ...] = ()
    notes: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Tables and figures as JSON values (the experiment-independent part of ``summary.json``)."""
        return {
            "title": self.title,
            "notes": self.notes,
            "tables": [asdict(t) for t in self.tables],
            "figures": [asdict(f) for f in self.figures],
            **({"extra": dict(self.extra)} if self.extra else {}),
        }


def utc_now() -> str:
    """The current UTC time in ISO 8601 with a ``Z`` suffix."""
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    return now.isoformat().replace("+00:00", "Z")


EXPERIMENT_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")
"""An experiment's name: the paper's file names and LaTeX labels come from it."""


def check_experiment_name(name: str, argument: str) -> None:
    """``ValueError`` naming ``argument`` unless ``name`` is an :data:`EXPERIMENT_NAME`."""
    if not EXPERIMENT_NAME.fullmatch(name):
        raise ValueError(f"{argument} must be a [a-z0-9-] name (file names come from it), got {name!r}")


def summary_document(
    *,
    experiment: str,
    summary: Summary,
    command: str,
    machine: str,
    env: Mapping[str, Any],
    description: str = "",
    smoke: bool = False,
    num_runs: int = 1,
    num_planned_runs: int | None = None,
    missing_run_ids: Sequence[str] = (),
    created_at: str | None = None,
) -> dict[str, Any]:
    """A results file's contents in the schema: ``summary``'s tables and figures with where they came
    from (``command``, ``machine``, ``env``, the time) and how complete they are."""
    check_experiment_name(experiment, "experiment")
    planned = num_runs if num_planned_runs is None else num_planned_runs
    return {
        "schema": SCHEMA,
        "experiment": experiment,
        "description": description,
        "command": command,
        "created_at": created_at or utc_now(),
        "smoke": smoke,
        "complete": not missing_run_ids and num_runs >= planned,
        "num_runs": num_runs,
        "num_planned_runs": planned,
        "missing_run_ids": list(missing_run_ids),
        "machine": machine,
        "env": dict(env),
        **summary.to_dict(),
    }


def _formats(value: float, spec: str) -> bool:
    try:
        format(value, spec)
    except ValueError:
        return False
    return True


def _check_name(name: str, argument: str) -> None:
    if not name or not all(ch.isalnum() or ch in "-_" for ch in name):
        raise ValueError(f"{argument} must be a non-empty [A-Za-z0-9_-] string (a file name), got {name!r}")


def _json_safe(value: Any) -> Any:
    """Replace non-finite floats by None so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file in the same folder, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)  # a plain file's mode, not mkstemp's owner-only 0600
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Any, *, indent: int = 2) -> None:
    """Atomically write ``data`` as indented, strict JSON (non-finite floats become null)."""
    atomic_write_text(path, json.dumps(_json_safe(data), indent=indent, allow_nan=False) + "\n")


def write_results(path: Path, document: Mapping[str, Any], markdown: str | None = None) -> list[Path]:
    """The one writer of result files (the benchmarks, ``specdec perplexity``, the experiments'
    benchmarks): ``document`` (a :func:`summary_document`, maybe with raw measurements beside its
    tables) as JSON at ``path`` and, given ``markdown``, that text beside it at ``path`` with the suffix
    ``.md``; each written atomically, so a reader (or an interrupted run) never sees half a file.
    Returns the paths written."""
    path = Path(path)
    write_json(path, document, indent=1)
    if markdown is None:
        return [path]
    md = path.with_suffix(".md")
    atomic_write_text(md, markdown if markdown.endswith("\n") else markdown + "\n")
    return [path, md]


def default_publish_dir() -> Path:
    """``paper/results`` of this checkout: where committed summaries live for ``python -m paper build``."""
    return Path(__file__).resolve().parent.parent / "paper" / "results"


def publish_summary(summary_path: Path, publish_dir: Path | None = None) -> Path:
    """Copy a ``summary.json`` to ``<publish_dir>/<experiment>.json``; smoke summaries are refused."""
    data = json.loads(Path(summary_path).read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{summary_path}: not a {SCHEMA} summary (schema={data.get('schema')!r})")
    if data.get("smoke"):
        raise ValueError(f"{summary_path} comes from a --smoke run; publish only full runs")
    target = Path(publish_dir or default_publish_dir()) / f"{data['experiment']}.json"
    write_json(target, data)
    return target


def table_from_rows(
    name: str, caption: str, columns: Sequence[tuple[str, str, str]], rows: Sequence[Mapping[str, Any]]
) -> Table:
    """Shorthand: columns as ``(key, label, format)`` triples (first column left-aligned)."""
    cols = tuple(
        Column(key=k, label=label, format=fmt, align="l" if i == 0 else "r")
        for i, (k, label, fmt) in enumerate(columns)
    )
    return Table(name=name, caption=caption, columns=cols, rows=tuple(rows))


def series_from_points(
    points: Sequence[tuple[float, float]],
    *,
    label: str,
    style: str = "line+markers",
    group: str | None = None,
) -> Series:
    """A figure curve through ``(x, y)`` points, in the order given."""
    return Series(label=label, x=[x for x, _ in points], y=[y for _, y in points], style=style, group=group)


def series_from_rows(
    rows: Sequence[Mapping[str, Any]],
    x: str,
    y: str,
    *,
    label: str,
    style: str = "line+markers",
    group: str | None = None,
) -> Series:
    """A figure curve from table rows: the points ``(row[x], row[y])`` of the rows where both are set."""
    pts = [(r[x], r[y]) for r in rows if r.get(x) is not None and r.get(y) is not None]
    return series_from_points(pts, label=label, style=style, group=group)
