"""Name → factory registries of the engine's plugins: drafters and targets.

:class:`kernels.registry.Registry` is the project's one registry class. A drafter factory is called
as ``factory(target, **options)`` and returns a ``Drafter``; a target factory as
``factory(name_or_path, **options)`` and returns a ``Target``. Third-party packages register drafters
through the ``specdec.drafters`` entry-point group (and targets through ``specdec.targets``)::

    [project.entry-points."specdec.drafters"]
    my-drafter = "my_pkg.drafter:MyDrafter"

or at run time with ``DRAFTERS.register("my-drafter", MyDrafter)``.
"""

from __future__ import annotations

import inspect
from typing import Any

from kernels import Registry

__all__ = ["Registry", "DRAFTERS", "SLOT_DRAFTERS", "TARGETS", "create_drafter", "create_slot_drafter"]

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
        "eagle-tree": "specdec.drafters.eagle:EagleTreeDrafter",
        "ngram-eagle": "specdec.drafters.ngram_eagle:ngram_eagle",
        "ngram-eagle-tree": "specdec.drafters.ngram_eagle:ngram_eagle_tree",
        "ngram-eagle-auto": "specdec.drafters.ngram_eagle:ngram_eagle_auto",
        "qself": "specdec.drafters.qself:qself",
        "default": "specdec.drafters.ngram_eagle:default_drafter",
    },
)
# `default` (what `specdec generate` uses) is the trained EAGLE head for targets that have one
# shipped (smollm2-135m), prompt lookup (`ngram`) for the others: specdec/drafters/ngram_eagle.py.

SLOT_DRAFTERS = Registry(
    "slot drafter",
    "specdec.slot_drafters",
    builtins={
        "eagle": "specdec.drafters.eagle.slots:EagleSlotDrafter",
        "ngram-eagle": "specdec.drafters.ngram_eagle_slots:ngram_eagle_slots",
        "ngram-eagle-auto": "specdec.drafters.ngram_eagle_slots:ngram_eagle_auto_slots",
        "model": "specdec.drafters.model_slots:ModelSlotDrafter",
        "qself": "specdec.drafters.model_slots:qself_slots",
        "layerskip": "specdec.drafters.layerskip_slots:LayerSkipSlotDrafter",
        "ngram": "specdec.drafters.ngram_slots:NGramSlotDrafter",
    },
)
"""Drafter name -> the :class:`~specdec.protocols.SlotDrafter` the engine builds for it (one instance
per engine, called as ``factory(target, num_slots=..., **options)``), where one exists; the engine
builds every other name from :data:`DRAFTERS`, an instance per request behind a slot adapter
(:mod:`specdec.drafters.request_slots`)."""

TARGETS = Registry(
    "target",
    "specdec.targets",
    builtins={
        "hf": "specdec.targets.hf:HFTarget.from_pretrained",
        "llama": "specdec.targets.llama:LlamaTarget.from_pretrained",
    },
)


def create_drafter(name: str, target: Any, **options: Any) -> Any:
    """Build the drafter registered as ``name`` for ``target``; an option the drafter does not take
    is a ``ValueError`` naming it and listing the drafter's options."""
    return _build(DRAFTERS, name, target, options)


def create_slot_drafter(name: str, target: Any, *, num_slots: int, **options: Any) -> Any:
    """Build the slot drafter registered as ``name`` (:data:`SLOT_DRAFTERS`) for ``target`` with
    ``num_slots`` rows of state; options as :func:`create_drafter`."""
    return _build(SLOT_DRAFTERS, name, target, {**options, "num_slots": num_slots})


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


def _options_of(factory: Any) -> list[str]:
    """Keyword options a factory takes (following ``**options`` into the class it builds)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return []
    return [n for n, p in list(params.items())[1:] if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
