"""Rotary position embeddings (RoPE, Su et al. 2021, arXiv 2104.09864) as a precomputed table.

Legend: B batch, T block length, H heads, P positions, R rotary half-dim (head_dim / 2).

Matches ``transformers``' Llama-family rotary embedding in fp32: the non-interleaved "rotate half"
layout, ``inv_freq = 1 / theta^(2i/d)``, and the static scalings ``linear`` and ``llama3``
(Llama 3.1). Types whose frequencies depend on the sequence length (``dynamic``, ``longrope``) or
that rescale attention (``yarn``) are refused with ``ValueError`` rather than run differently.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "SUPPORTED_ROPE_TYPES",
    "rope_inv_freq",
    "rope_cos_sin_table",
    "apply_rope",
    "flip_sin",
    "apply_rope_flipped",
]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, rope: Mapping[str, Any]) -> torch.Tensor:
    """Inverse frequencies ``[R]`` (float32) for a ``rope_parameters`` dict (type, theta, scaling)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not implemented by the native target (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}); use the 'hf' target backend for this model"
        )
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(
            f"partial_rotary_factor must be 1.0 for the native target, got {rope['partial_rotary_factor']}"
        )
    theta = float(rope["rope_theta"])
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(rope["factor"])
    elif rope_type == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_context = float(rope["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`; short ones kept; the band between interpolated.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin_table(inv_freq_R: torch.Tensor, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos_PD, sin_PD`` (float32, D = 2R) for positions ``0 .. num_positions-1``."""
    positions_P = torch.arange(num_positions, dtype=torch.float32, device=inv_freq_R.device)
    freqs_PR = positions_P[:, None] * inv_freq_R.float()[None, :]
    emb_PD = torch.cat((freqs_PR, freqs_PR), dim=-1)
    return emb_PD.cos(), emb_PD.sin()


def apply_rope(x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, T, D]`` by per-token angles ``cos/sin [B, T, D]`` (rotate-half layout)."""
    half = x_BHTD.shape[-1] // 2
    x1, x2 = x_BHTD[..., :half], x_BHTD[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x_BHTD * cos_BTD[:, None] + rotated * sin_BTD[:, None]


def flip_sin(sin_PD: torch.Tensor) -> torch.Tensor:
    """``[−sin, sin]`` over the two halves: the table :func:`apply_rope_flipped` takes (build it once)."""
    half = sin_PD.shape[-1] // 2
    return torch.cat((-sin_PD[..., :half], sin_PD[..., half:]), dim=-1)


def apply_rope_flipped(x_D: torch.Tensor, cos_D: torch.Tensor, flipped_sin_D: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` with one flip instead of slice/neg/cat: ``rotate_half(x)·sin ==
    flip_halves(x)·[−sin, sin]`` (the same products, so the same floats). ``x [..., D]``; ``cos`` and
    ``flipped_sin`` (from :func:`flip_sin`) broadcast against it."""
    half = x_D.shape[-1] // 2
    return x_D * cos_D + x_D.unflatten(-1, (2, half)).flip(-2).flatten(-2) * flipped_sin_D
