"""Sweeps: a base config plus axes, expanded to a grid of run configs, and split into shards.

An axis sets one field (``"gamma": [1, 2, 4]``) or several fields together (``("target", "drafter"):
[("a", "x"), ("b", "y")]``, also written ``"target,drafter"``); fields of nested configs are dotted
(``"sampling.temperature"``). The grid is the Cartesian product of the axes, the last axis varying
fastest. Any config field can be an axis: γ, temperature, top-p, drafter, target/drafter pair, prompt
set; experts, top-k, capacity factor, router.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from experiments.config import field_names, has_field, replace_fields, run_id

__all__ = ["Axis", "Sweep", "expand", "iter_expand", "plan_size", "parse_shard", "shard"]


@dataclass(frozen=True)
class Axis:
    """One axis of a grid: the fields it sets and, per point, their values (one tuple per point)."""

    fields: tuple[str, ...]
    values: tuple[tuple[Any, ...], ...]

    @classmethod
    def of(cls, key: str | Sequence[str], values: Iterable[Any]) -> Axis:
        """An axis from a mapping entry: ``"gamma"`` with scalars, ``("a", "b")`` or ``"a,b"`` with tuples."""
        if isinstance(key, str):
            names = tuple(part.strip() for part in key.split(","))
        else:
            names = tuple(key)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"axis key must name one or more fields, got {key!r}")
        points = []
        for value in values:
            point = (value,) if len(names) == 1 else tuple(value)
            if len(point) != len(names):
                raise ValueError(
                    f"axis {key!r} sets {len(names)} fields, but a value has {len(point)}: {value!r}"
                )
            points.append(point)
        if not points:
            raise ValueError(f"axis {key!r} has no values")
        return cls(fields=names, values=tuple(points))

    @property
    def key(self) -> str:
        """The axis name as written in YAML: fields joined by commas."""
        return ",".join(self.fields)


def _normalize_axes(axes: Any) -> tuple[Axis, ...]:
    if isinstance(axes, Mapping):
        return tuple(Axis.of(key, values) for key, values in axes.items())
    out = tuple(axes)
    if not all(isinstance(a, Axis) for a in out):
        raise ValueError("axes must be a mapping {field(s): values} or a sequence of Axis")
    return out


@dataclass(frozen=True)
class Sweep:
    """A base config plus axes; :meth:`configs` expands the grid."""

    base: Any
    axes: tuple[Axis, ...] | Mapping[Any, Iterable[Any]] = field(default=())

    def __post_init__(self) -> None:
        axes = _normalize_axes(self.axes)
        seen: set[str] = set()
        for axis in axes:
            for name in axis.fields:
                if not has_field(self.base, name):
                    raise ValueError(
                        f"axis field {name!r} is not a field of {type(self.base).__name__}; "
                        f"fields: {list(field_names(self.base))}"
                    )
                if name in seen:
                    raise ValueError(f"field {name!r} appears on two axes of the sweep")
                seen.add(name)
        object.__setattr__(self, "axes", axes)

    def iter_configs(self) -> Iterator[Any]:
        """Every grid point as a config (validated by its constructor), in grid order, one at a time."""
        for point in itertools.product(*(axis.values for axis in self.axes)):
            overrides: dict[str, Any] = {}
            for axis, values in zip(self.axes, point, strict=True):
                overrides.update(zip(axis.fields, values, strict=True))
            yield replace_fields(self.base, overrides)

    def configs(self) -> list[Any]:
        """Every grid point as a config, in grid order (:meth:`iter_configs` as a list)."""
        return list(self.iter_configs())

    def __len__(self) -> int:
        n = 1
        for axis in self.axes:
            n *= len(axis.values)
        return n

    def with_overrides(
        self, base: Mapping[str, Any] | None = None, axes: Mapping[str, Any] | None = None
    ) -> Sweep:
        """A copy with base fields replaced and axes replaced or added (matched by their field set)."""
        new_base = replace_fields(self.base, dict(base or {}))
        new_axes = list(self.axes)
        for axis in _normalize_axes(axes or {}):
            new_axes = [a for a in new_axes if not set(a.fields) & set(axis.fields)]
            new_axes.append(axis)
        return Sweep(new_base, tuple(new_axes))


def _sweeps(plan: Sweep | Sequence[Sweep]) -> tuple[Sweep, ...]:
    sweeps = (plan,) if isinstance(plan, Sweep) else tuple(plan)
    if not all(isinstance(s, Sweep) for s in sweeps):
        raise ValueError("an experiment plan must be a Sweep or a sequence of Sweeps")
    return sweeps


def plan_size(plan: Sweep | Sequence[Sweep]) -> int:
    """The number of grid points of a plan, from the axis lengths alone (nothing is built).

    An upper bound on the number of runs: :func:`expand` drops a point whose run id came earlier.
    """
    return sum(len(sweep) for sweep in _sweeps(plan))


def iter_expand(plan: Sweep | Sequence[Sweep]) -> Iterator[Any]:
    """All configs of one sweep or of several (concatenated), each run id once, in order, lazily."""
    seen: set[str] = set()
    for sweep in _sweeps(plan):
        for config in sweep.iter_configs():
            rid = run_id(config)
            if rid not in seen:
                seen.add(rid)
                yield config


def expand(plan: Sweep | Sequence[Sweep]) -> list[Any]:
    """All configs of one sweep or of several (concatenated), each run id once, in order."""
    return list(iter_expand(plan))


def parse_shard(text: str) -> tuple[int, int]:
    """Parse ``"i/n"`` (0 <= i < n) into ``(i, n)``."""
    try:
        index_text, count_text = text.split("/")
        index, count = int(index_text), int(count_text)
    except (AttributeError, ValueError):
        raise ValueError(f"shard must look like 'i/n' with integers, e.g. '0/4', got {text!r}") from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard must satisfy 0 <= i < n, got {text!r}")
    return index, count


def shard(configs: Sequence[Any], index: int, count: int) -> list[Any]:
    """The configs of shard ``index`` of ``count``, keeping their order.

    Runs are dealt round-robin in the order of their run ids, so the split depends only on the set
    of runs (not on axis order), every run lands in exactly one shard, and shard sizes differ by at
    most one.
    """
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard index/count must satisfy 0 <= index < count, got {index}/{count}")
    ranked = sorted(range(len(configs)), key=lambda i: run_id(configs[i]))
    mine = {i for rank, i in enumerate(ranked) if rank % count == index}
    return [c for i, c in enumerate(configs) if i in mine]
