"""Where a native target runs and in which dtype: the combinations that run, and the rest refused.

A native target has three settings that must agree (``docs/targets.md`` has the table):

- ``weights``, the format (:data:`specdec.targets.llama_weights.WEIGHT_MODES`): float (``fp32``,
  ``bf16``, ``fp16``), quantised rows (``gguf``, ``int8``, ``int4``) or quantised rows with 8-bit
  activations (``gguf-q8``, ``int8-q8``, ``int4-q8``);
- the linear backend (:mod:`specdec.targets.linear`): the packed CPU kernels (``packed``) or PyTorch
  ops (``reference``, ``transposed``), which run on any device;
- ``dtype``, the compute dtype: what the activations and the KV cache are stored and computed in, and
  what quantised rows (and their embedding table) are dequantised into on the PyTorch backends; a
  float format's embedding table is stored in the format's dtype, like its matrices.

Rules:

- the packed kernels run on the CPU and compute in float32 (bf16 weights stay bf16 there: float32
  activations, bf16 weights streamed); ``linear_backend="auto"`` picks them only for a CPU target
  asked for no dtype or float32, and PyTorch ops (``reference``) otherwise;
- 8-bit activations (``*-q8``) run on the CPU in float32 only;
- on the PyTorch backends everything runs in ``dtype``; with ``dtype`` unset it is the format's own
  (``bf16`` -> bfloat16, ``fp16`` -> float16, ``fp32`` -> float32), and for quantised rows float32
  on the CPU and bfloat16 elsewhere (dequantised once, on the device, into that dtype);
- ``weights="fp32"`` with ``dtype`` bfloat16 or float16 is read as ``bf16`` / ``fp16`` (float
  weights stored in the dtype asked for, never as float32).

Anything else is a ``ValueError`` naming the combination and what runs instead.
"""

from __future__ import annotations

import torch

__all__ = ["FLOAT_FORMATS", "COMPUTE_DTYPES", "resolve_placement", "dtype_name"]

FLOAT_FORMATS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Float weight formats and the dtype each stores its weights in."""
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes a native target computes in (``dtype=``)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def resolve_placement(
    weights: str, dtype: torch.dtype | None, device: torch.device, backend: str
) -> tuple[str, torch.dtype]:
    """The weight format and compute dtype a native target runs with (see the module docstring);
    ``backend`` the *resolved* linear backend. ``ValueError`` naming an unsupported combination."""
    if dtype is not None and dtype not in COMPUTE_DTYPES:
        names = ", ".join(dtype_name(d) for d in COMPUTE_DTYPES)
        raise ValueError(f"dtype must be one of {names} (or None: the format's own), got {dtype}")
    if weights == "fp32" and dtype in (torch.bfloat16, torch.float16):
        weights = "bf16" if dtype == torch.bfloat16 else "fp16"  # stored in the dtype asked for
    asked = f"weights={weights!r}, dtype={dtype_name(dtype) if dtype else None}, device={device.type!r}"
    if weights.endswith("-q8"):
        if device.type != "cpu":
            raise ValueError(
                f"{asked}: 8-bit activations run on the CPU's packed kernels only; on {device.type} "
                f"use weights='{weights.removesuffix('-q8')}' (dequantised on the device into dtype)"
            )
        if dtype not in (None, torch.float32):
            raise ValueError(f"{asked}: 8-bit activations compute in float32; drop dtype or pass float32")
    if backend == "packed":
        if device.type != "cpu":
            raise ValueError(f"{asked}: linear backend 'packed' runs on the CPU; use 'reference' or 'auto'")
        if dtype not in (None, torch.float32):
            raise ValueError(
                f"{asked}: linear backend 'packed' computes in float32 (with fp32 or bf16 weights: "
                "weights='bf16' stores them in bfloat16); use linear_backend 'reference' or 'auto' for "
                f"{dtype_name(dtype)} activations and cache"
            )
        if weights == "fp16":
            raise ValueError(
                f"{asked}: linear backend 'packed' stores float weights as fp32 or bf16, not fp16"
            )
        return weights, torch.float32
    if dtype is not None:
        return weights, dtype
    if weights in FLOAT_FORMATS:
        return weights, FLOAT_FORMATS[weights]
    return weights, torch.float32 if device.type == "cpu" else torch.bfloat16
