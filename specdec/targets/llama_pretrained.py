"""Loading a native target from a name, a checkpoint folder or a GGUF file: which weights file, which
format, and the packed-weight cache (``LlamaTarget.from_pretrained``).

The steps: resolve the name to a local checkpoint (a GGUF model is converted once,
:mod:`specdec.targets.loading`), read its config, pick the weight format (``auto``:
:func:`specdec.targets.default_weights.default_weights`), then either read the packed weights from
their cache (``packed`` backend) or read the checkpoint and build them. A safetensors checkpoint is
opened, not read (:func:`specdec.targets.safetensors_state.open_safetensors_state`): the weights'
builder reads it tensor by tensor into the stored dtype, so a bf16 model never holds the float32
file in memory. One process packs a checkpoint; others wait for its cache (a file lock).
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

import torch
from filelock import FileLock

from specdec.targets.default_weights import default_weights
from specdec.targets.linear import resolve_backend
from specdec.targets.llama_config import LlamaConfig
from specdec.targets.llama_weights import (
    GGUF_MODES,
    ModelWeights,
    load_packed,
    packed_cache_path,
    save_packed,
)
from specdec.targets.safetensors_state import open_safetensors_state

if TYPE_CHECKING:
    from specdec.targets.llama import LlamaTarget

__all__ = ["load_pretrained"]


def load_pretrained(
    cls: type[LlamaTarget],
    name_or_path: str | os.PathLike,
    *,
    weights: str = "auto",
    dtype: torch.dtype | None = None,
    **opts: Any,
) -> LlamaTarget:
    """:meth:`specdec.targets.llama.LlamaTarget.from_pretrained` (see there), building a ``cls``."""
    from specdec.targets.gguf import load_gguf_state
    from specdec.targets.loading import (
        gguf_source,
        load_eos_token_ids,
        load_hf_config,
        load_tokenizer,
        resolve_checkpoint,
    )

    with_tokenizer = opts.pop("load_tokenizer", True)
    path = resolve_checkpoint(name_or_path)
    config = LlamaConfig.from_hf(hf_config := load_hf_config(path))
    source = gguf_source(name_or_path)
    backend = resolve_backend(opts.get("linear_backend", "auto"), opts.get("device", "cpu"), dtype)
    if weights == "auto":
        weights = default_weights(source, dtype=dtype, linear_backend=backend)
    if weights in GGUF_MODES and source is None:
        raise ValueError(f"weights={weights!r} needs a GGUF file; {name_or_path} is a safetensors checkpoint")
    cache, key = packed_cache_path(path, source if weights in GGUF_MODES else None, weights, backend)
    eos_ids = load_eos_token_ids(path, hf_config)
    tokenizer = load_tokenizer(path) if with_tokenizer else None
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
    # One process packs a checkpoint; others wait for its cache instead of packing it too.
    with FileLock(str(cache) + ".lock") if cache is not None else contextlib.nullcontext():
        state: Any = None if cache is None else load_packed(cache, key)
        if state is None and weights in GGUF_MODES:
            heads = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads}
            state = load_gguf_state(source, model_type=config.model_type, **heads)
        elif state is None:
            state = open_safetensors_state(path)
        extra = {"tokenizer": tokenizer, "eos_token_ids": eos_ids, **opts}
        target = cls(config, state, weights=weights, dtype=dtype, **extra)
        if cache is not None and not isinstance(state, ModelWeights):
            save_packed(target.packed_weights, cache, key)
    return target
