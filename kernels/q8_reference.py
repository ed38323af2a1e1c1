"""The plain-PyTorch oracle of the products with 8-bit activations (``q8a8`` / ``q4a8``, ``csrc/q8_gemm.c``).

Legend: M rows, I input features, O output features, G inputs per weight group, B = I / 32 activation
blocks, nG = I / G weight groups.

The arithmetic (llama.cpp's Q8_0 / Q8_1 activations against Q8_0 / Q4_0 / Q4_1 weights):

- each row of ``x`` in blocks of 32: ``d = max|x| / 127`` (float32), ``q = round(x * (1 / d))`` with
  round-half-to-even (``torch.round``, the kernel's ``cvtps2dq``), 0 where ``d`` is 0; the group sums
  ``s[g] = Σ_{b in g} d_b · Σ q_b`` (float32, block after block);
- weights ``W = dw · qw (+ mw)`` per group of G inputs (:class:`kernels.quant.QuantizedRows`);
- ``y[m, o] = Σ_g ( Σ_{b in g} (dw[o, g] · d[m, b]) · isum[m, o, b] + mw[o, g] · s[m, g] )`` with
  ``isum`` the int32 dot product of the block's ``qw`` and ``q``.

:func:`quantize_activations` is bit for bit what the kernel computes (same operations, same
rounding); :func:`linear_a8_reference` differs from the kernel only in the order (and fusing) of the
float additions of the per-block terms. Both run on any device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .quant import QuantizedRows

__all__ = ["ACT8_BLOCK", "quantize_activations", "dequantize_activations", "linear_a8_reference"]

ACT8_BLOCK = 32
"""Inputs per activation block."""


def quantize_activations(x_MI: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Float rows ``x [M, I]`` to 8 bits: int8 ``q [M, I]``, float32 block scales ``d [M, B]`` and group
    sums ``s [M, nG]`` (``group_size``: G, a multiple of 32 that divides I)."""
    if x_MI.dim() != 2 or not x_MI.is_floating_point():
        raise ValueError(f"x_MI must be a float [M, I] tensor, got {getattr(x_MI, 'shape', x_MI)}")
    M, I = x_MI.shape
    if group_size < 1 or group_size % ACT8_BLOCK or I % group_size:
        raise ValueError(
            f"group_size must be a multiple of {ACT8_BLOCK} that divides in_features={I}, got {group_size}"
        )
    x = x_MI.float().reshape(M, I // ACT8_BLOCK, ACT8_BLOCK)
    d_MB = x.abs().amax(dim=-1) / 127
    inv_MB = torch.where(d_MB > 0, torch.ones_like(d_MB) / d_MB, torch.zeros_like(d_MB))
    q = torch.round(x * inv_MB[..., None]).clamp(-127, 127)
    block_sums = d_MB * q.sum(dim=-1)  # Σq is an exact integer in float32 (|Σq| <= 32·127)
    per_group = group_size // ACT8_BLOCK
    by_group = block_sums.view(M, I // group_size, per_group)
    s_MG = by_group[..., 0]
    for j in range(1, per_group):  # in block order, as the kernel adds them
        s_MG = s_MG + by_group[..., j]
    return q.to(torch.int8).view(M, I), d_MB, s_MG.contiguous()


def dequantize_activations(q_MI: Tensor, d_MB: Tensor) -> Tensor:
    """``d · q``: the float32 rows the 8-bit activations stand for."""
    M, I = q_MI.shape
    return (q_MI.float().view(M, -1, ACT8_BLOCK) * d_MB[..., None]).view(M, I)


def linear_a8_reference(
    x_MI: Tensor, weight: QuantizedRows, bias_O: Tensor | None = None, *, row_scale_M: Tensor | None = None
) -> Tensor:
    """``row_scale · (W @ x8) + bias`` in float32 for rows ``x [..., I]`` quantised by
    :func:`quantize_activations`: the product the ``q8a8`` / ``q4a8`` kernels compute (an RMSNorm's
    ``1 / rms`` is ``row_scale``, applied after the product as the kernel does)."""
    if not isinstance(weight, QuantizedRows):
        raise ValueError(f"weight must be QuantizedRows, got {type(weight).__name__}")
    O, I = weight.shape
    if x_MI.shape[-1] != I:
        raise ValueError(f"x_MI must be [..., {I}], got {tuple(x_MI.shape)}")
    lead, G = x_MI.shape[:-1], weight.group_size
    x = x_MI.reshape(-1, I)
    M, nB = x.shape[0], I // ACT8_BLOCK
    q, d_MB, s_MG = quantize_activations(x, G)
    qx_BMK = q.view(M, nB, ACT8_BLOCK).to(torch.int32).transpose(0, 1)
    qw_BKO = weight.q_OI.to(torch.int32).view(O, nB, ACT8_BLOCK).permute(1, 2, 0)
    isum_BMO = torch.bmm(qx_BMK, qw_BKO)  # exact int32 sums per block
    per_group = G // ACT8_BLOCK
    dw_BO = weight.d_OG.float().t().repeat_interleave(per_group, dim=0)  # each block's weight scale
    terms_BMO = isum_BMO.float() * (dw_BO[:, None, :] * d_MB.t()[..., None])
    y = terms_BMO.sum(dim=0)
    if weight.m_OG is not None:
        y = y + s_MG @ weight.m_OG.float().t()
    if row_scale_M is not None:
        y = y * row_scale_M.reshape(M, 1)
    if bias_O is not None:
        y = y + bias_O
    return y.view(*lead, O)
