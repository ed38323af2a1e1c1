"""The EAGLE draft head as a plain PyTorch module: what training runs, and the oracle of the fast path.

Legend: B batch, T block length, D hidden size, F MLP size, H query heads, G key/value heads,
d head dim, N draft vocabulary, V target vocabulary, A aux layers.

Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"
(arXiv 2401.15077). The target's *feature* f_t (its last decoder layer's output before the final
norm, at the position of token x_t) predicts x_{t+1}. The head predicts the next feature
autoregressively::

    f̂_{t+1} = DecoderLayer(fc([embed(x_{t+1}); f_t]))          (one Llama layer, own KV cache)
    draft_probs(x_{t+2}) = softmax(head(norm(f̂_{t+1})))        (target's final norm)

The head reuses the target's embedding, final norm and LM-head rows. The LM head is restricted to a
draft vocabulary of the N most frequent tokens (EAGLE-3, arXiv 2503.01840): the full 49,152 × 576
head would cost a fifth of the target per draft token. An EAGLE-3 head first fuses the target's low,
middle and last-layer features into its input feature (``fc_aux``, :meth:`EagleHead.project`).

Inference runs the same function through :class:`specdec.drafters.eagle.packed.PackedEagleHead`;
both expose the steps :class:`specdec.drafters.eagle.cache.EagleCache` calls: ``fuse``, ``qkv``,
``finish``, ``feature`` and ``logits``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.drafters.eagle.config import EagleConfig
from specdec.protocols import TargetParts
from specdec.targets.rmsnorm import rms_norm
from specdec.targets.rope import apply_rope, rope_cos_sin_table, rope_inv_freq

__all__ = ["EagleHead", "RopeTable", "fc_scales", "describe"]


def fc_scales(config: EagleConfig) -> list[float]:
    """The input scale of each of ``fc``'s blocks, in :meth:`EagleHead.fuse`'s order."""
    c = config
    return [c.embed_scale, c.feature_scale] + ([c.embed_scale] if c.prev_token_input else [])


class RopeTable:
    """The target's rotary tables (``specdec.targets.rope``, with its scalings), grown by doubling."""

    def __init__(self, config: EagleConfig) -> None:
        self.inv_freq_R = rope_inv_freq(config.head_dim, config.rope_parameters)
        self.cos_PD: torch.Tensor | None = None
        self.sin_PD: torch.Tensor | None = None

    def lookup(self, positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [B, T, d]`` (float32) at integer positions."""
        need = int(positions_BT.max()) + 1
        if self.cos_PD is None or self.cos_PD.shape[0] < need or self.cos_PD.device != positions_BT.device:
            size = max(need, 2 * (0 if self.cos_PD is None else self.cos_PD.shape[0]), 256)
            self.cos_PD, self.sin_PD = rope_cos_sin_table(self.inv_freq_R.to(positions_BT.device), size)
        return self.cos_PD[positions_BT], self.sin_PD[positions_BT]


class EagleHead(nn.Module):
    """One Llama decoder layer over ``fc([embed(token); feature])``, plus the reduced LM head.

    Trainable: ``fc`` (and ``fc_aux``) and the layer (``qkv_proj``, ``o_proj``, ``post_norm``,
    ``gate_up_proj``, ``down_proj``). As in EAGLE, the layer has no input norm: ``fc`` feeds it
    directly. The embedding, final norm and head rows are the target's (set by :meth:`attach`).
    """

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear((3 if c.prev_token_input else 2) * c.hidden_size, c.hidden_size, bias=True)
        A = len(c.aux_layers)
        self.fc_aux = nn.Linear((A + 1) * c.hidden_size, c.hidden_size, bias=False) if A else None
        if self.fc_aux is not None:  # start as the EAGLE-1 input (g = f); training mixes the aux layers in
            with torch.no_grad():
                self.fc_aux.weight.zero_()
                self.fc_aux.weight[:, A * c.hidden_size :] = torch.eye(c.hidden_size)
        qkv_out = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, qkv_out, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.post_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.register_buffer("draft_vocab_N", torch.arange(c.draft_vocab_size), persistent=True)
        self.rope = RopeTable(c)
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
        self.draft_vocab_N = torch.sort(vocab.to(torch.long)).values.to(self.fc.weight.device)
        dtype = self.fc.weight.dtype
        self.embed_VD = parts.embed_VD
        self.norm_D = parts.norm_D.to(dtype)
        self.norm_eps = parts.norm_eps
        self.head_ND = parts.lm_head_VD[self.draft_vocab_N].to(dtype).contiguous()
        return self

    # --- the steps of a draft (shared with PackedEagleHead) ----------------------------------
    def project(self, feature_BTD: torch.Tensor, aux_BTAD: torch.Tensor | None = None) -> torch.Tensor:
        """The head's input feature for target features: ``fc_aux([a_1; …; a_A; f])`` (each at unit
        scale; EAGLE-3), returned at the feature's scale. An EAGLE-1 head returns ``feature_BTD``.

        ``aux_BTAD``: the outputs of ``config.aux_layers``, in that order, at the same positions.
        """
        if self.fc_aux is None:
            return feature_BTD
        x_BTI = check_aux(self.config, feature_BTD, aux_BTAD)
        c = self.config
        scales = torch.tensor([*c.aux_scales, c.feature_scale], dtype=x_BTI.dtype, device=x_BTI.device)
        return self.fc_aux(x_BTI * scales.repeat_interleave(c.hidden_size)) / c.feature_scale

    def fuse(
        self, feature_BTD: torch.Tensor, tokens_BT: torch.Tensor, prev_tokens_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``fc([embed(x_{t+1}); f_t])`` (both at unit scale): the layer input; with
        ``config.prev_token_input``, ``fc([embed(x_{t+1}); f_t; embed(x_t)])`` (``prev_tokens_BT`` = x_t)."""
        blocks = fc_inputs(self.config, self.embed_VD, feature_BTD, tokens_BT, prev_tokens_BT)
        return self.fc(
            torch.cat([x * a for x, a in zip(blocks, fc_scales(self.config), strict=True)], dim=-1)
        )

    def qkv(self, h_BTD: torch.Tensor, positions_BT: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The residual stream's projection, rotated: ``q [B, H, T, d]``, ``k, v [B, G, T, d]``."""
        return rotated_heads(self.config, self.rope, self.qkv_proj(h_BTD), positions_BT)

    def finish(self, h_BTD: torch.Tensor, attn_BHTd: torch.Tensor) -> torch.Tensor:
        """The layer's output projection, residual and MLP: the next residual stream (unit scale)."""
        B, H, T, d = attn_BHTd.shape
        h_BTD = h_BTD + self.o_proj(attn_BHTd.transpose(1, 2).reshape(B, T, H * d))
        gate, up = self.gate_up_proj(rms_norm(h_BTD, self.post_norm, self.norm_eps)).chunk(2, dim=-1)
        return h_BTD + self.down_proj(F.silu(gate) * up)

    def feature(self, h_BTD: torch.Tensor) -> torch.Tensor:
        """The residual stream back at the target's feature scale: the predicted feature ``f̂``."""
        return h_BTD / self.config.feature_scale

    def logits(self, feature_BTD: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[..., N]`` of a (predicted) feature."""
        return F.linear(
            rms_norm(feature_BTD, self.norm_D, self.norm_eps).to(self.head_ND.dtype), self.head_ND
        )

    def forward(
        self, feature_BTD: torch.Tensor, tokens_BT: torch.Tensor, prev_tokens_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Reference teacher-forced pass over whole sequences (causal, positions 0..T-1):
        ``f̂_{t+1}`` for every pair ``(f_t, x_{t+1})`` (and ``x_t``, see :meth:`fuse`)."""
        B, T, _ = feature_BTD.shape
        positions_BT = torch.arange(T, device=feature_BTD.device).expand(B, T)
        h_BTD = self.fuse(feature_BTD, tokens_BT, prev_tokens_BT)
        q, k, v = self.qkv(h_BTD, positions_BT)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.feature(self.finish(h_BTD, attn))


def rotated_heads(
    c: EagleConfig, rope: RopeTable, qkv_BTC: torch.Tensor, positions_BT: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """A fused q/k/v projection split into heads, q and k rotated: ``q [B, H, T, d]``,
    ``k, v [B, G, T, d]``."""
    B, T, _ = qkv_BTC.shape
    q, k, v = qkv_BTC.split(
        [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], dim=-1
    )
    q = q.view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
    k = k.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
    v = v.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
    cos, sin = rope.lookup(positions_BT)
    cos, sin = cos.to(qkv_BTC.dtype), sin.to(qkv_BTC.dtype)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def check_aux(config: EagleConfig, feature_BTD: torch.Tensor, aux_BTAD: torch.Tensor | None) -> torch.Tensor:
    """``[a_1; …; a_A; f]`` flattened to ``[B, T, (A + 1) · D]`` after checking ``aux_BTAD``'s shape."""
    A, D = len(config.aux_layers), config.hidden_size
    if aux_BTAD is None or aux_BTAD.shape[:-2] != feature_BTD.shape[:-1] or aux_BTAD.shape[-2:] != (A, D):
        raise ValueError(
            f"aux_BTAD must be [{', '.join(map(str, feature_BTD.shape[:-1]))}, A={A}, D={D}] "
            f"(the outputs of layers {list(config.aux_layers)}), got "
            f"{None if aux_BTAD is None else tuple(aux_BTAD.shape)}"
        )
    return torch.cat((aux_BTAD.to(feature_BTD.dtype).flatten(-2), feature_BTD), dim=-1)


def fc_inputs(
    config: EagleConfig,
    embed_VD: torch.Tensor,
    feature_BTD: torch.Tensor,
    tokens_BT: torch.Tensor,
    prev_tokens_BT: torch.Tensor | None,
) -> list[torch.Tensor]:
    """``fc``'s input blocks, unscaled: ``[embed(x_{t+1}), f_t]`` and, for a ``prev_token_input``
    head, ``embed(x_t)``."""
    blocks = [F.embedding(tokens_BT, embed_VD).to(feature_BTD.dtype), feature_BTD]
    if config.prev_token_input:
        if prev_tokens_BT is None or prev_tokens_BT.shape != tokens_BT.shape:
            raise ValueError(
                "prev_tokens_BT must be the tokens at the features' positions, shaped like tokens_BT "
                f"{tuple(tokens_BT.shape)}, for a head with prev_token_input; got "
                f"{None if prev_tokens_BT is None else tuple(prev_tokens_BT.shape)}"
            )
        blocks.append(F.embedding(prev_tokens_BT, embed_VD).to(feature_BTD.dtype))
    return blocks


def describe(head: EagleHead) -> str:
    """One line: trainable params, draft vocabulary, layer shape and per-token cost."""
    c = head.config
    params = sum(p.numel() for p in head.parameters())
    fc = f"{head.fc.weight.numel() / 1e6:.2f}M in fc" + (
        " with the previous token's embedding" if c.prev_token_input else ""
    )
    if head.fc_aux is not None:
        fc += f", {head.fc_aux.weight.numel() / 1e6:.2f}M in fc_aux fusing layers {list(c.aux_layers)}"
    return (
        f"EAGLE head: {params / 1e6:.2f}M trainable params, draft vocab {head.draft_vocab_N.numel()}/"
        f"{c.vocab_size}, one decoder layer of dim {c.hidden_size}, ffn {c.intermediate_size}, "
        f"{c.num_heads}/{c.num_kv_heads} heads; head flops/token ≈ "
        f"{2 * (params + head.draft_vocab_N.numel() * c.hidden_size) / 1e6:.1f} MFLOP "
        f"(rope {c.rope_parameters}, {fc})"
    )
