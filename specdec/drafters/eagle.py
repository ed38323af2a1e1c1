"""EAGLE: a feature-level draft head and the drafter that runs it (chain drafts).

Legend: B batch, T block length, D hidden size, F MLP size, H query heads, G key/value heads,
d head dim, L cache capacity, N draft vocabulary, V target vocabulary, K draft length (γ).

Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"
(arXiv 2401.15077). The target's *feature* f_t (its last decoder layer's output before the final
norm, at the position of token x_t) predicts x_{t+1}. The draft head predicts the next feature
autoregressively::

    f̂_{t+1} = DecoderLayer(fc([embed(x_{t+1}); f_t]))          (one Llama layer, own KV cache)
    draft_probs(x_{t+2}) = softmax(head(norm(f̂_{t+1})))        (target's final norm)

and keeps drafting with its own predicted features. After verification the predicted features of
accepted tokens are replaced by the target's true ones (from the verify block's ``hidden_BTD``).

The head reuses the target's embedding, final norm and LM-head rows. The LM head is restricted to
a draft vocabulary of the N most frequent tokens (EAGLE-3, arXiv 2503.01840): the full
49,152 × 576 head would cost a fifth of the target per draft token. Draft probabilities are zero
outside the draft vocabulary, which never affects exactness (verification handles any proposal).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.drafters.confidence import ConfidenceStop, check_min_prob
from specdec.protocols import DecodeState, Proposal, TargetOutput
from specdec.sampling import SamplingParams, logits_to_probs, sample_from_probs

__all__ = [
    "EagleConfig",
    "EagleHead",
    "EagleCache",
    "EagleDrafter",
    "TargetParts",
    "target_parts",
    "load_eagle_head",
    "save_eagle_head",
    "resolve_weights",
    "stored_draft_vocab",
    "DEFAULT_WEIGHTS",
    "target_mismatch",
]

DEFAULT_WEIGHTS = "eagle-smollm2-135m.safetensors"
"""The shipped head for ``smollm2-135m`` (in ``specdec/weights/``)."""


@dataclass(frozen=True, kw_only=True)
class EagleConfig:
    """Shape of the draft head; the layer dims match the target's decoder layers."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
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
    the pair at slot t then carries both x_t and x_{t+1}, so one attention layer can copy from the
    context (the query's x_{t+1} matches a key's x_j; that slot's value holds x_{j+1}), the
    induction pattern that the target's last-layer feature alone carries too weakly."""
    num_layers: int = 1
    """Decoder layers in the head. The first is EAGLE's (no input norm: ``fc`` feeds it); each
    further one is a standard pre-norm Llama layer (input RMSNorm) with its own KV cache, stacked on
    the first's output: more of the target's next-token computation for the head to emulate, at the
    cost of one more layer per draft token."""

    def __post_init__(self) -> None:
        # JSON metadata stores tuples as lists.
        object.__setattr__(self, "aux_layers", tuple(self.aux_layers))
        object.__setattr__(self, "aux_scales", tuple(float(x) for x in self.aux_scales))
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.aux_layers):
            raise ValueError(f"aux_layers must be decoder layer indices >= 0, got {self.aux_layers}")
        if len(self.aux_scales) != len(self.aux_layers) or any(not x > 0 for x in self.aux_scales):
            raise ValueError(
                f"aux_scales must hold one positive scale per aux layer ({len(self.aux_layers)}), "
                f"got {self.aux_scales}"
            )
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "num_layers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}]")

    @classmethod
    def from_hf_config(cls, config: Any, *, draft_vocab_size: int, **extra: Any) -> EagleConfig:
        """Copy a Llama-family ``transformers`` config's layer dims (``extra``: feature/embed_scale,
        aux_layers/aux_scales)."""
        layers = int(getattr(config, "num_hidden_layers", 0) or 0)
        aux = tuple(extra.get("aux_layers", ()))
        if layers and any(not 0 <= i < layers - 1 for i in aux):
            raise ValueError(
                f"aux_layers must be in [0, {layers - 1}) (the last layer is the feature), got {aux}"
            )
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(theta),
            vocab_size=config.vocab_size,
            draft_vocab_size=draft_vocab_size,
            **extra,
        )


@dataclass(frozen=True)
class TargetParts:
    """The target tensors the head reuses (shared, never copied or trained)."""

    embed_VD: torch.Tensor
    norm_D: torch.Tensor
    norm_eps: float
    lm_head_VD: torch.Tensor
    config: Any


def target_parts(target: Any) -> TargetParts:
    """Find the embedding, final norm and LM head of a native Llama target, an ``HFTarget`` or a
    bare ``transformers`` Llama-family causal LM."""
    if all(hasattr(target, a) for a in ("embed_tokens", "norm", "lm_head")):
        embed, norm, head = target.embed_tokens, target.norm, target.lm_head
        config = getattr(target, "config", None)
    else:
        # A transformers causal LM: the target itself, or the one an HFTarget wraps (``.model``).
        hf = next(
            (
                m
                for m in (target, getattr(target, "model", None))
                if hasattr(m, "get_output_embeddings") and hasattr(getattr(m, "model", None), "norm")
            ),
            None,
        )
        base = getattr(hf, "model", None)
        if hf is None or hf.get_output_embeddings() is None:
            raise ValueError(
                f"target {type(target).__name__} must expose embed_tokens, norm and lm_head (a native Llama "
                "target, an HFTarget or a transformers Llama-family model) for the EAGLE drafter"
            )
        embed, norm, head, config = (
            hf.get_input_embeddings(),
            base.norm,
            hf.get_output_embeddings(),
            hf.config,
        )

    def weight(m: Any) -> torch.Tensor:
        return m if isinstance(m, torch.Tensor) else m.weight

    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None)
    if eps is None:
        eps = getattr(config, "rms_norm_eps", 1e-5)
    return TargetParts(
        weight(embed).detach(), weight(norm).detach(), float(eps), weight(head).detach(), config
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm in float32."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding tables for integer ``positions [...]`` → ``cos, sin [..., d]`` (HF layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x_BHTd: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor) -> torch.Tensor:
    half = x_BHTd.shape[-1] // 2
    rotated = torch.cat((-x_BHTd[..., half:], x_BHTd[..., :half]), dim=-1)
    return x_BHTd * cos_BTd.unsqueeze(1) + rotated * sin_BTd.unsqueeze(1)


def add_layer_weights(module: nn.Module, config: EagleConfig) -> None:
    """Set one decoder layer's weights on ``module``: ``qkv_proj``, ``o_proj``, ``post_norm``,
    ``gate_up_proj``, ``down_proj`` (in that order, so a seeded head initialises the same). The head's
    first layer keeps them on :class:`EagleHead` itself; each :class:`DraftLayer` has its own."""
    c = config
    qkv_out = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    module.qkv_proj = nn.Linear(c.hidden_size, qkv_out, bias=False)
    module.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
    module.post_norm = nn.Parameter(torch.ones(c.hidden_size))
    module.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
    module.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)


class DraftLayer(nn.Module):
    """A further decoder layer of the head (``config.num_layers`` > 1): a pre-norm Llama layer.

    The head's first layer has the same parts without ``input_norm`` (EAGLE feeds it ``fc``'s
    output directly); its weights live on :class:`EagleHead` itself, so one-layer heads keep their
    state-dict names.
    """

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.input_norm = nn.Parameter(torch.ones(config.hidden_size))
        add_layer_weights(self, config)

    def zero_output(self) -> DraftLayer:
        """Zero the projections into the residual stream: the layer then passes its input through
        unchanged (how ``--init-from`` grows a trained head by a layer without changing it)."""
        with torch.no_grad():
            self.o_proj.weight.zero_()
            self.down_proj.weight.zero_()
        return self


class EagleHead(nn.Module):
    """One Llama decoder layer over ``fc([embed(token); feature])``, plus the reduced LM head.

    An EAGLE-3 head (``config.aux_layers``) first fuses the target's low, middle and last-layer
    features into its input feature (:meth:`project`); its later draft steps feed its own output.

    Trainable: ``fc`` (and ``fc_aux``), the layer (``qkv_proj``, ``o_proj``, ``post_norm``, ``gate_up_proj``,
    ``down_proj``). As in EAGLE, the layer has no input norm: ``fc`` feeds it directly. A head with
    ``config.num_layers`` > 1 stacks further pre-norm layers on it (``extra_layers``, see
    :class:`DraftLayer`). The embedding, final norm and head rows are the target's (buffers set by
    :meth:`attach`).
    """

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.fc = nn.Linear((3 if c.prev_token_input else 2) * c.hidden_size, c.hidden_size, bias=True)
        A = len(c.aux_layers)
        self.fc_aux = nn.Linear((A + 1) * c.hidden_size, c.hidden_size, bias=False) if A else None
        if self.fc_aux is not None:  # start as the EAGLE-1 input (g = f); training mixes the aux layers in
            with torch.no_grad():
                self.fc_aux.weight.zero_()
                self.fc_aux.weight[:, A * c.hidden_size :] = torch.eye(c.hidden_size)
        add_layer_weights(self, c)
        self.input_norm = None  # the first layer has none (EAGLE); a DraftLayer has one
        self.extra_layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers - 1))
        self.register_buffer("draft_vocab_N", torch.arange(c.draft_vocab_size), persistent=True)
        # Inference fast path (see pack()): the same weights in the CPU-friendly layout.
        self._packed: dict[str, Any] | None = None
        # Target tensors (not saved): set by attach().
        self.embed_VD: torch.Tensor | None = None
        self.norm_D: torch.Tensor | None = None
        self.norm_eps = c.rms_norm_eps
        self.head_ND: torch.Tensor | None = None

    def attach(self, parts: TargetParts, draft_vocab_N: torch.Tensor | None = None) -> EagleHead:
        """Point the head at the target's embedding, final norm and LM-head rows.

        ``draft_vocab_N`` (optional) replaces the stored draft vocabulary, e.g. its first n entries
        (the n most frequent) to trade acceptance for speed; it is sorted by id so that
        ``logits_to_probs`` breaks ties on the same ids as the target does.
        """
        c = self.config
        if tuple(parts.embed_VD.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(
                f"target embedding has shape {tuple(parts.embed_VD.shape)}, the draft head expects "
                f"[vocab_size={c.vocab_size}, hidden_size={c.hidden_size}]: weights for another target?"
            )
        vocab = self.draft_vocab_N if draft_vocab_N is None else draft_vocab_N
        vocab = torch.sort(vocab.to(torch.long)).values
        self.draft_vocab_N = vocab.to(self.fc.weight.device)
        dtype = self.fc.weight.dtype
        self.embed_VD = parts.embed_VD
        self.norm_D = parts.norm_D.to(dtype)
        self.norm_eps = parts.norm_eps
        self.head_ND = parts.lm_head_VD[self.draft_vocab_N].to(dtype).contiguous()
        if self._packed is not None:
            self.pack(self._packed_backend, self._packed_dtype)
        return self

    def pack(self, backend: str = "auto", weight_dtype: torch.dtype | None = None) -> EagleHead:
        """Inference only: run the linear layers through ``specdec.targets.linear`` (the layout the
        CPU multiplies fastest for a few rows) with the elementwise ops around them fused in;
        ``nn.Linear`` stays the reference (and trains).

        Fused (the same function, rounded differently): the input scales into ``fc``'s columns;
        the residual add into ``o_proj`` and ``down_proj``; ``post_norm``'s RMSNorm into
        ``gate_up_proj``; SwiGLU into ``down_proj``'s input; the target's final norm into the
        draft LM head. A draft step is then five kernel calls plus attention.

        ``weight_dtype``: how the packed weights are stored (default: the head's dtype). A draft
        token streams ~36 MB of float32 weights (the layer and 8,192 LM-head rows), so it is bound
        by memory bandwidth like the target; ``torch.bfloat16`` halves that. The trained layer
        weights are bf16 values already (that is how they ship); the LM-head rows and ``fc``
        with its input scales folded in are rounded. Activations stay float32.
        """
        from specdec.targets.linear import pack_linear

        c = self.config
        dtype = weight_dtype or self.fc.weight.dtype
        w = lambda m: m.weight.detach()
        D = c.hidden_size
        scale_I = torch.cat([torch.full((D,), x) for x in self._fc_scales()])
        fc_w = w(self.fc).float() * scale_I.to(self.fc.weight.device)  # folded in float32
        self._packed = {
            "fc": pack_linear(fc_w, self.fc.bias.detach(), backend=backend, dtype=dtype),
            **(
                {"fc_aux": pack_linear(self._fc_aux_folded(), None, backend=backend, dtype=dtype)}
                if self.fc_aux is not None
                else {}
            ),
            "layers": [self._pack_layer(i, backend, dtype) for i in range(c.num_layers)],
        }
        if self.head_ND is not None:
            self._packed["head"] = pack_linear(
                self.head_ND,
                None,
                backend=backend,
                dtype=dtype,
                norm_weight_I=self.norm_D,
                norm_eps=self.norm_eps,
            )
        self._packed_backend, self._packed_dtype = backend, weight_dtype
        return self

    def _pack_layer(self, i: int, backend: str, dtype: torch.dtype) -> dict[str, Any]:
        """Layer ``i``'s products for :meth:`pack` (a further layer's input norm fused into qkv)."""
        from specdec.targets.linear import pack_linear

        layer = self.layer(i)
        w = lambda m: m.weight.detach()
        norm = (
            {}
            if layer.input_norm is None
            else {"norm_weight_I": layer.input_norm.detach(), "norm_eps": self.norm_eps}
        )
        return {
            "qkv_proj": pack_linear(w(layer.qkv_proj), None, backend=backend, dtype=dtype, **norm),
            "o_proj": pack_linear(w(layer.o_proj), None, backend=backend, dtype=dtype),
            "gate_up_proj": pack_linear(
                w(layer.gate_up_proj),
                None,
                backend=backend,
                dtype=dtype,
                norm_weight_I=layer.post_norm.detach(),
                norm_eps=self.norm_eps,
            ),
            "down_proj": pack_linear(w(layer.down_proj), None, backend=backend, dtype=dtype, swiglu=True),
        }

    def layer(self, i: int) -> nn.Module:
        """Decoder layer ``i`` (0: EAGLE's first layer, whose weights are the head's own)."""
        if not 0 <= i < self.config.num_layers:
            raise ValueError(f"layer must be in [0, num_layers={self.config.num_layers}), got {i}")
        return self if i == 0 else self.extra_layers[i - 1]

    def _fc_aux_folded(self) -> torch.Tensor:
        """``fc_aux``'s weight with the input scales and the output's 1/feature_scale folded in."""
        c = self.config
        scales = torch.tensor([*c.aux_scales, c.feature_scale], dtype=torch.float32)
        scale_I = scales.repeat_interleave(c.hidden_size).to(self.fc_aux.weight.device)
        return self.fc_aux.weight.detach().float() * scale_I / c.feature_scale

    # --- building blocks (shared by inference and training) ------------------------------
    def project(self, feature_BTD: torch.Tensor, aux_BTAD: torch.Tensor | None = None) -> torch.Tensor:
        """The head's input feature for target features: ``fc_aux([a_1; …; a_A; f])`` (each at unit
        scale; EAGLE-3), returned at the feature's scale. An EAGLE-1 head returns ``feature_BTD``.

        ``aux_BTAD``: the outputs of ``config.aux_layers``, in that order, at the same positions.
        """
        if self.fc_aux is None:
            return feature_BTD
        c = self.config
        A = len(c.aux_layers)
        if (
            aux_BTAD is None
            or aux_BTAD.shape[:-2] != feature_BTD.shape[:-1]
            or aux_BTAD.shape[-2:]
            != (
                A,
                c.hidden_size,
            )
        ):
            raise ValueError(
                f"aux_BTAD must be [{', '.join(map(str, feature_BTD.shape[:-1]))}, A={A}, D={c.hidden_size}] "
                f"(the outputs of layers {list(c.aux_layers)}), got "
                f"{None if aux_BTAD is None else tuple(aux_BTAD.shape)}"
            )
        x_BTI = torch.cat((aux_BTAD.to(feature_BTD.dtype).flatten(-2), feature_BTD), dim=-1)
        if self._packed is not None:
            return self._packed["fc_aux"](x_BTI)
        scales = torch.tensor([*c.aux_scales, c.feature_scale], dtype=x_BTI.dtype, device=x_BTI.device)
        x_BTI = x_BTI * scales.repeat_interleave(c.hidden_size)
        return self.fc_aux(x_BTI) / c.feature_scale

    def _fc_scales(self) -> list[float]:
        """The input scale of each of ``fc``'s blocks, in :meth:`fuse`'s order."""
        c = self.config
        return [c.embed_scale, c.feature_scale] + ([c.embed_scale] if c.prev_token_input else [])

    def fuse(
        self, feature_BTD: torch.Tensor, tokens_BT: torch.Tensor, prev_tokens_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``fc([embed(x_{t+1}); f_t])`` (both at unit scale): the layer input; with
        ``config.prev_token_input``, ``fc([embed(x_{t+1}); f_t; embed(x_t)])`` (``prev_tokens_BT`` = x_t)."""
        c = self.config
        emb_BTD = F.embedding(tokens_BT, self.embed_VD).to(feature_BTD.dtype)
        blocks = [emb_BTD, feature_BTD]
        if c.prev_token_input:
            if prev_tokens_BT is None or prev_tokens_BT.shape != tokens_BT.shape:
                raise ValueError(
                    "prev_tokens_BT must be the tokens at the features' positions, shaped like tokens_BT "
                    f"{tuple(tokens_BT.shape)}, for a head with prev_token_input; got "
                    f"{None if prev_tokens_BT is None else tuple(prev_tokens_BT.shape)}"
                )
            blocks.append(F.embedding(prev_tokens_BT, self.embed_VD).to(feature_BTD.dtype))
        if self._packed is not None:  # the scales are folded into fc's columns
            return self._packed["fc"](torch.cat(blocks, dim=-1))
        return self.fc(torch.cat([x * a for x, a in zip(blocks, self._fc_scales(), strict=True)], dim=-1))

    def qkv(
        self, h_BTD: torch.Tensor, positions_BT: torch.Tensor, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s projection of the residual stream ``h_BTD``, rotated:
        ``q [B, H, T, d]``, ``k, v [B, G, T, d]`` (a further layer normalises its input first)."""
        c = self.config
        B, T, _ = h_BTD.shape
        if self._packed is not None:
            return self._qkv_packed(h_BTD, positions_BT, layer)
        mod = self.layer(layer)
        x_BTD = h_BTD if mod.input_norm is None else rms_norm(h_BTD, mod.input_norm, self.norm_eps)
        q, k, v = mod.qkv_proj(x_BTD).split(
            [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], dim=-1
        )
        q = q.view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = self._rope(positions_BT, h_BTD.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _qkv_packed(
        self, h_BTD: torch.Tensor, positions_BT: torch.Tensor, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`qkv` with fewer ops: q and k rotated together by
        :func:`specdec.targets.rope.apply_rope_flipped` (the same floats as :func:`apply_rope`)."""
        from specdec.targets.rope import apply_rope_flipped

        c = self.config
        B, T, _ = h_BTD.shape
        H, G, d = c.num_heads, c.num_kv_heads, c.head_dim
        qkv_BTCd = self._packed["layers"][layer]["qkv_proj"](h_BTD).view(B, T, H + 2 * G, d)
        cos, flipped_sin = self._rope(positions_BT, h_BTD.dtype, flipped=True)
        qk = apply_rope_flipped(qkv_BTCd[:, :, : H + G], cos.unsqueeze(2), flipped_sin.unsqueeze(2))
        return (
            qk[:, :, :H].transpose(1, 2),
            qk[:, :, H:].transpose(1, 2),
            qkv_BTCd[:, :, H + G :].transpose(1, 2),
        )

    def _rope(
        self, positions_BT: torch.Tensor, dtype: torch.dtype, flipped: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[B, T, d]`` looked up in a table that grows by doubling; ``flipped``: the sin
        table of :func:`specdec.targets.rope.apply_rope_flipped` (built with the table, once)."""
        from specdec.targets.rope import flip_sin

        need = int(positions_BT.max()) + 1
        table = getattr(self, "_rope_table", None)
        if table is None or table[0].shape[0] < need or table[0].dtype != dtype:
            size = max(need, 2 * (table[0].shape[0] if table is not None else 256))
            pos = torch.arange(size, device=positions_BT.device)
            cos, sin = rope_cos_sin(pos, self.config.head_dim, self.config.rope_theta)
            table = self._rope_table = (cos.to(dtype), sin.to(dtype), flip_sin(sin).to(dtype))
        return table[0][positions_BT], table[2 if flipped else 1][positions_BT]

    def finish(self, h_BTD: torch.Tensor, attn_BHTd: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """Layer ``layer``'s output projection, residual and MLP: the next residual stream (unit
        scale); after the last layer, :meth:`feature` gives the predicted feature ``f̂``."""
        B, H, T, d = attn_BHTd.shape
        attn_BTF = attn_BHTd.transpose(1, 2).reshape(B, T, H * d)
        if self._packed is not None:  # residuals, post-norm and SwiGLU fused into the kernels
            pk = self._packed["layers"][layer]
            h_BTD = pk["o_proj"](attn_BTF, h_BTD)
            return pk["down_proj"](pk["gate_up_proj"](h_BTD), h_BTD)
        mod = self.layer(layer)
        h_BTD = h_BTD + mod.o_proj(attn_BTF)
        gate, up = mod.gate_up_proj(rms_norm(h_BTD, mod.post_norm, self.norm_eps)).chunk(2, dim=-1)
        return h_BTD + mod.down_proj(F.silu(gate) * up)

    def feature(self, h_BTD: torch.Tensor) -> torch.Tensor:
        """The last layer's residual stream back at the target's feature scale: ``f̂``."""
        return h_BTD / self.config.feature_scale

    def logits(self, feature_BTD: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[..., N]`` of a (predicted) feature."""
        if self._packed is not None:  # the final norm is fused into the kernel
            return self._packed["head"](feature_BTD)
        return F.linear(rms_norm(feature_BTD, self.norm_D, self.norm_eps), self.head_ND)

    def forward(
        self, feature_BTD: torch.Tensor, tokens_BT: torch.Tensor, prev_tokens_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Reference teacher-forced pass over whole sequences (causal, positions 0..T-1):
        ``f̂_{t+1}`` for every pair ``(f_t, x_{t+1})`` (and ``x_t``, see :meth:`fuse`)."""
        B, T, _ = feature_BTD.shape
        positions_BT = torch.arange(T, device=feature_BTD.device).expand(B, T)
        h_BTD = self.fuse(feature_BTD, tokens_BT, prev_tokens_BT)
        for i in range(self.config.num_layers):
            q, k, v = self.qkv(h_BTD, positions_BT, i)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            h_BTD = self.finish(h_BTD, attn, i)
        return self.feature(h_BTD)


class EagleCache:
    """The head's static KV cache: slot s of row b holds the pair whose feature is at position s
    (one key and one value tensor per decoder layer).

    Rows are independent; a block writes its slots, then attends to the slots its ``visible``
    mask allows (slots past a row's valid length may hold stale drafts and are never visible).
    """

    def __init__(self, head: EagleHead, batch_size: int, capacity: int) -> None:
        c = head.config
        w = head.fc.weight
        shape = (batch_size, c.num_kv_heads, capacity, c.head_dim)
        # one [B, G, L, d] key and value tensor per decoder layer
        self.k_BGLd = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in range(c.num_layers)]
        self.v_BGLd = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in range(c.num_layers)]

    @property
    def capacity(self) -> int:
        return self.k_BGLd[0].shape[2]

    def ensure(self, capacity: int) -> None:
        """Grow (by doubling) so that ``capacity`` slots fit."""
        if capacity <= self.capacity:
            return
        new = max(capacity, 2 * self.capacity)
        pad = (0, 0, 0, new - self.capacity)
        self.k_BGLd = [F.pad(k, pad) for k in self.k_BGLd]
        self.v_BGLd = [F.pad(v, pad) for v in self.v_BGLd]

    def step(
        self,
        head: EagleHead,
        feature_BTD: torch.Tensor,
        tokens_BT: torch.Tensor,
        slots_BT: torch.Tensor,
        positions_BT: torch.Tensor,
        visible_BTL: torch.Tensor | None,
        prev_tokens_BT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the head on a block of pairs at cache ``slots_BT`` (RoPE at ``positions_BT``);
        ``visible_BTL[b, t, s]``: may query t attend to slot s (``L`` = slots in use). ``None``:
        one query per row at the same slot, which sees every slot up to its own (no mask).
        ``prev_tokens_BT``: the tokens at the features' positions (a ``prev_token_input`` head)."""
        B, T = tokens_BT.shape
        slots_used = int(slots_BT.max()) + 1
        L = slots_used if visible_BTL is None else visible_BTL.shape[-1]
        self.ensure(slots_used)
        h_BTD = head.fuse(feature_BTD, tokens_BT, prev_tokens_BT)
        s = int(slots_BT[0, 0])
        # one row writing consecutive slots (every chain draft step and catch-up): a plain copy
        contiguous = B == 1 and (
            T == 1 or bool((slots_BT[0] == torch.arange(s, s + T, device=slots_BT.device)).all())
        )
        rows_BT = None if contiguous else torch.arange(B, device=slots_BT.device).unsqueeze(1).expand(B, T)
        # Grouped-query attention without repeating keys: the query heads of one key/value head
        # are stacked as rows (row r·T + t), as in the native target; one mask serves every layer.
        c = head.config
        H, G, d = c.num_heads, c.num_kv_heads, c.head_dim
        rep = H // G
        mask = None if visible_BTL is None else visible_BTL.unsqueeze(1).repeat(1, 1, rep, 1)
        for i in range(c.num_layers):
            q, k, v = head.qkv(h_BTD, positions_BT, i)
            k_cache, v_cache = self.k_BGLd[i], self.v_BGLd[i]
            # k: [B, G, T, d] → cache[b, :, slot, :]
            if contiguous:
                k_cache[:, :, s : s + T] = k
                v_cache[:, :, s : s + T] = v
            else:
                k_cache[rows_BT, :, slots_BT] = k.transpose(1, 2)
                v_cache[rows_BT, :, slots_BT] = v.transpose(1, 2)
            attn = F.scaled_dot_product_attention(
                q.reshape(B, G, rep * T, d), k_cache[:, :, :L], v_cache[:, :, :L], attn_mask=mask
            )
            h_BTD = head.finish(h_BTD, attn.reshape(B, H, T, d), i)
        return head.feature(h_BTD)


# --- weights ----------------------------------------------------------------------------------
def _fingerprint(embed_VD: torch.Tensor) -> str:
    """A cheap check that weights meet the target they were trained for."""
    return f"{float(embed_VD[:256].double().abs().sum()):.4f}"


def target_mismatch(meta: dict, embed_VD: torch.Tensor, path: Path) -> str | None:
    """Why head weights with metadata ``meta`` (read from ``path``) do not fit the target whose
    embedding is ``embed_VD``; None when they do (or carry no fingerprint)."""
    if meta.get("target_fingerprint") and meta["target_fingerprint"] != _fingerprint(embed_VD):
        return (
            f"weights {path.name} were trained for target {meta.get('target')!r}, not this target "
            "(its embedding differs)"
        )
    return None


def save_eagle_head(
    head: EagleHead, path: str | Path, *, target_name: str, embed_VD: torch.Tensor, extra: dict | None = None
) -> None:
    """Write the trainable weights (bf16) and the draft vocabulary (int64) as safetensors."""
    from safetensors.torch import save_file

    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    state["draft_vocab_N"] = head.draft_vocab_N.detach().to(torch.int64).cpu().contiguous()
    meta = {
        "config": json.dumps(asdict(head.config)),
        "target": target_name,
        "target_fingerprint": _fingerprint(embed_VD),
        "extra": json.dumps(extra or {}),
    }
    save_file({k: v.cpu() for k, v in state.items()}, str(path), metadata=meta)


def resolve_weights(weights: str | Path | None) -> Path:
    """A head-weights path: a file, or the name of a file shipped in ``specdec/weights/``
    (None: the default head)."""
    if weights is None:
        weights = DEFAULT_WEIGHTS
    path = Path(weights)
    if path.is_file():
        return path
    shipped = resources.files("specdec") / "weights" / str(weights)
    if shipped.is_file():
        return Path(str(shipped))
    raise ValueError(
        f"weights {str(weights)!r}: no such file, and not a shipped file in specdec/weights/ "
        "(train one with: python -m experiments train-drafter)"
    )


def stored_draft_vocab(weights: str | Path | None) -> torch.Tensor:
    """The draft vocabulary ``[N]`` of head weights in stored order (most frequent first)."""
    from safetensors import safe_open

    with safe_open(str(resolve_weights(weights)), framework="pt") as f:
        return f.get_tensor("draft_vocab_N").to(torch.long)


def load_eagle_head(
    weights: str | Path | None,
    parts: TargetParts,
    *,
    dtype: torch.dtype = torch.float32,
    device: Any = None,
    linear_backend: str | None = None,
    weight_dtype: torch.dtype | None = None,
) -> tuple[EagleHead, dict]:
    """Load a head (safetensors) for the target whose tensors are ``parts``; returns (head, metadata).

    ``linear_backend`` (e.g. ``"auto"``): run inference through ``specdec.targets.linear``'s fast
    layouts (see :meth:`EagleHead.pack`, also for ``weight_dtype``); None keeps plain ``nn.Linear``.
    """
    from safetensors import safe_open

    path = resolve_weights(weights)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        state = {k: f.get_tensor(k) for k in f.keys()}
    if "config" not in meta:
        raise ValueError(f"weights {path} carry no EAGLE config metadata")
    config = EagleConfig(**json.loads(meta["config"]))
    reason = target_mismatch(meta, parts.embed_VD, path)
    if reason is not None:
        raise ValueError(reason)
    head = EagleHead(config)
    vocab = state.pop("draft_vocab_N").to(torch.long)
    head.load_state_dict({**state, "draft_vocab_N": vocab}, strict=True)
    head = head.to(device=device or parts.embed_VD.device, dtype=dtype).eval()
    head.draft_vocab_N = vocab.to(head.fc.weight.device)
    head.requires_grad_(False)
    head.attach(parts)
    if linear_backend is not None:
        head.pack(linear_backend, weight_dtype)
    return head, meta


# --- the drafter ------------------------------------------------------------------------------
_WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def weight_dtype_of(value: torch.dtype | str | None) -> torch.dtype | None:
    """``weight_dtype`` as a torch dtype (None stays None); ``ValueError`` for anything else."""
    if value is None or value in _WEIGHT_DTYPES.values():
        return value
    if isinstance(value, str) and value in _WEIGHT_DTYPES:
        return _WEIGHT_DTYPES[value]
    raise ValueError(f"weight_dtype must be one of {sorted(_WEIGHT_DTYPES)} (or None), got {value!r}")


def draft_distribution(
    logits_BN: torch.Tensor, draft_vocab_N: torch.Tensor, vocab_size: int, sampling: SamplingParams
) -> torch.Tensor:
    """Full-vocabulary draft probabilities ``[B, V]`` from draft-vocabulary logits.

    Equal to ``logits_to_probs`` over the full vocabulary with −inf outside the draft vocabulary
    (the draft vocabulary is sorted by id, so top-k/top-p tie breaks agree).
    """
    probs_BN = logits_to_probs(logits_BN, sampling.temperature, sampling.top_k, sampling.top_p)
    out = torch.zeros(*probs_BN.shape[:-1], vocab_size, dtype=torch.float32, device=probs_BN.device)
    return out.index_copy_(-1, draft_vocab_N, probs_BN)


class EagleDrafter:
    """EAGLE chain drafter: γ tokens per row from the draft head's own predicted features.

    Args:
        target: a native Llama target or ``HFTarget`` that returns ``hidden_BTD``.
        weights: a safetensors file (path, or a file name in ``specdec/weights``); default: the
            shipped head for ``smollm2-135m``.
        draft_vocab_size: use only the n most frequent tokens of the stored draft vocabulary
            (faster head, lower acceptance); default: all of it.
        dtype: compute dtype of the head (float32 by default; bfloat16 is an option).
        linear_backend: ``specdec.targets.linear`` backend for the head's matrix products
            (``"auto"``: the packed CPU kernel where it builds; ``"reference"``: plain ``F.linear``).
        min_prob: confidence stop (:mod:`specdec.drafters.confidence`): stop the chain once the
            head's running probability of its own draft is below this in every row (0: always
            draft γ tokens).
        weight_dtype: storage of the head's packed weights (``"float32"`` or ``"bfloat16"``, or a
            torch dtype). Default: bfloat16 where the packed CPU kernel runs (float32 activations;
            a draft step streams half the bytes, measured ~1/3 less drafting time here), else
            ``dtype``. See :meth:`EagleHead.pack`.

    Greedy runs (temperature 0) propose the head's argmax as a point-mass proposal
    (``probs_BKV=None``); sampling runs draw from :func:`draft_distribution` and return it.
    """

    def __init__(
        self,
        target: Any,
        *,
        weights: str | Path | None = None,
        draft_vocab_size: int | None = None,
        dtype: torch.dtype = torch.float32,
        linear_backend: str = "auto",
        min_prob: float = 0.0,
        weight_dtype: torch.dtype | str | None = None,
    ) -> None:
        self.min_prob = check_min_prob(min_prob)
        self.target = target
        parts = target_parts(target)
        weight_dtype = weight_dtype_of(weight_dtype)
        if weight_dtype is None:
            from specdec.targets.linear import resolve_backend

            packed = resolve_backend(linear_backend, parts.embed_VD.device) == "packed"
            weight_dtype = torch.bfloat16 if packed else dtype
        self.head, self.metadata = load_eagle_head(
            weights, parts, dtype=dtype, linear_backend=linear_backend, weight_dtype=weight_dtype
        )
        stored = self.head.draft_vocab_N
        if draft_vocab_size is not None:
            if not 1 <= draft_vocab_size <= stored.numel():
                raise ValueError(f"draft_vocab_size must be in [1, {stored.numel()}], got {draft_vocab_size}")
            # The stored order is by frequency: keep the most frequent n (read before the sort).
            self.head.attach(parts, stored_draft_vocab(weights)[:draft_vocab_size])
        aux_layers = self.head.config.aux_layers
        if aux_layers:  # an EAGLE-3 head reads low and middle layers too
            if not hasattr(target, "capture_layers"):
                raise ValueError(
                    f"this head fuses target layers {list(aux_layers)}: the target must offer "
                    f"capture_layers() (native Llama or HFTarget), got {type(target).__name__}"
                )
            target.capture_layers(aux_layers)
        self.vocab_size = self.head.config.vocab_size
        self.dtype = dtype
        self.cache: EagleCache | None = None
        self.cache_len_B: torch.Tensor | None = None  # slots holding pairs with true target features
        self._pending_feat_BTD: torch.Tensor | None = None
        self._next_feat_BD: torch.Tensor | None = None

    # --- protocol -------------------------------------------------------------------------
    def begin(self, state: DecodeState, target_out: TargetOutput) -> None:
        """Queue the prompt's pairs ``(f_i, x_{i+1})``; they run at the first ``propose``."""
        pending_BTD = self.input_features(target_out)
        B = state.batch_size
        device = self.head.fc.weight.device
        self.cache = EagleCache(self.head, B, state.tokens_BL.shape[1] + 64)
        self.cache_len_B = torch.zeros(B, dtype=torch.long, device=device)
        self._pending_feat_BTD = pending_BTD
        self._next_feat_BD = torch.zeros(B, self.head.config.hidden_size, dtype=self.dtype, device=device)

    def observe(self, state: DecodeState, num_accepted_B: torch.Tensor, target_out: TargetOutput) -> None:
        """Queue the verified block's true features; drafted slots past them become stale."""
        self._pending_feat_BTD = self.input_features(target_out)

    @torch.inference_mode()
    def input_features(self, target_out: TargetOutput) -> torch.Tensor:
        """The head's input features ``[B, T, D]`` for a target block: the last layer's features,
        fused with the aux layers' for an EAGLE-3 head (:meth:`EagleHead.project`)."""
        if target_out.hidden_BTD is None:
            raise ValueError("the EAGLE drafter needs target features: the target returned hidden_BTD=None")
        hidden_BTD = target_out.hidden_BTD.to(self.dtype)
        layers = self.head.config.aux_layers
        if not layers:
            return hidden_BTD
        aux = target_out.aux_hidden_BTD or {}
        missing = [i for i in layers if i not in aux]
        if missing:
            raise ValueError(
                f"the EAGLE-3 head needs the outputs of target layers {missing} (aux_hidden_BTD); "
                "the target was not asked to capture them (capture_layers)"
            )
        aux_BTAD = torch.stack([aux[i].to(self.dtype) for i in layers], dim=2)
        return self.head.project(hidden_BTD, aux_BTAD)

    @torch.inference_mode()
    def propose(self, state: DecodeState, gamma: int, generator: torch.Generator | None = None) -> Proposal:
        """Draft ``gamma`` tokens per row (the head's argmax when greedy, else sampled)."""
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        feat_BD = self.catch_up(state)
        B = state.batch_size
        device = feat_BD.device
        tokens, probs = [], []
        slot_B = self.cache_len_B.clone()
        rows_B = torch.arange(B, device=device)
        prev_B = state.last_tokens_B().to(device)  # the token at the first draft pair's feature
        stop = ConfidenceStop(self.min_prob, B, device)
        for k in range(gamma):
            logits_BN = self.head.logits(feat_BD)
            token_B, probs_BV = self.choose(logits_BN, state.sampling, generator)
            if self.min_prob > 0:
                if probs_BV is None:  # greedy: the head's own probability of its argmax (T = 1)
                    kept = stop.keep(logits_BN.argmax(dim=-1), logits_BV=logits_BN)
                else:
                    kept = stop.keep(token_B, probs_BV=probs_BV)
                if not kept:
                    break
            tokens.append(token_B)
            probs.append(probs_BV)
            if k + 1 < gamma:
                feat_BD = self.chain_step(feat_BD, token_B, slot_B, rows_B, prev_B)
                slot_B, prev_B = slot_B + 1, token_B
        if not tokens:
            return Proposal(torch.zeros(B, 0, dtype=torch.long, device=device), None)
        probs_BKV = None if state.sampling.greedy else torch.stack(probs, dim=1)
        return Proposal(torch.stack(tokens, dim=1), probs_BKV)

    # --- pieces (also used by the tree drafter) ---------------------------------------------
    def catch_up(self, state: DecodeState) -> torch.Tensor:
        """Run the queued pairs with true features; return each row's next predicted feature [B, D].

        Row b's queued pairs fill slots ``cache_len[b] .. lengths[b]-2``: the feature at slot s
        (from the queued block, which starts at ``cache_len[b]``) with committed token s+1.
        """
        if self.cache is None:
            raise ValueError("propose() called before begin()")
        feats_BTD = self._pending_feat_BTD
        count_B = (state.lengths_B.to(self.cache_len_B.device) - 1 - self.cache_len_B).clamp(
            min=0, max=feats_BTD.shape[1]
        )
        T = int(count_B.max())
        if T == 0:
            return self._next_feat_BD
        B = state.batch_size
        device = feats_BTD.device
        ar_T = torch.arange(T, device=device)
        slots_BT = self.cache_len_B.unsqueeze(1) + ar_T
        # Committed tokens at slots s .. s+T: x_s is each pair's previous token, x_{s+1} its token.
        window_BT1 = state.tokens_BL.to(device).gather(
            1,
            (self.cache_len_B.unsqueeze(1) + torch.arange(T + 1, device=device)).clamp(
                max=state.tokens_BL.shape[1] - 1
            ),
        )
        prev_BT, tokens_BT = window_BT1[:, :-1], window_BT1[:, 1:]
        L = int(slots_BT.max()) + 1
        visible_BTL = torch.arange(L, device=device) <= slots_BT.unsqueeze(-1)
        out_BTD = self.cache.step(
            self.head, feats_BTD[:, :T], tokens_BT, slots_BT, slots_BT, visible_BTL, prev_BT
        )
        last_B = (count_B - 1).clamp(min=0)
        rows_B = torch.arange(B, device=device)
        has_B = (count_B > 0).unsqueeze(1)
        self._next_feat_BD = torch.where(has_B, out_BTD[rows_B, last_B], self._next_feat_BD)
        self.cache_len_B = self.cache_len_B + count_B
        self._pending_feat_BTD = feats_BTD[:, :0]
        return self._next_feat_BD

    def chain_step(
        self,
        feat_BD: torch.Tensor,
        token_B: torch.Tensor,
        slot_B: torch.Tensor,
        rows_B: torch.Tensor,
        prev_B: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One autoregressive draft step: pair ``(f̂, token)`` at ``slot_B`` → next ``f̂``
        (``prev_B``: the token at f̂'s position, for a ``prev_token_input`` head)."""
        slots_B1 = slot_B.unsqueeze(1)
        if bool((slot_B == slot_B[0]).all()):
            visible_B1L = None  # every row sees slots 0..slot: no mask needed
        else:
            visible_B1L = torch.arange(int(slot_B.max()) + 1, device=slot_B.device) <= slots_B1.unsqueeze(-1)
        prev_B1 = None if prev_B is None else prev_B.unsqueeze(1)
        out = self.cache.step(
            self.head, feat_BD.unsqueeze(1), token_B.unsqueeze(1), slots_B1, slots_B1, visible_B1L, prev_B1
        )
        return out[:, 0]

    def choose(
        self, logits_BN: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pick a draft token per row: argmax when greedy, else a sample; returns (token, probs)."""
        if sampling.greedy:
            return self.head.draft_vocab_N[logits_BN.argmax(dim=-1)], None
        probs_BV = draft_distribution(logits_BN, self.head.draft_vocab_N, self.vocab_size, sampling)
        return sample_from_probs(probs_BV, generator), probs_BV


def _num_params(head: EagleHead) -> int:
    return sum(p.numel() for p in head.parameters())


def describe(head: EagleHead) -> str:
    """One line: trainable params and draft vocabulary."""
    c = head.config
    return (
        f"EAGLE head: {_num_params(head) / 1e6:.2f}M trainable params, "
        f"draft vocab {head.draft_vocab_N.numel()}/{c.vocab_size}, "
        f"{c.num_layers} decoder layer{'s' if c.num_layers > 1 else ''} of dim {c.hidden_size}, "
        f"ffn {c.intermediate_size}, "
        f"{c.num_heads}/{c.num_kv_heads} heads; head flops/token ≈ "
        f"{2 * (_num_params(head) + head.draft_vocab_N.numel() * c.hidden_size) / 1e6:.1f} MFLOP"
        f" (rope θ={c.rope_theta:g}, {math.prod(head.fc.weight.shape) / 1e6:.2f}M in fc"
        + (" with the previous token's embedding" if c.prev_token_input else "")
        + (
            f", {math.prod(head.fc_aux.weight.shape) / 1e6:.2f}M in fc_aux fusing layers {list(c.aux_layers)}"
            if head.fc_aux is not None
            else ""
        )
        + ")"
    )
