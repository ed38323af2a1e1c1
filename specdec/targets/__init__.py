"""Target models: a generic ``transformers`` adapter and a lean native Llama-family implementation."""

from __future__ import annotations

import json
import os
from typing import Any

from specdec.registry import TARGETS
from specdec.targets.loading import resolve_checkpoint

__all__ = ["load_target", "NATIVE_MODEL_TYPES"]

# Model families the native implementation (specdec.targets.llama) covers.
NATIVE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def load_target(name_or_path: str | os.PathLike, *, backend: str = "auto", **options: Any):
    """Load a target by built-in name or local checkpoint.

    ``backend``: ``"auto"`` (native ``llama`` for the Llama family, ``hf`` otherwise) or any name in
    :data:`specdec.registry.TARGETS` (``hf``, ``llama``, or a plugin's).
    """
    if backend == "auto":
        config = json.loads((resolve_checkpoint(name_or_path) / "config.json").read_text())
        backend = "llama" if config.get("model_type") in NATIVE_MODEL_TYPES else "hf"
    return TARGETS.get(backend)(name_or_path, **options)
