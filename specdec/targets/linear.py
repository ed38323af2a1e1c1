"""Linear layers stored in the layout the CPU multiplies fastest, with the plain ``F.linear`` beside them.

Legend: M rows (batch × block tokens), I input features, O output features, BW packed block width.

Decoding a small model on a CPU is a chain of matrix-vector products (M = 1) or skinny products
(M = 2..9 while verifying drafts), bound by how fast the weights stream from memory. BLAS
libraries are tuned for large M and leave bandwidth unused here; worse, on the dev machine MKL's
small-M path makes M = 4 cost ~3× M = 1, which taxes every speculative verify step.

Each layer is ``y = residual + W·x' + b`` where the input transform ``x'`` (an RMSNorm, or the
SwiGLU ``silu(gate)·up`` of the MLP) and the residual are part of the layer: the packed kernel
fuses them, saving the small elementwise ops that cost as much as attention at this model size.

Backends (``LINEAR_BACKENDS``); activations are float32, weights float32 or bfloat16:

- ``reference``: ``F.rms_norm`` / ``F.silu``, ``F.linear(x, W, b)`` and ``+ residual``: the oracle;
- ``transposed``: the same ops with ``Wᵀ [I, O]`` stored contiguously (MKL's fastest M = 1 path);
- ``packed``: ``kernels/csrc/packed_gemm.c`` (``kernels.packed_gemm``), weights packed
  ``[O/BW, I, BW]`` (RMSNorm weight folded into the columns) so every weight is read once per call
  for up to 12 rows; compiled once per machine with the system C compiler
  (``cc -O3 -march=native -fopenmp``) into the specdec cache and loaded with ``ctypes``.

``auto`` picks ``packed`` on a CPU when it compiles (else ``transposed``, with a warning), and
``reference`` on other devices. ``python -m specdec.targets.llama_bench --linear`` compares them.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.packed_gemm import pack_weight, packed_gemm_library

__all__ = ["PackedLinear", "LINEAR_BACKENDS", "pack_linear", "resolve_backend", "packed_gemm_library"]


class PackedLinear:
    """``y = residual + W x' + b`` with ``W [O, I]`` kept in a backend-specific layout.

    ``x'`` is ``x`` transformed at the input: ``swiglu`` (``x = [gate | up]``, 2I wide, and
    ``x' = silu(gate) * up``), then ``norm_weight_I`` (``x' = RMSNorm(x')`` with that weight and
    ``norm_eps``). Weights are stored in ``dtype`` (default: the weight's). Call it as ``lin(x)``
    or ``lin(x, residual)``.
    """

    def __init__(
        self,
        weight_OI: torch.Tensor,
        bias_O: torch.Tensor | None,
        backend: str,
        *,
        dtype: torch.dtype | None = None,
        norm_weight_I: torch.Tensor | None = None,
        norm_eps: float = 1e-6,
        swiglu: bool = False,
    ) -> None:
        self.backend = backend
        self.out_features, self.in_features = weight_OI.shape
        self.dtype = dtype or weight_OI.dtype
        self.bias_O = None if bias_O is None else bias_O.float()
        self.norm_weight_I = None if norm_weight_I is None else norm_weight_I.float()
        self.norm_eps = float(norm_eps)
        self.swiglu = swiglu
        self._fn = LINEAR_BACKENDS[backend](self, weight_OI)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self._fn(x, residual)


_Run = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _torch_backend(lin: PackedLinear, linear: Callable[[torch.Tensor], torch.Tensor]) -> _Run:
    """The unfused ops, in the order ``transformers`` runs them; ``linear`` adds the bias."""
    I, norm_w, eps = lin.in_features, lin.norm_weight_I, lin.norm_eps

    def run(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if lin.swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        if norm_w is not None:
            x = F.rms_norm(x, (I,), norm_w, eps)
        y = linear(x)
        return y if residual is None else residual + y

    return run


def _reference(lin: PackedLinear, w_OI: torch.Tensor) -> _Run:
    w_OI = w_OI.to(lin.dtype)
    b = None if lin.bias_O is None else lin.bias_O.to(lin.dtype)
    if lin.dtype == torch.float32:
        return _torch_backend(lin, lambda x: F.linear(x, w_OI, b))
    return _torch_backend(lin, lambda x: F.linear(x.to(lin.dtype), w_OI, b).float())


def _transposed(lin: PackedLinear, w_OI: torch.Tensor) -> _Run:
    w_IO = w_OI.t().to(lin.dtype).contiguous()
    b = lin.bias_O
    if lin.dtype == torch.float32:
        mm = lambda x: torch.matmul(x, w_IO)
    else:
        mm = lambda x: torch.matmul(x.to(lin.dtype), w_IO).float()
    return _torch_backend(lin, mm if b is None else (lambda x: mm(x) + b))


def _packed(lin: PackedLinear, w_OI: torch.Tensor) -> _Run:
    if w_OI.device.type != "cpu":
        raise ValueError(f"linear backend 'packed' runs on the CPU, got weights on {w_OI.device}")
    if lin.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"linear backend 'packed' stores float32 or bfloat16 weights, got {lin.dtype}")
    lib = packed_gemm_library()
    BW = lib.packed_gemm_block_width()
    O, I = w_OI.shape
    nb = -(-O // BW)
    w = w_OI.float()
    if lin.norm_weight_I is not None:  # RMSNorm(x)·diag(n)·Wᵀ == (x / rms(x))·(W diag(n))ᵀ
        w = w * lin.norm_weight_I[None, :]
    w_packed = pack_weight(w, lin.dtype)  # [nb, I, BW]
    del w
    gemm = lib.packed_gemm_f32 if lin.dtype == torch.float32 else lib.packed_gemm_bf16
    bias = None
    if lin.bias_O is not None:  # padded: the kernel reads whole blocks
        bias = torch.zeros(nb * BW)
        bias[:O] = lin.bias_O
    w_ptr, b_ptr = w_packed.data_ptr(), (None if bias is None else bias.data_ptr())
    eps = lin.norm_eps if lin.norm_weight_I is not None else -1.0
    act = 1 if lin.swiglu else 0
    width = 2 * I if lin.swiglu else I
    lin._keepalive = (w_packed, bias)  # the kernel reads these by address

    def run(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        y = torch.empty((*x.shape[:-1], O))
        r_ptr = None
        if residual is not None:
            residual = residual.float().contiguous()
            r_ptr = residual.data_ptr()
        if gemm(
            x.data_ptr(),
            x.numel() // width,
            I,
            w_ptr,
            O,
            b_ptr,
            y.data_ptr(),
            torch.get_num_threads(),
            eps,
            act,
            r_ptr,
        ):
            raise MemoryError("packed_gemm: out of memory")
        return y

    return run


LINEAR_BACKENDS: dict[str, Callable[[PackedLinear, torch.Tensor], _Run]] = {
    "reference": _reference,
    "transposed": _transposed,
    "packed": _packed,
}


@functools.cache
def _packed_available() -> bool:
    try:
        packed_gemm_library()
        return True
    except (RuntimeError, OSError) as e:
        warnings.warn(f"packed linear kernel unavailable ({e}); using the 'transposed' backend", stacklevel=3)
        return False


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Turn ``auto`` into a concrete backend for ``device``; ``ValueError`` for unknown names."""
    if backend == "auto":
        if torch.device(device).type != "cpu":
            return "reference"
        return "packed" if _packed_available() else "transposed"
    if backend not in LINEAR_BACKENDS:
        raise ValueError(
            f"linear backend must be 'auto' or one of {sorted(LINEAR_BACKENDS)}, got {backend!r}"
        )
    return backend


def pack_linear(
    weight_OI: torch.Tensor,
    bias_O: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    dtype: torch.dtype | None = None,
    norm_weight_I: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    swiglu: bool = False,
) -> PackedLinear:
    """Build a :class:`PackedLinear`; ``backend``: ``auto`` or a ``LINEAR_BACKENDS`` name."""
    return PackedLinear(
        weight_OI,
        bias_O,
        resolve_backend(backend, weight_OI.device),
        dtype=dtype,
        norm_weight_I=norm_weight_I,
        norm_eps=norm_eps,
        swiglu=swiglu,
    )
