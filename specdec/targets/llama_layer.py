"""One Llama decoder layer in PyTorch ops over the static KV cache: the native target's reference path.

Legend: B batch, T block length, D model dim, H query heads, J key/value heads, G query heads per
key/value head (H = J·G), E head dim, S attended slots, R = G·T stacked query rows, F = H·E.

Grouped-query attention runs as one attention per key/value head with its G query heads stacked as
rows (row ``g·T + t``), so keys and values are never repeated; the mask is built once per forward
for those stacked rows (:func:`stacked_attention_mask`), causal for a chain, the tree's ancestors
for a tree (SpecInfer, arXiv 2305.09781). The layer's products are
:class:`specdec.targets.linear.PackedLinear` calls with the RMSNorms, the SwiGLU and the residual
adds fused into them. This path runs blocks longer than the native forward takes, every block off
the CPU, and is the oracle ``kernels/csrc/llama_forward.c`` is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.targets.kv_cache import StaticKVCache, block_attention_mask
from specdec.targets.llama_config import LlamaConfig
from specdec.targets.llama_weights import LayerWeights
from specdec.targets.rope import apply_rope_flipped

__all__ = ["stacked_attention_mask", "decoder_layer"]


def stacked_attention_mask(
    start_B: torch.Tensor,
    num_slots: int,
    block_TT: torch.Tensor,
    G: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive mask ``[B, 1, R, S]`` (0 where a stacked query row attends, -inf elsewhere) for a
    block written at ``start_B[b] + arange(T)`` whose tokens attend each other as ``block_TT`` says.

    Additive once per forward: a bool mask is converted in every layer's attention call (same result
    bit for bit; ~5 µs of ~40 per layer at 7 tokens on a CPU). ``dtype``: the queries' dtype."""
    allowed = block_attention_mask(start_B, num_slots, block_TT).repeat(1, 1, G, 1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=start_B.device)
    return mask.masked_fill_(~allowed, float("-inf"))


def decoder_layer(
    config: LlamaConfig,
    layer: LayerWeights,
    cache: StaticKVCache,
    i: int,
    x_BTD: torch.Tensor,
    cos_BT1E: torch.Tensor,
    sin_BT1E: torch.Tensor,
    start_B: torch.Tensor,
    uniform: int | None,
    num_slots: int,
    mask: torch.Tensor | None,
    rows_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """Layer ``i`` on ``x_BTD``: write the block's keys/values at ``start_B[b] + arange(T)`` of the
    cache rows (``rows_B``; default every row in order), attend over the first ``num_slots`` slots
    under ``mask`` (None: every slot, a one-token uniform block), then the MLP; returns the output.

    ``uniform``: the common start when every row starts at the same slot (see
    :meth:`StaticKVCache.write`). ``cos_BT1E`` / ``sin_BT1E``: the rope tables at the tokens'
    positions (``sin`` flipped, :func:`specdec.targets.rope.flip_sin`)."""
    c = config
    B, T, _ = x_BTD.shape
    H, J, E = c.num_heads, c.num_kv_heads, c.head_dim
    G = H // J

    qkv = layer.qkv(x_BTD).view(B, T, H + 2 * J, E)
    qk = qkv[:, :, : H + J]
    if layer.qk_norm is not None:  # Qwen3: RMSNorm over each head before rope, in float32
        qk32 = qk.float()
        qk32 = layer.qk_norm * (qk32 * torch.rsqrt(qk32.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps))
        qk = qk32.to(qkv.dtype)
    qk = apply_rope_flipped(qk, cos_BT1E, sin_BT1E)
    q_BTHE, k_BTJE, v_BTJE = qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + J :]
    cache.write(i, k_BTJE, v_BTJE, start_B, uniform, rows_B)

    if rows_B is None:
        k_BJSE = cache.k_NBHLD[i, :, :, :num_slots]
        v_BJSE = cache.v_NBHLD[i, :, :, :num_slots]
    else:  # a subset of the cache's rows (one gather per layer; prefill chunks and fallbacks only)
        k_BJSE = cache.k_NBHLD[i, rows_B, :, :num_slots]
        v_BJSE = cache.v_NBHLD[i, rows_B, :, :num_slots]
    q_BJRE = q_BTHE.reshape(B, T, J, G, E).permute(0, 2, 3, 1, 4).reshape(B, J, G * T, E)
    o_BJRE = F.scaled_dot_product_attention(q_BJRE, k_BJSE, v_BJSE, attn_mask=mask, scale=E**-0.5)
    o_BTF = o_BJRE.view(B, J, G, T, E).permute(0, 3, 1, 2, 4).reshape(B, T, H * E)
    x_BTD = layer.o(o_BTF, x_BTD)
    return layer.down(layer.gate_up(x_BTD), x_BTD)
