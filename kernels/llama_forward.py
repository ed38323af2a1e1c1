"""A Llama-family decoder forward for decode and verify blocks in one C call (``csrc/llama_forward.c``).

Legend: B rows, T block tokens, M = B·T, D model dim, F MLP size, H query heads, J key/value heads,
E head dim, N layers, L cache slots.

:class:`NativeDecoder` holds ctypes descriptions of every layer's packed products (the
:class:`kernels.packed_gemm.PackedWeight` of q|k|v, o, gate|up and down, their biases and RMSNorm
weights) and runs a block through any subset of the layers, writing keys and values into a static
cache ``[N, B, J, L, E]``. It is the fast path of ``specdec.targets.llama.LlamaTarget`` for blocks
of up to :data:`MAX_BLOCK` tokens; that target's PyTorch path is its oracle.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .native import build_library, cpu_isa
from .packed_gemm import FORMATS, PackedWeight

__all__ = ["MAX_BLOCK", "LinearSpec", "LayerSpec", "NativeDecoder", "native_forward_available"]

MAX_BLOCK = 32
"""Longest block (tokens per row) the native forward runs: its attention is a plain loop, fine for
decode and verify blocks; longer blocks (a prefill) go through PyTorch's attention."""
_SOURCE = Path(__file__).parent / "csrc" / "llama_forward.c"
_P, _L, _F, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int


class _Linear(ctypes.Structure):
    _fields_ = [
        ("fmt", _I),
        ("act", _I),
        ("O", _L),
        ("I", _L),
        ("G", _L),
        ("w", _P),
        ("bias", _P),
        ("norm_w", _P),
        ("norm_eps", _F),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear), ("qk_norm", _P)]


class _Model(ctypes.Structure):
    _fields_ = [("H", _L), ("J", _L), ("E", _L), ("D", _L), ("F", _L), ("eps", _F), ("layers", _P)]


@functools.cache
def _library(isa: str) -> ctypes.CDLL:
    lib = build_library(_SOURCE, isa=isa)
    lib.llama_forward.argtypes = [_P, _P, _L, _L, _P, _P, _P, _P, _P, _L, _P, _P, _L, _P, _P, _I]
    lib.llama_forward.restype = _I
    return lib


@functools.cache
def native_forward_available(isa: str | None = None) -> bool:
    """True when the native forward builds (or is cached) on this machine."""
    try:
        _library(isa or cpu_isa())
    except (RuntimeError, OSError):
        return False
    return True


@dataclass(frozen=True)
class LinearSpec:
    """One packed product: ``y = s · (x' @ W^T) + bias`` with an RMSNorm (``norm_weight``) or a
    SwiGLU (``swiglu``) input transform, as :func:`kernels.packed_gemm.packed_linear` computes."""

    weight: PackedWeight
    bias: Tensor | None = None
    norm_weight: Tensor | None = None
    norm_eps: float = 1e-6
    swiglu: bool = False

    def fill(self, c: _Linear) -> None:
        w = self.weight
        c.fmt, c.act, c.O, c.I, c.G = (
            FORMATS[w.fmt],
            int(self.swiglu),
            w.out_features,
            w.in_features,
            w.group_size,
        )
        c.w = w.data.data_ptr()
        c.bias = None if self.bias is None else self.bias.data_ptr()
        c.norm_w = None if self.norm_weight is None else self.norm_weight.data_ptr()
        c.norm_eps = self.norm_eps


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's products (``qk_norm``: Qwen3's per-head q and k RMSNorm weights ``[H + J, E]``)."""

    qkv: LinearSpec
    o: LinearSpec
    gate_up: LinearSpec
    down: LinearSpec
    qk_norm: Tensor | None = None


class NativeDecoder:
    """Every layer of a model as ctypes structs over its packed weights (kept alive here)."""

    def __init__(
        self, layers: Sequence[LayerSpec], *, heads: int, kv_heads: int, head_dim: int, eps: float
    ) -> None:
        isa = {s.weight.isa for layer in layers for s in (layer.qkv, layer.o, layer.gate_up, layer.down)}
        if len(isa) != 1:
            raise ValueError(f"every packed weight must be packed for one ISA path, got {sorted(isa)}")
        self.isa = isa.pop()
        self.layers = list(layers)
        self._structs = (_Layer * len(layers))()
        for spec, c in zip(layers, self._structs, strict=True):
            for name in ("qkv", "o", "gate_up", "down"):
                getattr(spec, name).fill(getattr(c, name))
            c.qk_norm = None if spec.qk_norm is None else spec.qk_norm.data_ptr()
        first = layers[0]
        self.D, self.F = first.qkv.weight.in_features, first.down.weight.in_features
        self.H, self.J, self.E = heads, kv_heads, head_dim
        self._model = _Model(heads, kv_heads, head_dim, self.D, self.F, eps, ctypes.addressof(self._structs))

    @torch.inference_mode()
    def forward(
        self,
        x_MD: Tensor,
        start_B: Tensor,
        cos_ME: Tensor,
        flipped_sin_ME: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_mask_TT: Tensor | None,
        run: Sequence[int],
        capture: Sequence[int] = (),
    ) -> list[Tensor]:
        """Run ``x [B·T, D]`` (float32, contiguous; updated in place to the last run layer's output)
        through the layers ``run`` in order; returns the outputs of the ``capture`` layers (in layer
        order) as ``[B·T, D]`` tensors. ``start_B``: each row's first slot; ``cos / flipped_sin``: the
        RoPE angles of every token; ``block_mask_TT``: bool, or None for a causal chain."""
        B = start_B.shape[0]
        M = x_MD.shape[0]
        T = M // B
        if T > MAX_BLOCK or M != B * T or x_MD.dtype != torch.float32 or not x_MD.is_contiguous():
            raise ValueError(
                f"x_MD must be contiguous float32 [B*T, D] with T <= {MAX_BLOCK}, got {tuple(x_MD.shape)}"
            )
        start = start_B.to(torch.long).contiguous()
        run_t = torch.tensor(list(run), dtype=torch.long)
        flags = torch.zeros(len(self.layers), dtype=torch.uint8)
        flags[list(capture)] = 1
        aux = torch.empty(len(capture), M, self.D)
        mask = None if block_mask_TT is None else block_mask_TT.to(torch.uint8).contiguous()
        rc = _library(self.isa).llama_forward(
            ctypes.addressof(self._model),
            x_MD.data_ptr(),
            B,
            T,
            start.data_ptr(),
            cos_ME.data_ptr(),
            flipped_sin_ME.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_cache.shape[3],
            None if mask is None else mask.data_ptr(),
            run_t.data_ptr(),
            len(run_t),
            flags.data_ptr(),
            aux.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == -1:
            raise MemoryError("llama_forward: out of memory")
        if rc:
            raise ValueError(f"llama_forward: bad weight format (code {rc})")
        return list(aux)
