"""Read a Llama-family GGUF file's tensors as they are stored: quantised blocks stay quantised.

Legend: O output features, I input features.

:func:`check_gguf_file` reads and checks the header and tensor index
(:func:`specdec.targets.gguf_index.read_gguf_index`: a truncated or malformed file is a one-line
``ValueError`` naming the file and the field or tensor), then holds the shape of every tensor the
native target knows to the file's own metadata (``llama.embedding_length`` and the like) with the
table of :mod:`specdec.targets.checkpoint_contract`, all before any tensor data is read. It is what to
call before a GGUF file is read or converted.

:func:`load_gguf_state` maps llama.cpp's tensor names to ``transformers``' (``blk.3.attn_q.weight``
→ ``model.layers.3.self_attn.q_proj.weight``) and undoes the row permutation llama.cpp's converter
applies to the query and key projections (its rotary layout), on whole rows, so quantised blocks
(which run along the inputs) move unchanged. ``F32`` / ``F16`` / ``BF16`` tensors become float32
tensors; ``Q4_0``, ``Q4_1`` and ``Q8_0`` become :class:`kernels.quant.QuantizedRows`; any other type
is a ``ValueError`` naming the tensor and the type (nothing falls back to another format). The state
is a :class:`specdec.targets.checkpoint_contract.Checkpoint`, so the check of its shapes against the
config names the file and the GGUF tensor.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kernels.quant import GGUF_KINDS, QuantizedRows, from_gguf_blocks
from specdec.targets.checkpoint_contract import Checkpoint, expected_tensors
from specdec.targets.gguf_index import GGUFArray, GGUFIndex, GGUFTensor, read_gguf_index
from specdec.targets.llama_config import LlamaConfig

__all__ = ["load_gguf_state", "check_gguf_file", "GGUF_NAMES", "gguf_name"]

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
_FLOAT_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
"""GGUF ``general.architecture`` -> the native family whose tensor table the file's shapes must fit
(llama.cpp writes Mistral and SmolLM as ``llama``)."""


# --- the tensors ------------------------------------------------------------------------------------
def _native_name(name: str) -> str | None:
    """``transformers``' name for a llama.cpp tensor name (None when the native target has none)."""
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    match = _BLOCK.fullmatch(name)
    if match and match.group(2) in _LAYER:
        return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}"
    return None


def _hf_name(path: Path, name: str) -> str:
    hf = _native_name(name)
    if hf is None:
        raise ValueError(f"{path}: GGUF tensor {name!r} has no counterpart in the native Llama target")
    return hf


def gguf_name(hf_name: str) -> str | None:
    """llama.cpp's name for a ``transformers`` tensor name (None when the native reader has none)."""
    for name, hf in GGUF_NAMES.items():
        if hf == hf_name:
            return name
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        for name, hf in _LAYER.items():
            if hf == parts[3]:
                return f"blk.{parts[2]}.{name}"
    return None


def _unpermute_rows(num_rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's rotary permutation of a q or k projection with ``heads``
    heads (as transformers' GGUF loader does: ``reshape(heads, dim, 2, ...).swapaxes(2, 1)``)."""
    dim = num_rows // heads // 2
    return torch.arange(num_rows).view(heads, dim, 2).transpose(1, 2).reshape(num_rows)


def _read_tensor(path: Path, t: GGUFTensor, data: np.ndarray) -> Any:
    """A tensor's bytes as a float32 tensor or ``QuantizedRows`` (``ValueError`` for other types)."""
    raw = data[t.offset : t.offset + t.nbytes]
    if t.kind in _FLOAT_KINDS:
        values = raw.view(_FLOAT_DTYPES[t.kind])
        if t.kind == "BF16":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        return torch.from_numpy(values.astype(np.float32)).reshape(t.shape)
    if t.kind not in GGUF_KINDS:
        raise ValueError(
            f"{path}: GGUF tensor {t.name!r} has type {t.kind}, which the native target does not read "
            f"(supported: {', '.join((*_FLOAT_KINDS, *GGUF_KINDS))}); use weights='fp32' "
            "(the checkpoint converted by transformers)"
        )
    if len(t.dims) != 2:
        raise ValueError(
            f"{path}: GGUF tensor {t.name!r} of type {t.kind} must be a matrix, got shape {list(t.shape)}"
        )
    return from_gguf_blocks(raw, t.kind, *t.shape)


def load_gguf_state(
    path: str | os.PathLike, *, model_type: str, num_heads: int, num_kv_heads: int
) -> Checkpoint:
    """Every tensor of a GGUF file, by ``transformers`` name: float tensors and ``QuantizedRows``
    (``ValueError`` naming the file and the tensor for a malformed file or a type it does not read)."""
    path = Path(path)
    index = check_gguf_file(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    state = Checkpoint(stored_name=gguf_name)
    for t in index.tensors.values():
        name = _hf_name(path, t.name)
        value = _read_tensor(path, t, data)
        if model_type == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = num_heads if "attn_q" in t.name else num_kv_heads
            rows = t.shape[0]
            if len(t.shape) != 2 or rows % (2 * heads):
                raise ValueError(
                    f"{path}: GGUF tensor {t.name!r} ({name}) has shape {list(t.shape)}: a rotary projection "
                    f"of {heads} heads needs [a multiple of {2 * heads} rows, inputs]"
                )
            order = _unpermute_rows(rows, heads)
            value = value.rows(order) if isinstance(value, QuantizedRows) else value[order]
        state.add(name, value, path, t.name)
    return state


# --- the file against its own metadata --------------------------------------------------------------
def _metadata_config(index: GGUFIndex) -> LlamaConfig | None:
    """The architecture a Llama-family GGUF file's metadata declares (None for another architecture,
    or metadata that does not give every number: transformers' conversion then has the last word)."""
    meta = index.metadata
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        return None
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)
    heads = get("attention.head_count")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", tokens.length if isinstance(tokens, GGUFArray) else None)
    numbers = {
        "vocab_size": vocab,
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_layers": get("block_count"),
        "num_heads": heads,
        "num_kv_heads": get("attention.head_count_kv", heads),
    }
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in numbers.values()):
        return None
    head_dim = get("attention.key_length", numbers["hidden_size"] // numbers["num_heads"])
    return LlamaConfig(
        model_type=_ARCHS[arch],
        **numbers,
        head_dim=int(head_dim),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters={"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))},
        tie_word_embeddings="output.weight" not in index.tensors,
        qkv_bias="blk.0.attn_q.bias" in index.tensors,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        sliding_window=None,
        max_position_embeddings=int(get("context_length", 0) or 0),
    )


def check_gguf_file(path: str | os.PathLike) -> GGUFIndex:
    """The checked header and tensor index of a GGUF file (:func:`read_gguf_index`), every tensor the
    native target knows held to the shape its metadata gives (``ValueError`` naming the file, the
    tensor, its shape and the expected one). Presence is not checked here: a missing tensor is named
    by :func:`specdec.targets.checkpoint_contract.check_checkpoint` (native) or the conversion."""
    index = read_gguf_index(path)
    config = _metadata_config(index)
    if config is None:
        return index
    expected = expected_tensors(config)
    expected.setdefault("lm_head.weight", expected["model.embed_tokens.weight"])
    for t in index.tensors.values():
        name = _native_name(t.name)
        exp = expected.get(name) if name is not None else None
        if exp is not None and t.shape != exp.shape:
            raise ValueError(
                f"{index.path}: tensor {t.name!r} ({name}) has shape {list(t.shape)}, expected {exp.text()} "
                f"of the file's {config.model_type} metadata"
            )
    return index
