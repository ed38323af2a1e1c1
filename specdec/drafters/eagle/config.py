"""The draft head's shape: ``EagleConfig``, stored as JSON in every head file's metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["EagleConfig", "LAYOUTS"]

LAYOUTS = ("specdec", "eagle3")


@dataclass(frozen=True, kw_only=True)
class EagleConfig:
    """Shape of the draft head; the layer dims match the target's decoder layers."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any] = field(hash=False)
    """The target's RoPE (``rope_type``, ``rope_theta`` and scaling), applied by
    :mod:`specdec.targets.rope` exactly as the target applies it."""
    vocab_size: int
    """The target's vocabulary size V."""
    draft_vocab_size: int
    """N: rows of the LM head the draft head scores (the N most frequent training tokens)."""
    feature_scale: float = 1.0
    embed_scale: float = 1.0
    """Fixed input scales (1/std of the target's features and embeddings): the layer works at unit
    scale, so the next token's embedding is not drowned by features ~1000× larger."""
    aux_layers: tuple[int, ...] = ()
    """EAGLE-3 (arXiv 2503.01840): target decoder layers (0-based, e.g. a low and a middle one)
    whose outputs ``fc_aux`` fuses with the last layer's feature into the head's input feature.
    Empty: the EAGLE-1 input, the last layer's feature alone."""
    aux_scales: tuple[float, ...] = ()
    """1/(typical size) of each aux layer's output, as ``feature_scale``."""
    prev_token_input: bool = False
    """Also feed ``embed(x_t)``, the token at the feature's own position, as a third ``fc`` block:
    the pair at slot t then carries both x_t and x_{t+1}, so the attention layer can copy from the
    context (the query's x_{t+1} matches a key's x_j; that slot's value holds x_{j+1}), the
    induction pattern that the target's last-layer feature alone carries too weakly."""
    layout: str = "specdec"
    """``"specdec"``: this project's head (:class:`~specdec.drafters.eagle.model.EagleHead`: ``fc``
    over ``[embed; feature]`` feeds a layer without input norms; the target's final norm and LM-head
    rows). ``"eagle3"``: EAGLE-3's layer as vLLM, SGLang and ``speculators`` run it
    (:class:`~specdec.drafters.eagle.eagle3.Eagle3Head`: ``fc`` over the aux layers only, separate
    norms on the embedding and the hidden state, attention over both, its own final norm and LM
    head); only this layout exports to those formats (:mod:`specdec.drafters.eagle.formats`)."""
    norm_before_residual: bool = False
    """``"eagle3"`` layout: the residual stream starts from the normalised hidden state (True) or
    the raw one (False, SGLang's and EAGLE-3's original choice)."""

    def __post_init__(self) -> None:
        # JSON metadata stores tuples as lists.
        object.__setattr__(self, "aux_layers", tuple(self.aux_layers))
        object.__setattr__(self, "aux_scales", tuple(float(x) for x in self.aux_scales))
        object.__setattr__(self, "rope_parameters", dict(self.rope_parameters))
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.aux_layers):
            raise ValueError(f"aux_layers must be decoder layer indices >= 0, got {self.aux_layers}")
        if len(self.aux_scales) != len(self.aux_layers) or any(not x > 0 for x in self.aux_scales):
            raise ValueError(
                f"aux_scales must hold one positive scale per aux layer ({len(self.aux_layers)}), "
                f"got {self.aux_scales}"
            )
        for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}]")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "eagle3":
            if not self.aux_layers:
                raise ValueError("an 'eagle3' layout head reads aux layers: aux_layers must not be empty")
            if self.prev_token_input or self.feature_scale != 1.0 or self.embed_scale != 1.0:
                raise ValueError(
                    "an 'eagle3' layout head has no previous-token input and no fixed input scales "
                    "(its norms scale the inputs): prev_token_input must be False, feature_scale and "
                    "embed_scale 1.0"
                )
        elif self.norm_before_residual:
            raise ValueError("norm_before_residual applies to the 'eagle3' layout only")
        if "rope_theta" not in self.rope_parameters:
            raise ValueError(f"rope_parameters must hold rope_theta, got {self.rope_parameters}")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EagleConfig:
        """From a head file's ``config`` metadata (a plain ``rope_theta`` becomes the default RoPE)."""
        data = dict(data)
        if "rope_parameters" not in data and "rope_theta" in data:
            data["rope_parameters"] = {"rope_type": "default", "rope_theta": float(data.pop("rope_theta"))}
        if data.pop("num_layers", 1) != 1:
            raise ValueError("this head has more than one decoder layer; EAGLE heads here have one")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"head config has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_hf_config(cls, config: Any, *, draft_vocab_size: int, **extra: Any) -> EagleConfig:
        """Copy a Llama-family config's layer dims and RoPE (``transformers``' or the native
        target's ``LlamaConfig``); ``extra``: feature/embed_scale, aux_layers/aux_scales,
        prev_token_input."""
        layers = int(getattr(config, "num_hidden_layers", 0) or 0)
        aux = tuple(extra.get("aux_layers", ()))
        if layers and any(not 0 <= i < layers - 1 for i in aux):
            raise ValueError(
                f"aux_layers must be in [0, {layers - 1}) (the last layer is the feature), got {aux}"
            )
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if "rope_theta" not in rope:
            rope = {"rope_type": "default", "rope_theta": float(getattr(config, "rope_theta", 10000.0))}
        rope.setdefault("rope_type", rope.pop("type", "default"))
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            rms_norm_eps=float(config.rms_norm_eps),
            rope_parameters=rope,
            vocab_size=config.vocab_size,
            draft_vocab_size=draft_vocab_size,
            **extra,
        )
