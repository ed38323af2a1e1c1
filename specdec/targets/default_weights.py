"""Which weight format ``weights="auto"`` (the default of ``load_target`` and ``--weights``) means.

- A safetensors checkpoint: ``fp32`` (``bf16`` with ``dtype=torch.bfloat16``).
- A GGUF model (the built-in ``smollm2-135m``, a ``.gguf`` path): ``gguf-q8`` (the file's own blocks
  with 8-bit activations and integer dot products) where it is the faster exact path, else ``gguf``
  (fp32 activations, the same function as ``transformers`` on the dequantised file). ``gguf-q8`` is
  chosen when all of these hold:

  - the products run on the packed CPU kernels (linear backend ``packed``: a CPU device and a C
    compiler); elsewhere ``gguf-q8`` would run its plain-PyTorch oracle, far slower than ``gguf``;
  - the kernels' ISA path (:func:`kernels.native.cpu_isa`, ``SPECDEC_CPU_ISA`` forces one) is in
    :data:`Q8_DEFAULT_ISAS`;
  - every matrix the target multiplies by (the layers' projections and the LM head) is stored as
    ``Q4_0`` / ``Q4_1`` / ``Q8_0``, the blocks ``gguf-q8`` runs (read from the file's tensor index,
    no data loaded); a file with a float matrix (an ``F16`` head, say) gets ``gguf``, which runs it.

Both are exact targets for speculative decoding (``gguf-q8`` is batch invariant, so speculative output
equals its own plain decoding token for token); only ``gguf`` equals ``transformers``' greedy output,
so pass ``weights="gguf"`` for that. An explicit ``weights=`` / ``--weights`` always wins.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels.quant import GGUF_KINDS

__all__ = ["Q8_DEFAULT_ISAS", "default_weights", "gguf_q8_runnable"]

Q8_DEFAULT_ISAS = frozenset({"avx512-vnni", "avx2-vnni", "avx512", "avx2"})
"""ISA paths on which a GGUF model defaults to ``gguf-q8``: every path with an integer dot product
instruction (``vpdpbusd`` on the ``-vnni`` paths, ``vpmaddubsw`` + ``vpmaddwd`` on ``avx512`` / ``avx2``),
where the 8-bit-activation products make a verify block cheaper; ``generic`` (plain C, no such
instruction) keeps ``gguf``. The measurements behind the choice: docs/kernels.md, "Which format is
the default"."""


def gguf_q8_runnable(source: str | Path) -> bool:
    """True when every matrix the target multiplies by in the GGUF file ``source`` (each ``blk.*``
    matrix, and ``output.weight`` or, without one, the tied ``token_embd.weight``) is a block type
    ``gguf-q8`` runs (:data:`kernels.quant.GGUF_KINDS`). Reads the header and tensor index only."""
    from specdec.targets.gguf_index import read_gguf_index

    tensors = read_gguf_index(source).tensors
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    products = [t for t in tensors.values() if len(t.dims) == 2 and t.name != "token_embd.weight"]
    if head in tensors:
        products.append(tensors[head])
    return all(t.kind in GGUF_KINDS for t in products)


def default_weights(source: str | Path | None, *, dtype: torch.dtype | None, linear_backend: str) -> str:
    """The format ``weights="auto"`` resolves to (see the module docstring): ``source`` the GGUF file
    the model comes as (None for a safetensors checkpoint), ``dtype`` the requested float dtype,
    ``linear_backend`` the *resolved* linear backend (``packed``, ``transposed``, ``reference``)."""
    if source is None:
        return "bf16" if dtype == torch.bfloat16 else "fp32"
    if linear_backend != "packed":
        return "gguf"
    from kernels.native import cpu_isa

    if cpu_isa() not in Q8_DEFAULT_ISAS:
        return "gguf"
    return "gguf-q8" if gguf_q8_runnable(source) else "gguf"
