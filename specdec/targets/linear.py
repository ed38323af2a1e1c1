"""Linear layers in the format and layout the CPU multiplies fastest, with the plain ``F.linear`` beside them.

Legend: M rows (batch × block tokens), I input features, O output features.

Decoding a small model on a CPU is a chain of matrix-vector products (M = 1) or skinny products
(M = 2..12 while verifying drafts), bound by how fast the weights stream from memory or dequantise.
Each layer is ``y = residual + W·x' + b`` where the input transform ``x'`` (an RMSNorm, or the
SwiGLU ``silu(gate)·up`` of the MLP) and the residual are part of the layer: the packed kernel
fuses them, saving the small elementwise ops that cost as much as attention at this model size.

Weights (:data:`WEIGHT_FORMATS`): a float tensor stored as ``float32`` or ``bfloat16``, or a
:class:`kernels.quant.QuantizedRows` (GGUF Q4_0 / Q4_1 / Q8_0 blocks, int8 per channel, int4 per
group), kept quantised and dequantised in registers by the kernel. With ``act8=True`` quantised rows
run with **8-bit activations** instead (formats ``q8a8`` / ``q4a8``: ``x'`` quantised per row in blocks
of 32, integer dot products; see :mod:`kernels.q8_reference`): another function than the float
product, batch invariant (a row's output does not depend on the other rows).

Backends (``LINEAR_BACKENDS``); activations are float32 on the packed kernel (8-bit for ``act8``,
where both PyTorch backends run the plain-PyTorch oracle :func:`kernels.q8_reference.linear_a8_reference`):

- ``reference``: ``F.rms_norm`` / ``F.silu``, ``F.linear``, then ``+ residual``: the oracle. The
  weight lives on ``device`` in ``dtype`` (a float weight stored as such, quantised rows dequantised
  once, on the device, into it); the products run in the weight's dtype (an input of another dtype is
  cast to it and the output cast back), so a bfloat16 model on a GPU stores and computes in bfloat16;
- ``transposed``: the same ops on ``Wᵀ [I, O]`` stored contiguously (MKL's fastest M = 1 path);
- ``packed``: ``kernels/csrc/packed_gemm.c`` (``kernels.packed_gemm``) on the ISA path this CPU
  runs (AVX-512, AVX2 or generic), compiled once per machine into the specdec cache.

``auto`` picks ``packed`` on a CPU when it compiles (else ``transposed``, with a warning), and
``reference`` on other devices.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.packed_gemm import PackedWeight, pack_weight, packed_gemm_available, packed_linear
from kernels.q8_reference import linear_a8_reference
from kernels.quant import QuantizedRows

__all__ = ["PackedLinear", "LINEAR_BACKENDS", "WEIGHT_FORMATS", "resolve_backend"]

WEIGHT_FORMATS = ("f32", "bf16", "f16", "q8", "q4", "q8a8", "q4a8")
_FLOAT_FORMAT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}

Weight = torch.Tensor | QuantizedRows | PackedWeight


class PackedLinear:
    """``y = residual + W x' + b`` with ``W [O, I]`` kept in a backend-specific layout and format.

    ``x'`` is ``x`` transformed at the input: ``swiglu`` (``x = [gate | up]``, 2I wide, and
    ``x' = silu(gate) * up``), then ``norm_weight_I`` (``x' = RMSNorm(x')`` with that weight and
    ``norm_eps``). A float weight is stored in ``dtype`` (default: its own); quantised rows stay
    quantised on the packed kernel and are dequantised into ``dtype`` (default float32) on the
    PyTorch backends, on ``device`` (default: the weight's own; the CPU for quantised rows).
    ``act8``: quantised rows run with 8-bit activations (a packed ``q8a8`` / ``q4a8`` weight implies it).
    ``backend``: ``auto`` (:func:`resolve_backend`) or a ``LINEAR_BACKENDS`` name. Call it as ``lin(x)``
    or ``lin(x, residual)``.
    """

    def __init__(
        self,
        weight: Weight,
        bias_O: torch.Tensor | None = None,
        backend: str = "auto",
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        norm_weight_I: torch.Tensor | None = None,
        norm_eps: float = 1e-6,
        swiglu: bool = False,
        act8: bool = False,
    ) -> None:
        if device is None:
            device = weight.device if isinstance(weight, torch.Tensor) else "cpu"
        self.backend = backend = resolve_backend(backend, device)
        self.device = torch.device(device)
        self.dtype = dtype  # float storage; None: the weight's own (float32 for quantised rows)
        if isinstance(weight, PackedWeight):  # already in a layout (a cache of packed weights)
            self.out_features, self.in_features, self.format = (
                weight.out_features,
                weight.in_features,
                weight.fmt,
            )
            act8 = weight.act8
        elif isinstance(weight, QuantizedRows):
            self.out_features, self.in_features = weight.shape
            self.format = weight.kind + ("a8" if act8 else "")
        elif act8:
            raise ValueError(
                f"act8 (8-bit activations) needs quantised weights (QuantizedRows), got a float "
                f"{tuple(weight.shape)} tensor"
            )
        else:
            self.out_features, self.in_features = weight.shape
            storage = dtype or weight.dtype
            if storage not in _FLOAT_FORMAT:
                raise ValueError(f"float weights are stored as float32, bfloat16 or float16, got {storage}")
            self.format = _FLOAT_FORMAT[storage]
            weight = weight.to(storage)
        self.bias_O = None if bias_O is None else bias_O.float().contiguous()
        self.norm_weight_I = None if norm_weight_I is None else norm_weight_I.float().contiguous()
        self.norm_eps = float(norm_eps)
        self.swiglu = swiglu
        self.act8 = act8
        self._fn = LINEAR_BACKENDS[backend](self, weight)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self._fn(x, residual)

    def weight_float(self) -> torch.Tensor:
        """The weight as float32 ``[O, I]`` (dequantised where it is stored quantised)."""
        return self._weight_OI().float()

    @property
    def nbytes(self) -> int:
        """Bytes of weights one call streams (the packed layout's, or the float weight's)."""
        return self._nbytes


_Run = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _dequantized(weight: Weight, lin: PackedLinear) -> torch.Tensor:
    """The weight as a float tensor on ``lin.device`` in ``lin.dtype`` (quantised rows are moved
    there packed and dequantised there: a GGUF model dequantises on the GPU, never on the host)."""
    if isinstance(weight, torch.Tensor):
        return weight.to(device=lin.device, dtype=lin.dtype or weight.dtype)
    if not isinstance(weight, QuantizedRows):
        raise ValueError(
            f"linear backend {lin.backend!r} takes float tensors or QuantizedRows, "
            f"got {type(weight).__name__}"
        )
    m = None if weight.m_OG is None else weight.m_OG.to(lin.device)
    moved = QuantizedRows(
        weight.kind, weight.q_OI.to(lin.device), weight.d_OG.to(lin.device), m, weight.group_size
    )
    return moved.dequantize().to(lin.dtype or torch.float32)


def _torch_backend(
    lin: PackedLinear, dtype: torch.dtype, linear: Callable[[torch.Tensor], torch.Tensor]
) -> _Run:
    """The unfused ops, in the order ``transformers`` runs them, in ``dtype`` (the weight's: an input
    of another dtype is cast to it, and the output back); ``linear`` adds the bias."""
    I, eps = lin.in_features, lin.norm_eps
    norm_w = None if lin.norm_weight_I is None else lin.norm_weight_I.to(device=lin.device, dtype=dtype)

    def run(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        out_dtype = x.dtype
        if out_dtype != dtype:
            x = x.to(dtype)
        if lin.swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        if norm_w is not None:
            x = F.rms_norm(x, (I,), norm_w, eps)
        y = linear(x)
        if y.dtype != out_dtype:
            y = y.to(out_dtype)
        return y if residual is None else residual + y

    return run


def _a8_reference(lin: PackedLinear, weight: Weight) -> _Run:
    """The 8-bit-activation product in plain PyTorch, with the transforms where the kernel has them:
    SwiGLU, then ``x · norm_weight`` quantised, and the RMSNorm's ``1 / rms`` after the product."""
    if not isinstance(weight, QuantizedRows):
        raise ValueError(
            f"linear backend {lin.backend!r} runs act8 products from QuantizedRows, "
            f"got {type(weight).__name__}"
        )
    w_OI = weight.dequantize()
    lin._weight_OI = lambda: w_OI
    lin._nbytes = w_OI.numel() * 4
    norm_w, eps = lin.norm_weight_I, lin.norm_eps

    def run(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        x = x.float()
        if lin.swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        scale = None
        if norm_w is not None:
            scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            x = x * norm_w
        y = linear_a8_reference(x, weight, lin.bias_O, row_scale_M=scale)
        return y if residual is None else residual + y

    return run


def _reference(lin: PackedLinear, weight: Weight) -> _Run:
    if lin.act8:
        return _a8_reference(lin, weight)
    w_OI = _dequantized(weight, lin)
    lin._weight_OI = lambda: w_OI
    lin._nbytes = w_OI.numel() * w_OI.element_size()
    b = None if lin.bias_O is None else lin.bias_O.to(device=w_OI.device, dtype=w_OI.dtype)
    return _torch_backend(lin, w_OI.dtype, lambda x: F.linear(x, w_OI, b))


def _transposed(lin: PackedLinear, weight: Weight) -> _Run:
    if lin.act8:  # no faster PyTorch path for 8-bit activations: the oracle
        return _a8_reference(lin, weight)
    w_IO = _dequantized(weight, lin).t().contiguous()
    lin._weight_OI = lambda: w_IO.t()
    lin._nbytes = w_IO.numel() * w_IO.element_size()
    b = None if lin.bias_O is None else lin.bias_O.to(device=w_IO.device, dtype=w_IO.dtype)
    mm = lambda x: torch.matmul(x, w_IO)
    return _torch_backend(lin, w_IO.dtype, mm if b is None else (lambda x: mm(x) + b))


def _packed(lin: PackedLinear, weight: Weight) -> _Run:
    if lin.device.type != "cpu" or (isinstance(weight, torch.Tensor) and weight.device.type != "cpu"):
        raise ValueError(f"linear backend 'packed' runs on the CPU, got device {lin.device}")
    if isinstance(weight, torch.Tensor) and weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"linear backend 'packed' stores float weights as float32 or bfloat16, got {weight.dtype}"
        )
    if isinstance(weight, PackedWeight):
        packed = weight
    elif isinstance(weight, QuantizedRows):
        packed = weight.pack(act8=lin.act8)
    else:
        packed = pack_weight(weight, weight.dtype)
    lin._nbytes = packed.nbytes
    lin.packed_weight = packed
    lin._weight_OI = packed.dequantize
    bias, norm_w = lin.bias_O, lin.norm_weight_I
    eps = lin.norm_eps if norm_w is not None else None

    def run(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != torch.float32:
            x = x.float()
        if residual is not None and residual.dtype != torch.float32:
            residual = residual.float()
        return packed_linear(
            x,
            packed,
            bias_O=bias,
            norm_weight_I=norm_w,
            norm_eps=eps,
            swiglu=lin.swiglu,
            residual_MO=residual,
        )

    return run


LINEAR_BACKENDS: dict[str, Callable[[PackedLinear, Weight], _Run]] = {
    "reference": _reference,
    "transposed": _transposed,
    "packed": _packed,
}


@functools.cache
def _packed_available() -> bool:
    if packed_gemm_available():
        return True
    warnings.warn(
        "packed linear kernel unavailable (no C compiler?); using the 'transposed' backend", stacklevel=3
    )
    return False


def resolve_backend(backend: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """Turn ``auto`` into a concrete backend for ``device`` and the compute ``dtype``: the packed
    kernels for a CPU computing in float32 (``dtype`` None or float32), else ``reference`` (PyTorch
    ops in ``dtype``, any device). ``ValueError`` for unknown names and for ``packed`` off the CPU."""
    on_cpu = torch.device(device).type == "cpu"
    if backend == "auto":
        if not on_cpu or dtype not in (None, torch.float32):
            return "reference"
        return "packed" if _packed_available() else "transposed"
    if backend not in LINEAR_BACKENDS:
        raise ValueError(
            f"linear backend must be 'auto' or one of {sorted(LINEAR_BACKENDS)}, got {backend!r}"
        )
    if backend == "packed" and not on_cpu:
        raise ValueError(
            f"linear backend 'packed' runs on the CPU, got device {str(device)!r}; use 'reference' or 'auto'"
        )
    return backend
