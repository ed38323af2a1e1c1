"""The "onednn" grouped-GEMM backend: CPU, float32, one oneDNN matmul per group on pre-packed weights.

Legend: M rows in expert order, K input features, N output features, E experts (groups), H SwiGLU hidden.

Why: PyTorch's CPU `torch.mm` goes to MKL, which on non-Intel x86 CPUs (the AMD EPYC machines we
develop on) runs a slower code path; oneDNN (which PyTorch ships as `mkldnn`) JIT-compiles for the
CPU it finds. Measured on the 2-core AMD EPYC development VM, fp32, per expert GEMM (GFLOP/s,
`python -m experiments.bench_grouped_gemm`): MKL ~205 at M = 128, oneDNN on weights packed once
~500 (and ~65 vs ~38 at M = 1). Results agree with `torch.mm` to fp32 rounding (both accumulate
in fp32; different summation order).

Packed weights: oneDNN reorders each expert's [N, K] matrix into its blocked layout once
(`torch.ops.mkldnn._reorder_linear_weight`); :func:`packed_weights` caches the packed copies per
weight tensor and repacks when the tensor changes (its version counter or data pointer moves, e.g.
after an optimizer step). The cache holds a second copy of the weights while the tensor lives;
:func:`clear_packed_weights` drops it. Tensors created under `torch.inference_mode` have no version
counter, so they are packed on every call (correct, a little slower).

The dW of the backward runs through the torch backend (MKL), dX through this forward.

The inference expert loop (:func:`grouped_swiglu_onednn`, :func:`swiglu_blocks_onednn`) also uses the
packed C kernel of ``kernels.packed_gemm`` where it measured faster (small products; the row limits
depend on the kernel's ISA path, see ``C_MAX_ROWS``), with weights packed
for it the same cached way. Each layout is packed on first use, so a layer that sees both small and
large batches holds up to two packed copies of a weight besides the original;
:func:`clear_packed_weights` drops them all.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import Tensor

from ..native import base_isa, cpu_isa
from ..packed_gemm import pack_weight, packed_gemm_available, packed_matmul
from .torch_backend import _bounds

__all__ = [
    "onednn_available",
    "packed_weights",
    "clear_packed_weights",
    "grouped_gemm_onednn",
    "linear_onednn",
    "grouped_swiglu_onednn",
    "swiglu_blocks_onednn",
]


@functools.cache
def onednn_available() -> bool:
    """True when this PyTorch build has oneDNN's packed linear ops and oneDNN is enabled."""
    return (
        torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


# id(base tensor) -> (weakref to it, {view key: (version, data_ptr, packed list)})
_CACHE: dict[int, tuple[weakref.ref, dict]] = {}


def clear_packed_weights() -> None:
    """Drop every cached packed weight (they are rebuilt on next use)."""
    _CACHE.clear()


def _version(t: Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


def packed_weights(w: Tensor, trans_w: bool, layout: str = "onednn") -> list[Tensor]:
    """Packed [N, K] weights of every group: w is [E, K, N], or [E, N, K] when trans_w.

    layout "onednn": oneDNN's blocked layout (for :func:`linear_onednn`); "c": the layout of
    ``kernels.packed_gemm`` (for ``packed_matmul``).
    """
    version = _version(w)
    if version is None:
        return _pack(w, trans_w, layout)
    base = w._base if w._base is not None else w
    key = (w.storage_offset(), tuple(w.shape), tuple(w.stride()), w.dtype, trans_w, layout)
    entry = _CACHE.get(id(base))
    if entry is None or entry[0]() is not base:
        entry = (weakref.ref(base), {})
        _CACHE[id(base)] = entry
        weakref.finalize(base, _CACHE.pop, id(base), None)
    views = entry[1]
    hit = views.get(key)
    if hit is not None and hit[0] == version and hit[1] == w.data_ptr():
        return hit[2]
    packed = _pack(w, trans_w, layout)
    views[key] = (version, w.data_ptr(), packed)
    return packed


def _pack(w: Tensor, trans_w: bool, layout: str) -> list[Tensor]:
    with torch.no_grad():
        w_NK = [(w[e] if trans_w else w[e].t()).contiguous() for e in range(w.shape[0])]
        if layout == "c":
            return [pack_weight(m) for m in w_NK]
        return [torch.ops.mkldnn._reorder_linear_weight(m, None) for m in w_NK]


def linear_onednn(x_MK: Tensor, packed_NK: Tensor, post_op: str = "none") -> Tensor:
    """y = post_op(x_MK @ W^T) for one packed weight (post_op: oneDNN's "none", "swish", ...)."""
    return torch.ops.mkldnn._linear_pointwise(x_MK, packed_NK, None, post_op, [], "")


def grouped_gemm_onednn(x_MK: Tensor, w: Tensor, group_sizes_E: Tensor, trans_w: bool) -> Tensor:
    """y_MN = x_g @ w[e] per group (w is [E, K, N]), or x_g @ w[e]^T when trans_w (w is [E, N, K])."""
    n = w.shape[1] if trans_w else w.shape[2]
    y_MN = x_MK.new_empty(x_MK.shape[0], n)
    bounds = _bounds(group_sizes_E)
    if not bounds:
        return y_MN
    packed = packed_weights(w, trans_w)
    for e, start, end in bounds:
        y_MN[start:end] = linear_onednn(x_MK[start:end], packed[e])
    return y_MN


# Expert products that go to the packed C kernel instead of oneDNN (when it builds): the down
# projection up to C_DOWN_MAX_ROWS rows (with the SwiGLU computed inside the kernel), the gate/up
# projection up to C_GATE_UP_MAX_ROWS; oneDNN past that. Per ISA path of the kernel:
# - avx512 (2-core AMD EPYC with AVX-512, 8 experts' weights in turn, ms per expert, oneDNN / C):
#   down [M, 1536] x [1536, 576]: 0.067 / 0.048 at M = 8, 0.32 / 0.25 at 64, 0.56 / 0.49 at 131;
#   gate/up [M, 576] x [576, 3072]: 0.151 / 0.122 at M = 8, 0.55 / 0.52 at 64, 1.07 / 1.00 at 131
#   (oneDNN pays a fixed cost per fresh weight matrix that the C kernel's prefetched stream avoids);
# - avx2 (2-core AMD EPYC Zen 3): the C kernel's 7-row tiles are arithmetic-bound on many rows, so
#   it keeps only small products: `python -m experiments.bench_moe --tokens 1,8,64,512,2048` gave
#   99 / 109 GFLOP/s at T = 512 / 2048 with (32, 64) against 52 / 76 with the AVX-512 limits and
#   92 / 110 with none on C, level at T <= 64.
C_MAX_ROWS = {"avx512": (192, 1024), "avx2": (32, 64), "generic": (32, 64)}
"""(gate/up, down) row limits for the packed C kernel, by ISA path (a ``-vnni`` path: its base's)."""


def _c_max_rows() -> tuple[int, int]:
    try:
        return C_MAX_ROWS[base_isa(cpu_isa())]
    except ValueError:  # a bad SPECDEC_CPU_ISA: reported where a kernel is built, not at import
        return C_MAX_ROWS["generic"]


C_GATE_UP_MAX_ROWS, C_DOWN_MAX_ROWS = _c_max_rows()


class _SwigluWeights:
    """One expert loop's packed weights, in oneDNN's or the C kernel's layout as the row counts need
    (each packed once per weight tensor and cached, see :func:`packed_weights`)."""

    def __init__(self, w_gate_up_EDN: Tensor, w_down_EHD: Tensor) -> None:
        self.trans_gu, self.trans_d = not w_gate_up_EDN.is_contiguous(), not w_down_EHD.is_contiguous()
        self.w_gu = w_gate_up_EDN.transpose(1, 2) if self.trans_gu else w_gate_up_EDN
        self.w_d = w_down_EHD.transpose(1, 2) if self.trans_d else w_down_EHD
        self.use_c = packed_gemm_available()
        self.dim = w_down_EHD.shape[2]
        self.width = w_gate_up_EDN.shape[2]
        self._packed: dict[tuple[str, str], list[Tensor]] = {}

    def _get(self, which: str, layout: str) -> list[Tensor]:
        # packed on first use only: a layer that never sees a small batch keeps no C copy of gate/up
        key = (which, layout)
        if key not in self._packed:
            w, trans = (self.w_gu, self.trans_gu) if which == "gate_up" else (self.w_d, self.trans_d)
            self._packed[key] = packed_weights(w, trans, layout)
        return self._packed[key]

    def _gate_up(self, e: int, x_gD: Tensor) -> Tensor:
        if self.use_c and x_gD.shape[0] <= C_GATE_UP_MAX_ROWS:
            return packed_matmul(x_gD, self._get("gate_up", "c")[e], self.width)
        return linear_onednn(x_gD, self._get("gate_up", "onednn")[e])

    def hidden(self, e: int, x_gD: Tensor, hidden_dim: int) -> Tensor:
        """a_g = swiglu(x_g @ w_gate_up[e]) for one expert's rows (contiguous)."""
        h = self._gate_up(e, x_gD)
        return torch.nn.functional.silu(h[:, :hidden_dim]).mul_(h[:, hidden_dim:])

    def expert(self, e: int, x_gD: Tensor, hidden_dim: int) -> Tensor:
        """y_g = swiglu(x_g @ w_gate_up[e]) @ w_down[e] for one expert's rows (contiguous)."""
        if self.use_c and x_gD.shape[0] <= C_DOWN_MAX_ROWS:
            # The C kernel computes silu(gate) * up itself, in one pass over h (vectorised exp).
            h = self._gate_up(e, x_gD)
            return packed_matmul(h, self._get("down", "c")[e], self.dim, swiglu=True)
        return linear_onednn(self.hidden(e, x_gD, hidden_dim), self._get("down", "onednn")[e])


def grouped_swiglu_onednn(
    x_MD: Tensor, w_gate_up_EDN: Tensor, w_down_EHD: Tensor, group_sizes_E: Tensor, hidden_dim: int
) -> Tensor:
    """SwiGLU experts over expert-sorted rows, one expert at a time (inference only, no autograd):

        h = x_g @ w_gate_up[e];  a = silu(h[:, :H]) * h[:, H:];  y_g = a @ w_down[e]

    w_gate_up_EDN is [E, D, 2H] (or the transpose of a contiguous [E, 2H, D]); w_down_EHD is [E, H, D]
    (or the transpose of a contiguous [E, D, H]). Going expert by expert keeps each expert's [M_e, 2H]
    intermediate in cache instead of writing a [M, 2H] buffer (measured ~2x faster than two grouped
    GEMMs at T = 2048). The reference is ``moe.SwiGLUExperts.expert``.
    """
    y_MD = x_MD.new_empty(x_MD.shape[0], w_down_EHD.shape[2])
    bounds = _bounds(group_sizes_E)
    if not bounds:
        return y_MD
    weights = _SwigluWeights(w_gate_up_EDN, w_down_EHD)
    for e, start, end in bounds:
        y_MD[start:end] = weights.expert(e, x_MD[start:end], hidden_dim)
    return y_MD


def swiglu_blocks_onednn(
    x_MD: Tensor, w_gate_up_EDN: Tensor, w_down_EHD: Tensor, group_sizes: list[int], hidden_dim: int
) -> list[Tensor | None]:
    """:func:`grouped_swiglu_onednn`, returning each expert's output block [M_e, D] (None when M_e = 0)
    instead of copying them into one [M, D] tensor: for a combine that reads the blocks in place
    (``kernels.routing.native.combine_blocks_cpu``). ``group_sizes`` is a list of E ints.
    """
    weights = _SwigluWeights(w_gate_up_EDN, w_down_EHD)
    blocks: list[Tensor | None] = []
    start = 0
    for e, rows in enumerate(group_sizes):
        blocks.append(weights.expert(e, x_MD[start : start + rows], hidden_dim) if rows else None)
        start += rows
    return blocks
