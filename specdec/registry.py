"""Name → factory registries for drafters and targets.

Built-in plugins are listed here as ``"module:attribute"`` strings and imported only when asked
for, so importing ``specdec`` registers nothing and loads no model code. Third-party packages
register drafters through the ``specdec.drafters`` entry-point group (and targets through
``specdec.targets``)::

    [project.entry-points."specdec.drafters"]
    my-drafter = "my_pkg.drafter:MyDrafter"

or at run time with ``DRAFTERS.register("my-drafter", MyDrafter)``.

A drafter factory is called as ``factory(target, **options)`` and returns a ``Drafter``.
A target factory is called as ``factory(name_or_path, **options)`` and returns a ``Target``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

__all__ = ["Registry", "DRAFTERS", "TARGETS", "create_drafter"]


class Registry:
    """A registry of factories by name, with lazy built-ins, aliases and entry points."""

    def __init__(self, kind: str, entry_point_group: str, builtins: dict[str, str] | None = None) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self._lazy: dict[str, str] = dict(builtins or {})
        self._factories: dict[str, Callable[..., Any]] = {}
        self._aliases: dict[str, str] = {}
        self._entry_points_loaded = False

    def register(
        self, name: str, factory: Callable[..., Any] | str | None = None, *, aliases: tuple[str, ...] = ()
    ) -> Any:
        """Register ``factory`` (a callable or a ``"module:attr"`` string) under ``name``.

        Usable as a decorator when ``factory`` is omitted. Re-registering a name replaces it.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def _add(f: Callable[..., Any] | str) -> Any:
            self._factories.pop(name, None)
            self._lazy.pop(name, None)
            if isinstance(f, str):
                self._lazy[name] = f
            else:
                self._factories[name] = f
            for alias in aliases:
                self._aliases[alias] = name
            return f

        return _add if factory is None else _add(factory)

    def alias(self, alias: str, name: str) -> None:
        """Make ``alias`` resolve to ``name``."""
        self._aliases[alias] = name

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in entry_points(group=self.entry_point_group):
            if ep.name not in self._factories and ep.name not in self._lazy:
                self._lazy[ep.name] = ep.value

    def names(self) -> list[str]:
        """All known names (built-in, registered, entry points and aliases), sorted."""
        self._load_entry_points()
        return sorted({*self._factories, *self._lazy, *self._aliases})

    def resolve(self, name: str) -> str:
        """Follow aliases to a canonical name."""
        seen = set()
        while name in self._aliases and name not in seen:
            seen.add(name)
            name = self._aliases[name]
        return name

    def get(self, name: str) -> Callable[..., Any]:
        """The factory for ``name``; an unknown name raises ``ValueError`` listing the known ones."""
        canonical = self.resolve(name)
        if canonical not in self._factories and canonical not in self._lazy:
            self._load_entry_points()
        if canonical in self._factories:
            return self._factories[canonical]
        if canonical in self._lazy:
            module_name, _, attr = self._lazy[canonical].partition(":")
            obj: Any = importlib.import_module(module_name)
            for part in attr.split(".") if attr else ():
                obj = getattr(obj, part)
            self._factories[canonical] = obj
            return obj
        raise ValueError(f"unknown {self.kind} {name!r}; known {self.kind}s: {', '.join(self.names())}")

    def __contains__(self, name: str) -> bool:
        return self.resolve(name) in self.names()


DRAFTERS = Registry(
    "drafter",
    "specdec.drafters",
    builtins={
        "none": "specdec.drafters.none:NoDrafter",
        "ngram": "specdec.drafters.ngram:NGramDrafter",
        "model": "specdec.drafters.model:ModelDrafter",
        "layerskip": "specdec.drafters.layerskip:LayerSkipDrafter",
        "unigram": "specdec.drafters.ngram_lm:UnigramDrafter",
        "bigram": "specdec.drafters.ngram_lm:BigramDrafter",
        "eagle": "specdec.drafters.eagle:EagleDrafter",
        "eagle-tree": "specdec.drafters.eagle_tree:EagleTreeDrafter",
        "ngram-eagle": "specdec.drafters.fallback:ngram_eagle",
        "ngram-eagle-tree": "specdec.drafters.fallback:ngram_eagle_tree",
        "ngram-eagle-auto": "specdec.drafters.by_mode:ngram_eagle_auto",
        "default": "specdec.drafters.default:default_drafter",
    },
)
# `default` (what `specdec generate` uses) is the trained EAGLE head for targets that have one
# shipped (smollm2-135m), prompt lookup (`ngram`) for the others: specdec/drafters/default.py.

TARGETS = Registry(
    "target",
    "specdec.targets",
    builtins={
        "hf": "specdec.targets.hf:HFTarget.from_pretrained",
        "llama": "specdec.targets.llama:LlamaTarget.from_pretrained",
    },
)


def create_drafter(name: str, target: Any, **options: Any) -> Any:
    """Build the drafter registered as ``name`` for ``target``."""
    return DRAFTERS.get(name)(target, **options)
