"""CPU matrix products on pre-packed weights (``csrc/packed_gemm.c``), compiled once per machine.

Legend: M rows of x, I input features, O output features, BW outputs per packed block.

``y[m, o] = residual[m, o] + bias[o] + sum_i W[o, i] * x'[m, i]`` with ``W`` packed as
``[ceil(O / BW), I, BW]`` (zero-padded to whole blocks). ``x'`` is ``x``, or ``silu(gate) * up`` of
``x = [gate | up]`` (``act=1``), or ``x / rms(x)`` (``norm_eps >= 0``; the RMSNorm weight is folded
into ``W`` by the caller). Weights are float32 or bfloat16; arithmetic is float32.

Users: the decode linears of ``specdec/targets/linear.py`` (M = 1..16 rows, bandwidth-bound, where
BLAS libraries tuned for large M leave bandwidth unused) and the CPU expert loop of
``kernels/grouped_gemm/onednn_backend.py`` (the experts' down projection at any M, and every product
for small M). The plain-PyTorch reference is ``F.linear`` on the unpacked weight;
``tests/test_packed_gemm.py`` and ``tests/test_llama_target.py`` compare against it.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from .native import build_library

__all__ = [
    "packed_gemm_library",
    "packed_gemm_available",
    "pack_weight",
    "packed_matmul",
]

_SOURCE = Path(__file__).parent / "csrc" / "packed_gemm.c"


@functools.cache
def packed_gemm_library() -> ctypes.CDLL:
    """Compile (once per machine and source version) and load ``csrc/packed_gemm.c``.

    Raises ``RuntimeError`` when no C compiler with OpenMP is available.
    """
    lib = build_library(_SOURCE)
    for name in ("packed_gemm_f32", "packed_gemm_bf16"):
        fn = getattr(lib, name)
        # (x, M, I, packed W, O, bias, y, threads, norm_eps, act, residual) -> 0 or -1 (out of memory)
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_long,
            ctypes.c_long,
            ctypes.c_void_p,
            ctypes.c_long,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_float,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        fn.restype = ctypes.c_int
    lib.packed_gemm_block_width.restype = ctypes.c_int
    lib.packed_gemm_bf16_pairs.restype = ctypes.c_int
    return lib


@functools.cache
def packed_gemm_available() -> bool:
    """True when the kernel builds (or is cached) on this machine."""
    try:
        packed_gemm_library()
    except (RuntimeError, OSError):
        return False
    return True


def pack_weight(w_OI: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``W [O, I]`` in the kernel's layout ``[ceil(O / BW), I, BW]`` (float32 or bfloat16)."""
    if w_OI.dim() != 2 or w_OI.device.type != "cpu":
        raise ValueError(f"w_OI must be a 2-D CPU tensor, got {tuple(w_OI.shape)} on {w_OI.device}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    lib = packed_gemm_library()
    block = lib.packed_gemm_block_width()
    out_features, in_features = w_OI.shape
    num_blocks = -(-out_features // block)
    padded = torch.zeros(num_blocks * block, in_features, dtype=dtype)
    padded[:out_features] = w_OI.detach()
    w_packed = padded.view(num_blocks, block, in_features).transpose(1, 2).contiguous()  # [nb, I, BW]
    if dtype == torch.bfloat16 and lib.packed_gemm_bf16_pairs():
        # Each 32-bit lane holds outputs (o, o + BW/2): see load_row_bf16 in the C source.
        w_packed = w_packed.view(num_blocks, in_features, 2, block // 2).transpose(2, 3).contiguous()
    return w_packed


def packed_matmul(x_MI: Tensor, w_packed: Tensor, out_features: int, *, swiglu: bool = False) -> Tensor:
    """``x_MI @ W^T`` for ``w_packed = pack_weight(W)`` (no bias or residual).

    x_MI: contiguous float32 CPU [M, I]; returns float32 [M, out_features]. With ``swiglu``, x_MI is
    ``[gate | up]``, [M, 2I], and the product is ``(silu(gate) * up) @ W^T``, the activation computed
    inside the kernel. Reference: ``x_MI @ W.T`` (``swiglu``: ``(F.silu(g) * u) @ W.T``).
    """
    if x_MI.dtype != torch.float32 or not x_MI.is_contiguous() or x_MI.dim() != 2:
        raise ValueError(
            f"x_MI must be a contiguous float32 [M, I] tensor, got {x_MI.dtype} {tuple(x_MI.shape)}"
        )
    num_rows, in_features = x_MI.shape
    if swiglu:
        if in_features % 2:
            raise ValueError(f"x_MI must be [M, 2I] (gate | up) with swiglu=True, got {tuple(x_MI.shape)}")
        in_features //= 2
    lib = packed_gemm_library()
    block = lib.packed_gemm_block_width()
    if (
        w_packed.dim() < 3
        or w_packed.shape[1] != in_features
        or w_packed.numel() != w_packed.shape[0] * in_features * block
        or w_packed.shape[0] != -(-out_features // block)
        or w_packed.dtype not in (torch.float32, torch.bfloat16)
        or not w_packed.is_contiguous()
    ):
        raise ValueError(
            f"x_MI [M, {in_features}] and w_packed {tuple(w_packed.shape)} do not make [M, {out_features}]"
        )
    gemm = lib.packed_gemm_f32 if w_packed.dtype == torch.float32 else lib.packed_gemm_bf16
    y_MO = torch.empty(num_rows, out_features, dtype=torch.float32)
    rc = gemm(
        x_MI.data_ptr(),
        num_rows,
        in_features,
        w_packed.data_ptr(),
        out_features,
        None,
        y_MO.data_ptr(),
        torch.get_num_threads(),
        -1.0,
        1 if swiglu else 0,
        None,
    )
    if rc:
        raise MemoryError("packed_gemm: out of memory")
    return y_MO
