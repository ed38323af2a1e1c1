"""The project's one plugin registry: name → factory, with lazy built-ins, aliases and entry points.

Every plugin family uses it: drafters, targets, verification rules and γ policies
(:mod:`specdec.registry`), MoE routers (:mod:`moe.routers`), kernel backends
(:mod:`kernels._backends`, which adds backend selection), experiments and commands. It lives in
``kernels``, the bottom layer, so that ``specdec`` and ``moe`` can both build on it.

Built-in plugins are listed as ``"module:attribute"`` strings and imported only when asked for, so
importing a package registers nothing and loads no plugin code. Third-party packages register
through an entry-point group::

    [project.entry-points."specdec.drafters"]
    my-drafter = "my_pkg.drafter:MyDrafter"

or at run time with ``REGISTRY.register("name", factory)``. An unknown name raises ``ValueError``
listing the known ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

__all__ = ["Registry"]


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

    def unregister(self, name: str) -> None:
        """Remove ``name`` (and aliases pointing at it); ``ValueError`` when it is not registered."""
        if name not in self._factories and name not in self._lazy:
            raise ValueError(f"{self.kind} {name!r} is not registered")
        self._factories.pop(name, None)
        self._lazy.pop(name, None)
        self._aliases = {a: n for a, n in self._aliases.items() if n != name}
