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
    lib.llama_forward.argtypes = [_P, _P, _L, _L, _P, _P, _P, _P, _P, _L, _P, _L, _P, _P, _L, _P, _P, _I]
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
        self.D, self.F = _check_layers(layers, heads, kv_heads, head_dim)
        self.layers = list(layers)
        self._structs = (_Layer * len(layers))()
        for spec, c in zip(layers, self._structs, strict=True):
            for name in ("qkv", "o", "gate_up", "down"):
                getattr(spec, name).fill(getattr(c, name))
            c.qk_norm = None if spec.qk_norm is None else spec.qk_norm.data_ptr()
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
        rows_B: Tensor | None = None,
    ) -> list[Tensor]:
        """Run ``x [B·T, D]`` (float32, contiguous; updated in place to the last run layer's output)
        through the layers ``run`` in order; returns the outputs of the ``capture`` layers (in layer
        order) as ``[B·T, D]`` tensors. ``start_B``: each row's first slot; ``cos / flipped_sin``: the
        RoPE angles of every token; ``block_mask_TT``: bool, or None for a causal chain. ``rows_B``:
        the cache row (slot) of each block row, distinct, in ``[0, k_cache.shape[1])``; default
        ``arange(B)`` (the cache then has at least B rows)."""
        B = start_B.shape[0]
        M = x_MD.shape[0]
        T = M // B
        if T > MAX_BLOCK or M != B * T or x_MD.dtype != torch.float32 or not x_MD.is_contiguous():
            raise ValueError(
                f"x_MD must be contiguous float32 [B*T, D] with T <= {MAX_BLOCK}, got {tuple(x_MD.shape)}"
            )
        self._check_block(
            x_MD, start_B, cos_ME, flipped_sin_ME, k_cache, v_cache, block_mask_TT, run, capture
        )
        start = start_B.to(torch.long).contiguous()
        cache_rows = k_cache.shape[1]
        rows = None
        if rows_B is not None:
            rows = rows_B.to(torch.long).contiguous()
            distinct = rows.unique().numel() == rows.numel()
            if rows.shape != (B,) or (rows < 0).any() or (rows >= cache_rows).any() or not distinct:
                raise ValueError(
                    f"rows_B must hold {B} distinct cache rows in [0, {cache_rows}), got {rows.tolist()}"
                )
        elif cache_rows < B:
            raise ValueError(f"the cache has {cache_rows} rows, the block {B}")
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
            None if rows is None else rows.data_ptr(),
            cache_rows,
            None if mask is None else mask.data_ptr(),
            run_t.data_ptr(),
            len(run_t),
            flags.data_ptr(),
            aux.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == -1:
            raise MemoryError("llama_forward: out of memory")
        if rc == -3:
            raise ValueError("llama_forward: a layer's product sizes do not match the model's dims (code -3)")
        if rc:
            raise ValueError(f"llama_forward: bad weight format (code {rc})")
        return list(aux)

    def _check_block(
        self, x_MD, start_B, cos_ME, flipped_sin_ME, k_cache, v_cache, block_mask_TT, run, capture
    ) -> None:
        """``ValueError`` unless every buffer :meth:`forward` hands to C (its arguments, as typed there)
        has the size its dims say: the C code indexes them by those dims and nothing else."""
        N, J, E = len(self.layers), self.J, self.E
        B, M = start_B.shape[0], x_MD.shape[0]
        T = M // B
        if x_MD.dim() != 2 or x_MD.shape[1] != self.D:
            raise ValueError(f"x_MD must be [B*T, D={self.D}], got {tuple(x_MD.shape)}")
        if start_B.dim() != 1 or B < 1 or start_B.is_floating_point() or start_B.device.type != "cpu":
            raise ValueError(f"start_B must be a 1-D CPU integer tensor of B >= 1 rows, got {start_B}")
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.dtype != torch.float32 or not c.is_contiguous() or c.dim() != 5:
                raise ValueError(
                    f"{name} must be a contiguous float32 [N, rows, J, L, E], got {tuple(c.shape)}"
                )
            if (c.shape[0], c.shape[2], c.shape[4]) != (N, J, E) or c.shape != k_cache.shape:
                raise ValueError(
                    f"{name} must be [N={N}, rows, J={J}, L, E={E}] (as k_cache), got {tuple(c.shape)}"
                )
        L = k_cache.shape[3]
        lo, hi = (int(v) for v in start_B.aminmax())
        if lo < 0 or hi + T > L:
            raise ValueError(f"start_B + T must lie in [0, L={L}] (T={T}), got starts {start_B.tolist()}")
        for name, t in (("cos_ME", cos_ME), ("flipped_sin_ME", flipped_sin_ME)):
            if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != (M, E):
                raise ValueError(f"{name} must be a contiguous float32 [{M}, {E}], got {tuple(t.shape)}")
        if block_mask_TT is not None and tuple(block_mask_TT.shape) != (T, T):
            raise ValueError(f"block_mask_TT must be [T, T] = [{T}, {T}], got {tuple(block_mask_TT.shape)}")
        run_list = [int(i) for i in run]
        if any(not 0 <= i < N for i in run_list):
            raise ValueError(f"run must hold layer indices in [0, {N}), got {run_list}")
        capture_list = [int(i) for i in capture]
        if len(set(capture_list)) != len(capture_list) or not set(capture_list) <= set(run_list):
            raise ValueError(f"capture must hold distinct layers of run {run_list}, got {capture_list}")


def _check_vector(name: str, t: Tensor | None, n: int) -> None:
    if t is not None and (
        t.dtype != torch.float32 or tuple(t.shape) != (n,) or not t.is_contiguous() or t.device.type != "cpu"
    ):
        raise ValueError(
            f"{name} must be a contiguous float32 CPU [{n}] tensor, got {t.dtype} {tuple(t.shape)}"
        )


def _check_layers(layers: Sequence[LayerSpec], H: int, J: int, E: int) -> tuple[int, int]:
    """D and F of the model, after checking every layer's products, biases and norm weights against
    ``heads`` H, ``kv_heads`` J, ``head_dim`` E and the first layer's D and F (``ValueError``): the C
    forward sizes its scratch and indexes every weight by these dims."""
    if not layers:
        raise ValueError("layers must hold at least one LayerSpec")
    for name, v in (("heads", H), ("kv_heads", J), ("head_dim", E)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if H % J or E % 2:
        raise ValueError(f"heads must be a multiple of kv_heads and head_dim even, got {H}, {J}, {E}")
    D, F = layers[0].qkv.weight.in_features, layers[0].gate_up.weight.out_features // 2
    want = {"qkv": ((H + 2 * J) * E, D, False), "o": (D, H * E, False), "gate_up": (2 * F, D, False)}
    want["down"] = (D, F, True)
    dims = f"heads={H}, kv_heads={J}, head_dim={E}, D={D}, F={F}"
    for i, layer in enumerate(layers):
        for name, (O, I, swiglu) in want.items():
            spec = getattr(layer, name)
            w = spec.weight
            if not isinstance(w, PackedWeight):
                raise ValueError(
                    f"layer {i} {name}: the weight must be a PackedWeight, got {type(w).__name__}"
                )
            if (w.out_features, w.in_features) != (O, I):
                raise ValueError(
                    f"layer {i} {name}: packed weight [{w.out_features}, {w.in_features}], "
                    f"expected [{O}, {I}] ({dims})"
                )
            if bool(spec.swiglu) != swiglu:
                raise ValueError(f"layer {i} {name}: swiglu must be {swiglu}")
            _check_vector(f"layer {i} {name} bias", spec.bias, O)
            _check_vector(f"layer {i} {name} norm_weight", spec.norm_weight, I)
        qk = layer.qk_norm
        if qk is not None and (
            qk.dtype != torch.float32 or tuple(qk.shape) != (H + J, E) or not qk.is_contiguous()
        ):
            raise ValueError(f"layer {i} qk_norm must be a contiguous float32 [H + J, E] = [{H + J}, {E}]")
    return D, F
