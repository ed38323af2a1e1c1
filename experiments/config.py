"""Typed experiment configs: validation, canonical JSON, stable run ids, and loading from YAML.

A config is a frozen, keyword-only dataclass whose fields are plain JSON values (bool, int, float, str,
None), tuples of them, or nested config dataclasses. Call :func:`validate_config` from the class's
``__post_init__`` so that bad values fail where the config is built, with the field named::

    @dataclass(frozen=True, kw_only=True)
    class RowConfig:
        alpha: float
        gamma: int

        def __post_init__(self) -> None:
            validate_config(self)

The run id is a hash of the canonical JSON of the config (its type name plus its fields, sorted keys,
no whitespace), so the same config always lands in the same run directory.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Union

from specdec.seeds import check_seed

__all__ = [
    "validate_config",
    "config_type_name",
    "config_to_dict",
    "canonical_json",
    "run_id",
    "config_from_dict",
    "replace_fields",
    "field_names",
    "has_field",
    "load_yaml_mapping",
    "load_config",
]

RUN_ID_LENGTH = 16


def _is_config(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _check_config(config: Any, argument: str = "config") -> None:
    if not _is_config(config):
        raise ValueError(f"{argument} must be a config dataclass instance, got {type(config).__name__}")


def config_type_name(config_or_cls: Any) -> str:
    """``"module:QualName"`` of a config class (or instance): part of the run id."""
    cls = config_or_cls if isinstance(config_or_cls, type) else type(config_or_cls)
    return f"{cls.__module__}:{cls.__qualname__}"


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check ``value`` against a field annotation; return it coerced (int→float, list→tuple, dict→config)."""
    if annotation is Any:
        return value
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ValueError:
                continue
        raise ValueError(f"{where} must be {_describe(annotation)}, got {value!r}")
    if origin is Literal:
        if value not in typing.get_args(annotation):
            raise ValueError(f"{where} must be one of {list(typing.get_args(annotation))}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            raise ValueError(f"{where} must be a tuple, got {value!r}")
        args = typing.get_args(annotation)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if args and len(args) != len(value):
            raise ValueError(f"{where} must have {len(args)} items, got {len(value)}")
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(args, value, strict=True)))
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if isinstance(value, Mapping):
            return config_from_dict(annotation, value)
        raise ValueError(f"{where} must be a {annotation.__name__} or a mapping, got {value!r}")
    if annotation is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be a bool, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where} must be an int, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{where} must be finite, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, got {value!r}")
        return value
    raise TypeError(
        f"{where}: unsupported config field type {annotation!r} (use JSON values, tuples, configs)"
    )


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, once per class: it dominates building a config, and a sweep of
    many points builds one per point."""
    return typing.get_type_hints(cls)


def _describe(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def validate_config(config: Any) -> None:
    """Check every field of a frozen config dataclass against its annotation, coercing in place.

    Ints become floats in float fields and lists become tuples, so equal configs hash equally.
    A field named ``seed`` is a seed: an int in [0, 2**64) (:func:`specdec.seeds.check_seed`).
    Raises ``ValueError`` naming ``ClassName.field`` on a wrong type or a non-finite float.
    """
    _check_config(config)
    hints = _type_hints(type(config))
    for f in dataclasses.fields(config):
        where = f"{type(config).__name__}.{f.name}"
        value = _coerce(getattr(config, f.name), hints[f.name], where)
        if f.name == "seed" and value is not None:
            value = check_seed(value, where)
        object.__setattr__(config, f.name, value)


def field_names(config_or_cls: Any) -> tuple[str, ...]:
    """Names of the fields of a config (or config class)."""
    return tuple(f.name for f in dataclasses.fields(config_or_cls))


def _to_json_value(value: Any) -> Any:
    if _is_config(value):
        return config_to_dict(value)
    if isinstance(value, (tuple, list)):
        return [_to_json_value(v) for v in value]
    return value


def config_to_dict(config: Any) -> dict[str, Any]:
    """Fields of ``config`` as JSON values (tuples become lists, nested configs become dicts)."""
    _check_config(config)
    return {f.name: _to_json_value(getattr(config, f.name)) for f in dataclasses.fields(config)}


def canonical_json(config: Any) -> str:
    """The canonical JSON of a config: its type name and fields, sorted keys, compact separators."""
    payload = {"type": config_type_name(config), "config": config_to_dict(config)}
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)


def run_id(config: Any) -> str:
    """Stable id of a run: the first 16 hex digits of the SHA-256 of :func:`canonical_json`."""
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()[:RUN_ID_LENGTH]


def config_from_dict(cls: type, data: Mapping[str, Any]) -> Any:
    """Build a ``cls`` config from a mapping (JSON or YAML); unknown keys raise ``ValueError``."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"cls must be a config dataclass, got {cls!r}")
    if not isinstance(data, Mapping):
        raise ValueError(f"data for {cls.__name__} must be a mapping, got {type(data).__name__}")
    known = field_names(cls)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} for {cls.__name__}; fields: {list(known)}")
    hints = _type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        annotation = hints[name]
        if isinstance(value, Mapping) and dataclasses.is_dataclass(annotation):
            value = config_from_dict(annotation, value)
        kwargs[name] = value
    return cls(**kwargs)


def replace_fields(config: Any, overrides: Mapping[str, Any]) -> Any:
    """A copy of ``config`` with fields replaced; ``"a.b"`` reaches into a nested config field ``a``.

    The new config is built through its constructor, so its own validation runs. An unknown field
    raises ``ValueError`` listing the known ones.
    """
    _check_config(config)
    direct: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    known = field_names(config)
    for path, value in overrides.items():
        head, _, rest = path.partition(".")
        if head not in known:
            raise ValueError(f"{path!r} is not a field of {type(config).__name__}; fields: {list(known)}")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            direct[head] = value
    for head, sub in nested.items():
        inner = direct.get(head, getattr(config, head))
        if not _is_config(inner):
            raise ValueError(f"{type(config).__name__}.{head} is not a nested config; cannot set {list(sub)}")
        direct[head] = replace_fields(inner, sub)
    return dataclasses.replace(config, **direct)


def has_field(config: Any, path: str) -> bool:
    """Whether the dotted ``path`` names a field of ``config``."""
    head, _, rest = path.partition(".")
    if head not in field_names(config):
        return False
    return not rest or (_is_config(getattr(config, head)) and has_field(getattr(config, head), rest))


def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """Read a YAML file that must hold one mapping."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read the YAML file ({err})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{path}: not valid YAML{where} ({getattr(err, 'problem', None) or err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a YAML mapping at the top level, got {type(data).__name__}")
    return data


def load_config(cls: type, path: str | Path) -> Any:
    """Build a ``cls`` config from a YAML (or JSON) file holding its fields."""
    return config_from_dict(cls, load_yaml_mapping(path))
