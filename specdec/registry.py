"""Name → factory registries of the engine's plugins: drafters and targets.

:class:`kernels.registry.Registry` is the project's one registry class. A target factory is called as
``factory(name_or_path, **options)`` and returns a ``Target``. A drafter factory is called as
``factory(target, **options)``:

- a factory that takes ``num_slots`` builds a :class:`~specdec.protocols.SlotDrafter`, the one drafter
  of an engine with ``num_slots`` rows (every built-in drafter);
- any other factory builds a one-request :class:`~specdec.protocols.Drafter` (``begin`` / ``propose``
  / ``observe``), which the engine runs through one adapter (:mod:`specdec.drafters.request_slots`).

Third-party packages register drafters through the ``specdec.drafters`` entry-point group (and
targets through ``specdec.targets``)::

    [project.entry-points."specdec.drafters"]
    my-drafter = "my_pkg.drafter:MyDrafter"

or at run time with ``DRAFTERS.register("my-drafter", MyDrafter)``.
"""

from __future__ import annotations

import inspect
from typing import Any

from kernels import Registry

__all__ = ["Registry", "DRAFTERS", "TARGETS", "builds_slot_drafter", "create_drafter"]

DRAFTERS = Registry(
    "drafter",
    "specdec.drafters",
    builtins={
        "none": "specdec.drafters.none:NoDrafter",
        "ngram": "specdec.drafters.ngram:NGramDrafter",
        "model": "specdec.drafters.model:ModelDrafter",
        "qself": "specdec.drafters.qself:qself",
        "layerskip": "specdec.drafters.layerskip:LayerSkipDrafter",
        "unigram": "specdec.drafters.ngram_lm:UnigramDrafter",
        "bigram": "specdec.drafters.ngram_lm:BigramDrafter",
        "eagle": "specdec.drafters.eagle:EagleDrafter",
        "eagle-tree": "specdec.drafters.eagle:eagle_tree",
        "ngram-eagle": "specdec.drafters.ngram_eagle:ngram_eagle",
        "ngram-eagle-tree": "specdec.drafters.ngram_eagle:ngram_eagle_tree",
        "ngram-eagle-auto": "specdec.drafters.ngram_eagle:ngram_eagle_auto",
        "default": "specdec.drafters.ngram_eagle:default_drafter",
    },
)
# `default` (what `specdec generate` uses) is the trained EAGLE head for targets that have one
# shipped (smollm2-135m), prompt lookup (`ngram`) for the others: specdec/drafters/ngram_eagle.py.

TARGETS = Registry(
    "target",
    "specdec.targets",
    builtins={
        "hf": "specdec.targets.hf:HFTarget.from_pretrained",
        "llama": "specdec.targets.llama:LlamaTarget.from_pretrained",
    },
)


def create_drafter(name: str, target: Any, **options: Any) -> Any:
    """Build the drafter registered as ``name`` for ``target``: a slot drafter's factory gets
    ``num_slots`` (1 unless the options set it), a one-request drafter's factory the options alone; an
    option the drafter does not take is a ``ValueError`` naming it and listing the drafter's options.
    The engine's drafter for a name, whatever its form:
    :func:`specdec.drafters.engine_drafter.make_slot_drafter`."""
    if builds_slot_drafter(DRAFTERS.get(name)):
        options = {"num_slots": 1, **options}
    return _build(DRAFTERS, name, target, options)


def builds_slot_drafter(factory: Any) -> bool:
    """Whether a drafter factory builds a slot drafter: it takes ``num_slots`` (module doc)."""
    return "num_slots" in _options_of(factory, first=0)


def _build(registry: Registry, name: str, target: Any, options: dict[str, Any]) -> Any:
    factory = registry.get(name)
    try:
        return factory(target, **options)
    except TypeError as err:
        if "unexpected keyword argument" not in str(err):
            raise
        bad = str(err).rsplit("argument", 1)[-1].strip(" '\"")
        known = ", ".join(_options_of(factory)) or "none"
        raise ValueError(f"drafter {name!r} has no option {bad!r}; its options: {known}") from None


def _options_of(factory: Any, first: int = 1) -> list[str]:
    """Keyword options a factory takes (its parameters after the first ``first``)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [n for n, p in list(params.items())[first:] if p.kind in kinds]
