"""Architecture config of the native Llama-family target (``specdec.targets.llama``).

``LlamaConfig.from_hf`` reads a ``transformers`` config and refuses, with ``ValueError``, anything the
native target does not implement (other model types, activations, RoPE scalings; sliding windows
are checked at ``reset``), so a checkpoint never runs silently differently from ``transformers``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdec.targets.rope import rope_inv_freq
from specdec.targets.safetensors_state import load_safetensors_state

__all__ = ["LlamaConfig", "load_safetensors_state", "NATIVE_FAMILIES"]


@dataclass(frozen=True, kw_only=True)
class _Family:
    """How a model family departs from plain Llama."""

    qkv_bias: str | bool  # a config attribute name, or a constant
    o_bias: str | bool
    qk_norm: bool = False
    sliding_window_all_layers: bool = False  # Mistral: a non-null ``sliding_window`` applies everywhere


NATIVE_FAMILIES: dict[str, _Family] = {
    "llama": _Family(qkv_bias="attention_bias", o_bias="attention_bias"),
    "mistral": _Family(qkv_bias=False, o_bias=False, sliding_window_all_layers=True),
    "qwen2": _Family(qkv_bias=True, o_bias=False),
    "qwen3": _Family(qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True),
}


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """The architecture of a Llama-family checkpoint, read from its ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any] = field(hash=False)
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    max_position_embeddings: int

    # transformers' names, so code written against an HF config reads this one too.
    @property
    def num_hidden_layers(self) -> int:
        return self.num_layers

    @property
    def num_attention_heads(self) -> int:
        return self.num_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.num_kv_heads

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    @classmethod
    def from_hf(cls, hf_config: Any) -> LlamaConfig:
        """Translate a ``transformers`` config; ``ValueError`` for anything this target does not implement."""
        model_type = hf_config.model_type
        if model_type not in NATIVE_FAMILIES:
            raise ValueError(
                f"model_type {model_type!r} is not a native type ({', '.join(sorted(NATIVE_FAMILIES))});"
                " use the 'hf' target backend"
            )
        family = NATIVE_FAMILIES[model_type]
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act must be 'silu' for the native target, got {act!r}")
        rope = getattr(hf_config, "rope_parameters", None)
        if rope is None:  # transformers < 5: rope_theta + rope_scaling
            rope = {"rope_theta": getattr(hf_config, "rope_theta", 10000.0), **(hf_config.rope_scaling or {})}
        rope = dict(rope)
        rope.setdefault("rope_type", rope.pop("type", "default"))
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        rope_inv_freq(head_dim, rope)  # raises for rope types we do not implement

        window = getattr(hf_config, "sliding_window", None)
        layer_types = getattr(hf_config, "layer_types", None) or []
        uses_window = (
            family.sliding_window_all_layers and window is not None
        ) or "sliding_attention" in layer_types
        flag = lambda v: bool(getattr(hf_config, v, False)) if isinstance(v, str) else v
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_parameters=rope,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=flag(family.qkv_bias),
            o_bias=flag(family.o_bias),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=family.qk_norm,
            sliding_window=int(window) if uses_window else None,
            max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 0) or 0),
        )
