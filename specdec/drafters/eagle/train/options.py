"""Command-line options generated from a config dataclass: one flag per field, its default and help
taken from the class, so a CLI never repeats (and never drifts from) its config's defaults.

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, TrainConfig)
    cfg = config_from_args(TrainConfig, parser.parse_args())

A field ``text_tokens`` becomes ``--text-tokens``; fields of a nested config (``TrainConfig.data``)
are flattened (``--greedy-tokens``), and prefixed with the field's name where they would clash with
an outer one (``--data-seed``). Types: ``bool`` (``--x`` / ``--no-x``), ``int``, ``float`` (finite
only), ``str``, ``T | None``, and ``tuple[int, ...]`` / ``tuple[str, ...]`` (comma-separated; an
empty string is the empty tuple). The help text is the field's docstring.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from typing import Any, Union

from specdec.cli_args import csv, finite_float

__all__ = ["add_config_arguments", "config_from_args", "field_docs"]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None


def field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under a dataclass's fields (``name: type = default`` then a string)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:] + [None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(after, ast.Expr) and isinstance(getattr(after, "value", None), ast.Constant):
                docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def _base(annotation: Any) -> Any:
    """The annotation without ``| None``."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _parser_for(annotation: Any) -> Any:
    base = _base(annotation)
    if base is int:
        return _int
    if base is float:
        return finite_float
    if base is str:
        return str
    if typing.get_origin(base) is tuple:
        return csv(_int if typing.get_args(base)[0] is int else str)
    raise TypeError(f"no command-line type for config field type {annotation!r}")


def _walk(cls: type, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted path, annotation, doc) for every leaf field, nested configs flattened."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        annotation = hints[f.name]
        if dataclasses.is_dataclass(annotation):
            out += _walk(annotation, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, annotation, docs.get(f.name, "")))
    return out


def _flags(cls: type) -> dict[str, str]:
    """Dotted path → flag name (without dashes), nested names prefixed where they clash."""
    leaves = [path for path, *_ in _walk(cls)]
    short = [p.rsplit(".", 1)[-1] for p in leaves]
    return {
        p: (s if short.count(s) == 1 or "." not in p else p.replace(".", "_")).replace("_", "-")
        for p, s in zip(leaves, short, strict=True)
    }


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One option per leaf field of ``cls``."""
    defaults = cls()
    flags = _flags(cls)
    for path, annotation, doc in _walk(cls):
        default = defaults
        for part in path.split("."):
            default = getattr(default, part)
        flag, dest = "--" + flags[path], path.replace(".", "__")
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        help_text = f"{doc} (default: {shown})" if doc else f"(default: {shown})"
        help_text = help_text.replace("%", "%%")
        if _base(annotation) is bool:
            parser.add_argument(
                flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        else:
            parser.add_argument(
                flag, dest=dest, type=_parser_for(annotation), default=default, help=help_text
            )


def config_from_args(cls: type, args: argparse.Namespace, prefix: str = "") -> Any:
    """The ``cls`` config the parsed options describe, nested configs built from their own options
    (every config's own validation runs: ``ValueError``)."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            values[f.name] = config_from_args(hints[f.name], args, path + ".")
        elif hasattr(args, path.replace(".", "__")):
            values[f.name] = getattr(args, path.replace(".", "__"))
    return cls(**values)
