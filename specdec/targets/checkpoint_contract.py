"""What a Llama-family checkpoint must hold, by the numbers of its config, and the check that it does.

Legend: V vocabulary, D hidden size, F intermediate (MLP) size, H query heads, J key/value heads,
E head dim.

:func:`expected_tensors` lists every tensor the native target reads, by ``transformers`` name, with
its shape written in the config's numbers (``mlp.down_proj.weight``: ``[D, F]``). :func:`check_checkpoint`
holds a checkpoint's tensors against that table before anything is packed or run: every tensor
present, of the expected shape, floating point (or GGUF blocks where a matrix is expected), and
nothing left over. A malformed checkpoint is a ``ValueError`` naming the file, the tensor, its shape
and the expected one; it never reaches a kernel, where a wrong size means reading or writing out of
bounds. It runs once at load (shape comparisons only, no tensor data is touched).

A :class:`Checkpoint` is a state dict that remembers where each tensor came from (a safetensors
shard, or a GGUF file and the tensor's name there), so the messages name the file. Its values are
tensors, GGUF blocks, or safetensors tensors not yet read
(:class:`specdec.targets.safetensors_state.StoredTensor`, checked by their header's shape and dtype).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from specdec.targets.llama_config import LlamaConfig

__all__ = ["Expected", "Checkpoint", "expected_tensors", "check_checkpoint", "describe_tensor"]

_UNUSED_OK = ("rotary_emb.inv_freq",)
"""Suffixes of tensors some checkpoints carry that the native target recomputes (never read)."""


@dataclass(frozen=True)
class Expected:
    """One tensor's expected shape, each dimension named by the config fields it comes from."""

    shape: tuple[int, ...]
    dims: tuple[str, ...]
    matrix: bool = False  # a linear layer's weight or the embedding: GGUF blocks are accepted

    def text(self) -> str:
        """``[64, 128] = [hidden_size, intermediate_size]``."""
        return f"{list(self.shape)} = [{', '.join(self.dims)}]"


class Checkpoint(dict):
    """Tensors by ``transformers`` name (a state dict), with the file each came from.

    ``stored_name`` maps a ``transformers`` name to the name the file format uses (GGUF's
    ``blk.0.ffn_down.weight``), so a missing tensor is named as the file would spell it.
    """

    def __init__(self, *, stored_name: Callable[[str], str | None] | None = None) -> None:
        super().__init__()
        self.files: list[Path] = []
        self.origins: dict[str, tuple[Path, str]] = {}
        self.stored_name = stored_name

    def add(self, name: str, value: Any, file: str | os.PathLike, stored: str | None = None) -> None:
        """Record tensor ``name`` read from ``file`` (under the name ``stored`` there, default ``name``)."""
        file = Path(file)
        if file not in self.files:
            self.files.append(file)
        self[name] = value
        self.origins[name] = (file, stored or name)

    def update_from(self, tensors: Mapping[str, Any], file: str | os.PathLike) -> None:
        """Record every tensor of one file (a safetensors shard)."""
        for name, value in tensors.items():
            self.add(name, value, file)


def describe_tensor(state: Mapping[str, Any], name: str) -> str:
    """``FILE: tensor 'NAME'`` (with the ``transformers`` name when the file spells it otherwise)."""
    if isinstance(state, Checkpoint):
        if name in state.origins:
            file, stored = state.origins[name]
        else:  # missing: name it as the file format would
            stored = (state.stored_name(name) if state.stored_name else None) or name
            file = state.files[0] if len(state.files) == 1 else None
        where = str(file) if file is not None else ", ".join(str(f) for f in state.files) or "checkpoint"
        alias = f" ({name})" if stored != name else ""
        return f"{where}: tensor {stored!r}{alias}"
    return f"checkpoint state: tensor {name!r}"


def expected_tensors(config: LlamaConfig) -> dict[str, Expected]:
    """Every tensor the native target reads from a checkpoint of ``config``, with its shape
    (``lm_head.weight`` only when the embeddings are not tied; a tied checkpoint may still carry one,
    which :func:`check_checkpoint` then holds to the same shape)."""
    c = config
    V, D, F = c.vocab_size, c.hidden_size, c.intermediate_size
    HE, JE, E = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim
    hd, he, je, fd = "hidden_size", "num_heads*head_dim", "num_kv_heads*head_dim", "intermediate_size"
    out: dict[str, Expected] = {"model.embed_tokens.weight": Expected((V, D), ("vocab_size", hd), True)}
    for i in range(c.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        layer = {
            f"model.layers.{i}.input_layernorm.weight": Expected((D,), (hd,)),
            f"model.layers.{i}.post_attention_layernorm.weight": Expected((D,), (hd,)),
            a + "q_proj.weight": Expected((HE, D), (he, hd), True),
            a + "k_proj.weight": Expected((JE, D), (je, hd), True),
            a + "v_proj.weight": Expected((JE, D), (je, hd), True),
            a + "o_proj.weight": Expected((D, HE), (hd, he), True),
            m + "gate_proj.weight": Expected((F, D), (fd, hd), True),
            m + "up_proj.weight": Expected((F, D), (fd, hd), True),
            m + "down_proj.weight": Expected((D, F), (hd, fd), True),
        }
        if c.qkv_bias:
            layer[a + "q_proj.bias"] = Expected((HE,), (he,))
            layer[a + "k_proj.bias"] = Expected((JE,), (je,))
            layer[a + "v_proj.bias"] = Expected((JE,), (je,))
        if c.o_bias:
            layer[a + "o_proj.bias"] = Expected((D,), (hd,))
        if c.qk_norm:
            layer[a + "q_norm.weight"] = Expected((E,), ("head_dim",))
            layer[a + "k_norm.weight"] = Expected((E,), ("head_dim",))
        if c.mlp_bias:
            layer[m + "gate_proj.bias"] = Expected((F,), (fd,))
            layer[m + "up_proj.bias"] = Expected((F,), (fd,))
            layer[m + "down_proj.bias"] = Expected((D,), (hd,))
        out.update(layer)
    out["model.norm.weight"] = Expected((D,), (hd,))
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = Expected((V, D), ("vocab_size", hd), True)
    return out


def _shape_and_kind(value: Any) -> tuple[tuple[int, ...], str]:
    """The shape of a tensor or quantised rows, and ``float`` / ``blocks`` / what else it is."""
    from kernels.quant import QuantizedRows
    from specdec.targets.safetensors_state import StoredTensor

    if isinstance(value, QuantizedRows):
        return tuple(value.shape), "blocks"
    if isinstance(value, (torch.Tensor, StoredTensor)):  # read, or still in its file
        return tuple(value.shape), "float" if value.is_floating_point() else str(value.dtype)
    return tuple(getattr(value, "shape", ())), type(value).__name__


def check_checkpoint(config: LlamaConfig, state: Mapping[str, Any]) -> None:
    """``ValueError`` unless ``state`` holds every tensor of :func:`expected_tensors` with its shape,
    floating point (GGUF blocks only for matrices), and nothing the native target does not read."""
    expected = expected_tensors(config)
    if config.tie_word_embeddings:  # an untied head in a tied checkpoint is read: hold it to its shape
        expected["lm_head.weight"] = Expected(
            (config.vocab_size, config.hidden_size), ("vocab_size", "hidden_size"), True
        )
    model = f"a {config.model_type} model"
    for name, exp in expected.items():
        if name not in state:
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            raise ValueError(f"{describe_tensor(state, name)} is missing (expected {exp.text()} for {model})")
        shape, kind = _shape_and_kind(state[name])
        if shape != exp.shape:
            raise ValueError(
                f"{describe_tensor(state, name)} has shape {list(shape)}, expected {exp.text()} of the config"
            )
        if kind != "float" and not (kind == "blocks" and exp.matrix):
            allowed = "floating point or GGUF blocks" if exp.matrix else "floating point"
            raise ValueError(f"{describe_tensor(state, name)} holds {kind} values, expected {allowed}")
    leftover = [k for k in state if k not in expected and not k.endswith(_UNUSED_OK)]
    if leftover:
        raise ValueError(
            f"{describe_tensor(state, leftover[0])} is not a tensor the native {config.model_type} target "
            f"reads ({len(leftover)} such: {leftover[:3]}); use the 'hf' target backend"
        )
