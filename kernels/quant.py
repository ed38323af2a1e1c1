"""Weight-only quantisation into the packed kernel's formats, and GGUF blocks read without conversion.

Legend: O output features, I input features, G inputs per group, nG = I / G.

A :class:`QuantizedRows` is a quantised weight before packing: its output rows can be reordered and
concatenated (a model fuses q|k|v and gate|up), then :meth:`QuantizedRows.pack` lays it out for the
kernel (:mod:`kernels.packed_gemm`). Sources:

- :func:`quantize_int8`: per-channel symmetric int8, ``w ≈ d[o] * q`` (``q`` in -127..127, one
  float16 scale per output row): the ``q8`` format with ``G = I``;
- :func:`quantize_int4`: group-wise asymmetric int4 with scales and zero points, after gpt-fast's
  ``quantize.py`` (``w ≈ d[o, g] * q + m[o, g]``, ``q`` in 0..15, ``m`` the group's minimum): ``q4``;
- :func:`from_gguf_blocks`: GGUF ``Q4_0``, ``Q4_1`` and ``Q8_0`` tensors as stored in the file (blocks
  of 32 inputs: ``{d, qs}``, ``{d, m, qs}``, ``{d, qs}``) with the same float16 scales and the same
  4- or 8-bit values, so the dequantised weight is bit for bit what ``gguf`` (and transformers, which
  dequantises through it) computes.

:meth:`QuantizedRows.dequantize` is the float32 oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .packed_gemm import PackedWeight, pack_q4, pack_q8

__all__ = ["GGUF_KINDS", "QuantizedRows", "quantize_int8", "quantize_int4", "from_gguf_blocks"]

GGUF_KINDS = ("Q4_0", "Q4_1", "Q8_0")
"""GGUF quantisation types read natively (each a block of 32 inputs)."""
_QK = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass(frozen=True, eq=False)
class QuantizedRows:
    """``W[o, i] = d[o, i // G] * q[o, i] (+ m[o, i // G])``: ``kind`` ``q8`` (``q`` int8, no ``m``) or
    ``q4`` (``q`` uint8 in 0..15); ``d`` and ``m`` float16 ``[O, I / G]``."""

    kind: str
    q_OI: Tensor
    d_OG: Tensor
    m_OG: Tensor | None
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q_OI.shape)

    def rows(self, index_O: Tensor) -> QuantizedRows:
        """The rows ``index_O`` (a permutation or a selection) in that order."""
        m = None if self.m_OG is None else self.m_OG[index_O]
        return QuantizedRows(self.kind, self.q_OI[index_O], self.d_OG[index_O], m, self.group_size)

    @staticmethod
    def cat(parts: list[QuantizedRows]) -> QuantizedRows:
        """Rows of several weights of one kind and group size, stacked (a fused q|k|v)."""
        kinds = {(p.kind, p.group_size, p.shape[1]) for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse quantised weights of different kinds or shapes: {sorted(kinds)}")
        m = None if parts[0].m_OG is None else torch.cat([p.m_OG for p in parts])
        return QuantizedRows(
            parts[0].kind,
            torch.cat([p.q_OI for p in parts]),
            torch.cat([p.d_OG for p in parts]),
            m,
            parts[0].group_size,
        )

    def dequantize(self) -> Tensor:
        """The float32 ``[O, I]`` weight (the oracle)."""
        O, I = self.shape
        G = self.group_size
        w = self.d_OG.float().repeat_interleave(G, dim=1) * self.q_OI.float()
        if self.m_OG is not None:
            w = w + self.m_OG.float().repeat_interleave(G, dim=1)
        return w.view(O, I)

    def pack(self, isa: str | None = None, *, act8: bool = False) -> PackedWeight:
        """The kernel's layout on an ISA path (``act8``: the ``q8a8`` / ``q4a8`` layout, run with 8-bit
        activations)."""
        if self.kind == "q8":
            return pack_q8(self.q_OI, self.d_OG, self.group_size, isa=isa, act8=act8)
        return pack_q4(self.q_OI, self.d_OG, self.m_OG, self.group_size, isa=isa, act8=act8)


def _check_weight(w_OI: Tensor, name: str) -> Tensor:
    if not isinstance(w_OI, Tensor) or w_OI.dim() != 2 or not w_OI.is_floating_point():
        raise ValueError(
            f"{name}: w_OI must be a floating-point [O, I] tensor, got {getattr(w_OI, 'shape', w_OI)}"
        )
    if not bool(torch.isfinite(w_OI).all()):
        raise ValueError(f"{name}: w_OI holds NaN or inf")
    return w_OI.detach().float().cpu()


def _divide(x: Tensor, scale: Tensor) -> Tensor:
    """``x / scale`` where the scale is positive, 0 where it is 0 (an all-equal row or group)."""
    return torch.where(
        scale > 0, x / torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(x)
    )


def quantize_int8(w_OI: Tensor) -> QuantizedRows:
    """Per-channel symmetric int8: ``d = max|w[o]| / 127`` (float16), ``q = round(w / d)``."""
    w = _check_weight(w_OI, "quantize_int8")
    d = (w.abs().amax(dim=1, keepdim=True) / 127).half()
    q = torch.round(_divide(w, d.float())).clamp(-127, 127).to(torch.int8)
    return QuantizedRows("q8", q, d, None, w.shape[1])


def quantize_int4(w_OI: Tensor, group_size: int = 32) -> QuantizedRows:
    """Group-wise asymmetric int4 with scales and zero points (``G = group_size`` inputs a group):
    ``m = min``, ``d = (max - min) / 15`` (both float16), ``q = round((w - m) / d)`` in 0..15."""
    w = _check_weight(w_OI, "quantize_int4")
    O, I = w.shape
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or I % group_size:
        raise ValueError(f"quantize_int4: group_size must divide in_features={I}, got {group_size!r}")
    g = w.view(O, I // group_size, group_size)
    m = g.amin(dim=-1).half()
    d = ((g.amax(dim=-1) - m.float()) / 15).half()
    q = torch.round(_divide(g - m.float().unsqueeze(-1), d.float().unsqueeze(-1))).clamp(0, 15)
    return QuantizedRows("q4", q.to(torch.uint8).view(O, I), d, m, group_size)


def from_gguf_blocks(raw: np.ndarray, kind: str, out_features: int, in_features: int) -> QuantizedRows:
    """A GGUF ``Q4_0`` / ``Q4_1`` / ``Q8_0`` tensor's raw bytes (``[O, row bytes]``, as ``gguf``'s reader
    maps them) with the same float16 scales and quantised values; ``ValueError`` for other types."""
    if kind not in _BLOCK_BYTES:
        raise ValueError(
            f"GGUF tensor type {kind!r} is not read natively; supported: {', '.join(GGUF_KINDS)}"
        )
    if in_features % _QK:
        raise ValueError(f"a {kind} tensor needs in_features divisible by {_QK}, got {in_features}")
    nG, size = in_features // _QK, _BLOCK_BYTES[kind]
    if raw.size != out_features * nG * size:
        raise ValueError(
            f"a {kind} [{out_features}, {in_features}] tensor has {out_features * nG * size} bytes, "
            f"got {raw.size}"
        )
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(out_features, nG, size)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])  # [O, nG]
    if kind == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(out_features, in_features)
        return QuantizedRows("q8", q, d, None, _QK)
    qs = torch.from_numpy(blocks[..., 4:].copy() if kind == "Q4_1" else blocks[..., 2:].copy())  # [O, nG, 16]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(out_features, in_features)  # inputs j, 16 + j
    if kind == "Q4_1":
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
    else:  # Q4_0: w = d * (q - 8) = d * q + (-8 d), exact in float32
        m = (-8 * d.float()).half()
    return QuantizedRows("q4", q, d, m, _QK)
