"""CPU matrix products on weights packed once (``csrc/packed_gemm.c``), fp32, bf16 or quantized.

Legend: M rows of x, I input features, O output features, G inputs per quantisation group,
BW outputs per packed block (per ISA path: 32 for AVX-512, 16 for AVX2, 8 generic), nG = I / G.

``y[m, o] = residual[m, o] + bias[o] + s[m] * sum_i W[o, i] * x'[m, i]`` where ``x'`` is ``x``, or
``silu(gate) * up`` of ``x = [gate | up]`` (``swiglu``), times an RMSNorm weight (``norm_weight``), and
``s`` the RMSNorm's ``1 / rms`` (``norm_eps``). Weight formats (:data:`FORMATS`), dequantised in
registers, float32 arithmetic:

- ``f32``, ``bf16``;
- ``q8``: ``d * q`` with ``q`` int8 and ``d`` float16 per G inputs (GGUF Q8_0: G = 32; per-channel
  int8: G = I);
- ``q4``: ``d * q + m`` with ``q`` in 0..15, ``d`` and ``m`` float16 per G inputs (GGUF Q4_1; Q4_0 with
  ``m = -8 d``; group-wise int4 with scales and zero points);
- ``q8a8`` / ``q4a8``: the same weights (``pack_q8`` / ``pack_q4`` with ``act8=True``, G a multiple
  of 32) times **8-bit activations**: each row of ``x'`` quantised in blocks of 32 (llama.cpp's Q8_0 /
  Q8_1), int32 dot products within a block, one float multiply-add per block (``csrc/q8_gemm.c``).
  Not the float product: the oracle is :func:`kernels.q8_reference.linear_a8_reference`. Batch
  invariant: a row's output is bitwise the same whatever the other rows and their number.

A :class:`PackedWeight` holds the packed bytes for one ISA path's layout; :meth:`PackedWeight.dequantize`
is the plain-PyTorch oracle (``F.linear`` on it is the reference of :func:`packed_linear`).
Users: the decode linears of ``specdec/targets/linear.py`` and the CPU expert loop of
``kernels/grouped_gemm/onednn_backend.py``.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .native import build_library, cpu_isa

__all__ = [
    "FORMATS",
    "PackedWeight",
    "packed_gemm_library",
    "packed_gemm_available",
    "block_width",
    "source_digest",
    "pack_weight",
    "pack_q8",
    "pack_q4",
    "packed_linear",
    "quantize_a8",
    "packed_matmul",
]

_SOURCE = Path(__file__).parent / "csrc" / "packed_gemm.c"
_SOURCES = (_SOURCE, _SOURCE.parent / "q8_gemm.c")  # packed_gemm.c includes q8_gemm.c
FORMATS = {"f32": 0, "bf16": 1, "q8": 2, "q4": 3, "q8a8": 4, "q4a8": 5}
"""Weight formats and their codes in the C kernel."""
ACT8_BLOCK = 32
"""Inputs per activation block of the ``*a8`` formats (one int8 scale block, as llama.cpp's Q8_0)."""
_P, _L = ctypes.c_void_p, ctypes.c_long


@functools.cache
def packed_gemm_library(isa: str | None = None) -> ctypes.CDLL:
    """Compile (once per machine, ISA path and source version) and load ``csrc/packed_gemm.c``.

    ``isa``: an ISA path of :mod:`kernels.native` (default: the one this CPU runs). Raises
    ``RuntimeError`` when no C compiler with OpenMP is available.
    """
    lib = build_library(_SOURCE, isa=isa or cpu_isa())
    # (fmt, x, M, I, W, O, G, bias, norm_w, norm_eps, act, residual, y, threads) -> 0, -1 (memory), -2
    lib.packed_linear.argtypes = [ctypes.c_int, _P, _L, _L, _P, _L, _L, _P, _P, ctypes.c_float, ctypes.c_int]
    lib.packed_linear.argtypes += [_P, _P, ctypes.c_int]
    lib.packed_linear.restype = ctypes.c_int
    lib.packed_gemm_block_width.restype = ctypes.c_int
    lib.packed_gemm_group_bytes.argtypes = [ctypes.c_int, _L]
    lib.packed_gemm_group_bytes.restype = _L
    lib.packed_gemm_isa.restype = ctypes.c_char_p
    lib.packed_gemm_quantize_a8.argtypes = [_P, _L, _L, _L, _P, _P, _P]
    lib.packed_gemm_quantize_a8.restype = None
    return lib


@functools.cache
def packed_gemm_available(isa: str | None = None) -> bool:
    """True when the kernel builds (or is cached) on this machine for ``isa``."""
    try:
        packed_gemm_library(isa)
    except (RuntimeError, OSError):
        return False
    return True


@functools.cache
def source_digest() -> str:
    """A hash of the kernel's C sources: packed layouts cached on disk are keyed by it."""
    import hashlib

    return hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES)).hexdigest()[:16]


def block_width(isa: str | None = None) -> int:
    """BW: outputs per packed block on an ISA path."""
    return int(packed_gemm_library(isa).packed_gemm_block_width())


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A weight ``[O, I]`` packed for the kernel: ``data`` (uint8 bytes) in ``isa``'s layout."""

    fmt: str
    out_features: int
    in_features: int
    group_size: int
    isa: str
    data: Tensor

    def __post_init__(self) -> None:
        """Check that ``data`` holds exactly the bytes the kernel reads for ``[O, I]`` in ``fmt``: the C
        code trusts these sizes, so a mismatch would read out of bounds (``ValueError`` here)."""
        O, I, G = self.out_features, self.in_features, self.group_size
        if self.fmt not in FORMATS:
            raise ValueError(f"PackedWeight: fmt must be one of {sorted(FORMATS)}, got {self.fmt!r}")
        dims = (O, I, G)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims) or I % G:
            raise ValueError(f"PackedWeight: [O, I] = [{O}, {I}] and group_size {G} must be ints >= 1, G | I")
        if self.fmt in ("f32", "bf16") and G != I:
            raise ValueError(f"PackedWeight: a {self.fmt} weight needs group_size = I = {I}, got {G}")
        data = self.data
        if not isinstance(data, Tensor):
            raise ValueError(f"PackedWeight: data must be a tensor, got {type(data).__name__}")
        layout_ok = data.dim() == 1 and data.device.type == "cpu" and data.is_contiguous()
        if data.dtype != torch.uint8 or not layout_ok:
            raise ValueError(
                f"PackedWeight: data must be a contiguous 1-D uint8 CPU tensor, got {data.dtype} "
                f"{tuple(data.shape)} on {data.device}"
            )
        group_bytes = int(packed_gemm_library(self.isa).packed_gemm_group_bytes(FORMATS[self.fmt], G))
        expected = -(-O // self.block_width) * (I // G) * group_bytes
        if data.numel() != expected:
            raise ValueError(
                f"PackedWeight: a {self.fmt} [{O}, {I}] weight (group_size {G}, ISA path {self.isa}) packs "
                f"into {expected} bytes, got {data.numel()}"
            )

    @property
    def block_width(self) -> int:
        return block_width(self.isa)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def act8(self) -> bool:
        """True for the formats with 8-bit activations (``q8a8``, ``q4a8``)."""
        return self.fmt in ("q8a8", "q4a8")

    def dequantize(self) -> Tensor:
        """The float32 ``[O, I]`` weight this packs: with ``F.linear``, the plain-PyTorch oracle of
        :func:`packed_linear` (for the ``*a8`` formats, with :mod:`kernels.q8_reference`)."""
        O, I, G, BW = self.out_features, self.in_features, self.group_size, self.block_width
        nb, nG, VL = -(-O // BW), I // G, BW // 2
        raw = self.data
        if self.act8:
            return _dequantize_a8(self, nb, nG, VL)
        if self.fmt == "f32":
            w = raw.view(torch.float32).view(nb, I, BW)
        elif self.fmt == "bf16":
            w = raw.view(torch.bfloat16).view(nb, I, VL, 2).transpose(2, 3).reshape(nb, I, BW).float()
        else:
            rb = BW if self.fmt == "q8" else VL
            groups = raw.view(nb, nG, -1)
            q = groups[..., : G * rb].reshape(nb, nG, G, rb)
            scales = groups[..., G * rb :].contiguous().view(torch.float16).float()  # [nb, nG, BW or 2 BW]
            d = scales[..., :BW].unsqueeze(2)
            if self.fmt == "q8":
                w = d * q.view(torch.int8).float()
            else:
                nibbles = torch.cat([q & 15, q >> 4], dim=-1).float()  # lanes (j, VL + j)
                w = d * nibbles + scales[..., BW:].unsqueeze(2)
            w = w.reshape(nb, I, BW)
        return w.transpose(1, 2).reshape(nb * BW, I)[:O].contiguous()


def _dequantize_a8(w: PackedWeight, nb: int, nG: int, VL: int) -> Tensor:
    """The ``q8a8`` / ``q4a8`` layouts (``csrc/q8_gemm.c``): chunks of 4 inputs per output, then scales."""
    BW, G, QC = 2 * VL, w.group_size, 4
    groups = w.data.view(nb, nG, -1)
    rb = BW if w.fmt == "q8a8" else VL  # bytes per input
    q = groups[..., : G * rb].reshape(nb, nG, G // QC, rb, QC)
    scales = groups[..., G * rb :].contiguous().view(torch.float16).float()  # [nb, nG, BW or 2 BW]
    if w.fmt == "q8a8":
        values = q.view(torch.int8).float()
    else:  # low nibbles: outputs 0..VL-1, high: VL..BW-1
        values = torch.cat([q & 15, q >> 4], dim=3).float()
    values = values.permute(0, 3, 1, 2, 4).reshape(nb, BW, nG, G)  # [nb, BW, nG, G]
    wt = scales[..., :BW].transpose(1, 2).unsqueeze(-1) * values
    if w.fmt == "q4a8":
        wt = wt + scales[..., BW:].transpose(1, 2).unsqueeze(-1)
    return wt.reshape(nb * BW, nG * G)[: w.out_features].contiguous()


def _padded_rows(w_OI: Tensor, BW: int) -> Tensor:
    O = w_OI.shape[0]
    out = w_OI.new_zeros((-(-O // BW) * BW, *w_OI.shape[1:]))
    out[:O] = w_OI
    return out


def pack_weight(w_OI: Tensor, dtype: torch.dtype = torch.float32, *, isa: str | None = None) -> PackedWeight:
    """``W [O, I]`` as float32 or bfloat16 in the kernel's layout ``[O/BW, I, BW]``."""
    if w_OI.dim() != 2 or w_OI.device.type != "cpu":
        raise ValueError(f"w_OI must be a 2-D CPU tensor, got {tuple(w_OI.shape)} on {w_OI.device}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    isa = isa or cpu_isa()
    BW = block_width(isa)
    O, I = w_OI.shape
    nb = -(-O // BW)
    w = _padded_rows(w_OI.detach().to(dtype), BW).view(nb, BW, I).transpose(1, 2)  # [nb, I, BW]
    if dtype == torch.bfloat16:  # each 32-bit lane holds outputs (o, o + BW/2): see load_w in the C source
        w = w.reshape(nb, I, 2, BW // 2).transpose(2, 3)
    data = w.contiguous().view(torch.uint8).reshape(-1)
    return PackedWeight("f32" if dtype == torch.float32 else "bf16", O, I, I, isa, data)


def _check_groups(q_OI: Tensor, d_OG: Tensor, group_size: int, name: str) -> tuple[int, int, int]:
    if q_OI.dim() != 2:
        raise ValueError(f"{name}: q_OI must be [O, I], got {tuple(q_OI.shape)}")
    O, I = q_OI.shape
    if group_size < 1 or I % group_size:
        raise ValueError(f"{name}: group_size must divide in_features={I}, got {group_size}")
    nG = I // group_size
    if tuple(d_OG.shape) != (O, nG) or d_OG.dtype != torch.float16:
        raise ValueError(
            f"{name}: scales must be float16 [O={O}, I/G={nG}], got {d_OG.dtype} {tuple(d_OG.shape)}"
        )
    return O, I, nG


def _check_act8(name: str, group_size: int) -> None:
    if group_size % ACT8_BLOCK:
        raise ValueError(
            f"{name}: act8 needs a group_size that is a multiple of {ACT8_BLOCK}, got {group_size}"
        )


def pack_q8(
    q_OI: Tensor, d_OG: Tensor, group_size: int, *, isa: str | None = None, act8: bool = False
) -> PackedWeight:
    """``W = d * q`` (``q`` int8 ``[O, I]``, ``d`` float16 ``[O, I/G]``) in the kernel's Q8 layout, or
    with ``act8`` its ``q8a8`` layout (8-bit activations; ``q`` in -127..127, G a multiple of 32)."""
    O, I, nG = _check_groups(q_OI, d_OG, group_size, "pack_q8")
    if q_OI.dtype != torch.int8:
        raise ValueError(f"pack_q8: q_OI must be int8, got {q_OI.dtype}")
    isa = isa or cpu_isa()
    BW, G = block_width(isa), group_size
    nb = -(-O // BW)
    if act8:
        _check_act8("pack_q8", G)
        if q_OI.numel() and int(q_OI.min()) < -127:
            raise ValueError("pack_q8: act8 weights must lie in -127..127 (found -128)")
        q = _padded_rows(q_OI, BW).view(nb, BW, nG, G // 4, 4).permute(0, 2, 3, 1, 4)  # [nb, nG, G/4, BW, 4]
    else:
        q = _padded_rows(q_OI, BW).view(nb, BW, nG, G).permute(0, 2, 3, 1)  # [nb, nG, G, BW]
    d = _padded_rows(d_OG, BW).view(nb, BW, nG).transpose(1, 2)  # [nb, nG, BW]
    groups = torch.cat(
        [q.reshape(nb, nG, G * BW).view(torch.uint8), d.contiguous().view(torch.uint8)], dim=-1
    )
    return PackedWeight("q8a8" if act8 else "q8", O, I, G, isa, groups.contiguous().reshape(-1))


def pack_q4(
    q_OI: Tensor,
    d_OG: Tensor,
    m_OG: Tensor,
    group_size: int,
    *,
    isa: str | None = None,
    act8: bool = False,
) -> PackedWeight:
    """``W = d * q + m`` (``q`` in 0..15 as uint8 ``[O, I]``, ``d`` and ``m`` float16 ``[O, I/G]``) in
    the kernel's Q4 layout, or with ``act8`` its ``q4a8`` layout (8-bit activations; G a multiple of 32)."""
    O, I, nG = _check_groups(q_OI, d_OG, group_size, "pack_q4")
    if q_OI.dtype != torch.uint8 or (q_OI.numel() and int(q_OI.max()) > 15):
        raise ValueError(f"pack_q4: q_OI must be uint8 values in 0..15, got {q_OI.dtype}")
    if m_OG.shape != d_OG.shape or m_OG.dtype != torch.float16:
        raise ValueError(
            f"pack_q4: m_OG must be float16 {tuple(d_OG.shape)}, got {m_OG.dtype} {tuple(m_OG.shape)}"
        )
    isa = isa or cpu_isa()
    BW, G = block_width(isa), group_size
    VL, nb = BW // 2, -(-O // BW)
    if act8:
        _check_act8("pack_q4", G)
        q = _padded_rows(q_OI, BW).view(nb, BW, nG, G // 4, 4).permute(0, 2, 3, 1, 4)  # [nb, nG, G/4, BW, 4]
        nibbles = q[:, :, :, :VL] | (q[:, :, :, VL:] << 4)  # lane j: outputs j (low) and VL + j (high)
    else:
        q = _padded_rows(q_OI, BW).view(nb, BW, nG, G).permute(0, 2, 3, 1)  # [nb, nG, G, BW]
        nibbles = q[..., :VL] | (q[..., VL:] << 4)  # byte j: outputs j (low) and VL + j (high)
    d = _padded_rows(d_OG, BW).view(nb, BW, nG).transpose(1, 2).contiguous()
    m = _padded_rows(m_OG, BW).view(nb, BW, nG).transpose(1, 2).contiguous()
    groups = torch.cat([nibbles.reshape(nb, nG, G * VL), d.view(torch.uint8), m.view(torch.uint8)], dim=-1)
    return PackedWeight("q4a8" if act8 else "q4", O, I, G, isa, groups.contiguous().reshape(-1))


def packed_linear(
    x_MI: Tensor,
    w: PackedWeight,
    *,
    bias_O: Tensor | None = None,
    norm_weight_I: Tensor | None = None,
    norm_eps: float | None = None,
    swiglu: bool = False,
    residual_MO: Tensor | None = None,
    threads: int | None = None,
) -> Tensor:
    """``y = residual + bias + s * (x' @ W^T)`` (see the module doc) for float32 CPU rows ``x [..., I]``
    (``[..., 2I]`` with ``swiglu``); returns float32 ``[..., O]``. Checks, allocates and launches."""
    I, O = w.in_features, w.out_features
    width = 2 * I if swiglu else I
    if x_MI.dtype != torch.float32 or x_MI.device.type != "cpu" or x_MI.shape[-1] != width:
        raise ValueError(f"x_MI must be float32 CPU [..., {width}], got {x_MI.dtype} {tuple(x_MI.shape)}")
    x_MI = x_MI.contiguous()
    y = torch.empty((*x_MI.shape[:-1], O))
    for name, t, n in (("bias_O", bias_O, O), ("norm_weight_I", norm_weight_I, I)):
        if t is not None and (t.dtype != torch.float32 or t.shape != (n,) or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous float32 [{n}] tensor")
    if residual_MO is not None:
        if residual_MO.shape != y.shape or residual_MO.dtype != torch.float32:
            raise ValueError(f"residual_MO must be float32 {tuple(y.shape)}, got {tuple(residual_MO.shape)}")
        residual_MO = residual_MO.contiguous()
    rc = packed_gemm_library(w.isa).packed_linear(
        FORMATS[w.fmt],
        x_MI.data_ptr(),
        x_MI.numel() // width,
        I,
        w.data.data_ptr(),
        O,
        w.group_size,
        None if bias_O is None else bias_O.data_ptr(),
        None if norm_weight_I is None else norm_weight_I.data_ptr(),
        -1.0 if norm_eps is None else float(norm_eps),
        1 if swiglu else 0,
        None if residual_MO is None else residual_MO.data_ptr(),
        y.data_ptr(),
        threads or torch.get_num_threads(),
    )
    if rc == -1:
        raise MemoryError("packed_linear: out of memory")
    if rc:
        raise ValueError(f"packed_linear: the kernel refused the arguments (code {rc})")
    return y


def packed_matmul(
    x_MI: Tensor, w: PackedWeight, out_features: int | None = None, *, swiglu: bool = False
) -> Tensor:
    """``x_MI @ W^T`` (``swiglu``: ``(silu(gate) * up) @ W^T`` of ``x = [gate | up]``), no bias."""
    if out_features is not None and out_features != w.out_features:
        raise ValueError(f"out_features={out_features} does not match the packed weight's {w.out_features}")
    return packed_linear(x_MI, w, swiglu=swiglu)


def quantize_a8(x_MI: Tensor, group_size: int, *, isa: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's own quantisation of float32 rows ``x [M, I]`` for the ``*a8`` formats (as
    :func:`kernels.q8_reference.quantize_activations`, which is its oracle): int8 ``q [M, I]``, the
    block scales ``d [M, I/32]`` and the group sums ``s [M, I/G]``."""
    if x_MI.dtype != torch.float32 or x_MI.device.type != "cpu" or x_MI.dim() != 2:
        raise ValueError(f"x_MI must be a float32 CPU [M, I] tensor, got {x_MI.dtype} {tuple(x_MI.shape)}")
    M, I = x_MI.shape
    if group_size < 1 or group_size % ACT8_BLOCK or I % group_size:
        raise ValueError(
            f"group_size must be a multiple of {ACT8_BLOCK} that divides in_features={I}, got {group_size}"
        )
    x_MI = x_MI.contiguous()
    q = torch.empty(M, I, dtype=torch.int8)
    d = torch.empty(M, I // ACT8_BLOCK)
    s = torch.empty(M, I // group_size)
    packed_gemm_library(isa).packed_gemm_quantize_a8(
        x_MI.data_ptr(), M, I, group_size, q.data_ptr(), d.data_ptr(), s.data_ptr()
    )
    return q, d, s
