"""Read a Llama-family GGUF file's tensors as they are stored: quantised blocks stay quantised.

Legend: O output features, I input features.

:func:`load_gguf_state` maps llama.cpp's tensor names to ``transformers``' (``blk.3.attn_q.weight``
→ ``model.layers.3.self_attn.q_proj.weight``) and undoes the row permutation llama.cpp's converter
applies to the query and key projections (its rotary layout), on whole rows, so quantised blocks
(which run along the inputs) move unchanged. ``F32`` / ``F16`` / ``BF16`` tensors become float32
tensors; ``Q4_0``, ``Q4_1`` and ``Q8_0`` become :class:`kernels.quant.QuantizedRows`; any other type
is a ``ValueError`` naming the tensor and the type (nothing falls back to another format).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kernels.quant import GGUF_KINDS, QuantizedRows, from_gguf_blocks

__all__ = ["load_gguf_state", "GGUF_NAMES"]

GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_FLOAT_KINDS = ("F32", "F16", "BF16")
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def _hf_name(name: str) -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    match = _BLOCK.fullmatch(name)
    if match and match.group(2) in _LAYER:
        return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}"
    raise ValueError(f"GGUF tensor {name!r} has no counterpart in the native Llama target")


def _unpermute_rows(num_rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's rotary permutation of a q or k projection with ``heads``
    heads (as transformers' GGUF loader does: ``reshape(heads, dim, 2, ...).swapaxes(2, 1)``)."""
    dim = num_rows // heads // 2
    return torch.arange(num_rows).view(heads, dim, 2).transpose(1, 2).reshape(num_rows)


def load_gguf_state(
    path: str | os.PathLike, *, model_type: str, num_heads: int, num_kv_heads: int
) -> dict[str, Any]:
    """Every tensor of a GGUF file, by ``transformers`` name: float tensors and ``QuantizedRows``."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable GGUF file ({err})") from None
    state: dict[str, Any] = {}
    for t in reader.tensors:
        kind, name = t.tensor_type.name, _hf_name(t.name)
        dims = [int(x) for x in t.shape][::-1]  # GGUF lists the fastest dimension first
        if kind in _FLOAT_KINDS:
            value: Any = torch.from_numpy(np.asarray(t.data, dtype=np.float32).copy()).reshape(dims)
        elif kind in GGUF_KINDS:
            if len(dims) != 2:
                raise ValueError(f"GGUF tensor {t.name!r} of type {kind} must be a matrix, got shape {dims}")
            value = from_gguf_blocks(np.asarray(t.data), kind, dims[0], dims[1])
        else:
            raise ValueError(
                f"GGUF tensor {t.name!r} has type {kind}, which the native target does not read "
                f"(supported: {', '.join((*_FLOAT_KINDS, *GGUF_KINDS))}); use weights='fp32' "
                "(the checkpoint converted by transformers)"
            )
        if model_type == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = num_heads if "attn_q" in t.name else num_kv_heads
            order = _unpermute_rows(dims[0], heads)
            value = value.rows(order) if isinstance(value, QuantizedRows) else value[order]
        state[name] = value
    return state
