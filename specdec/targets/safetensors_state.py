"""A safetensors checkpoint read tensor by tensor: shapes at once, each tensor's data when asked, in
the dtype asked.

Legend: N elements.

:func:`open_safetensors_state` reads the files' headers (checked by ``safetensors`` itself) and
returns a :class:`~specdec.targets.checkpoint_contract.Checkpoint` of :class:`StoredTensor` handles:
a shape, a dtype and where the bytes lie, no data. :meth:`StoredTensor.read_into` reads one tensor
with plain file reads, never a memory map (what the process keeps resident is what it built, not the
file's pages), in chunks of :data:`CHUNK_BYTES`, each converted into the output. So a float32
checkpoint loads as a bfloat16 model with a transient of one chunk, never a float32 copy of a
tensor, and a loader that converts tensor by tensor peaks near its final size.
:func:`load_safetensors_state` reads every tensor as stored (a state dict of tensors).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from specdec.targets.checkpoint_contract import Checkpoint

__all__ = ["CHUNK_BYTES", "StoredTensor", "open_safetensors_state", "load_safetensors_state"]

CHUNK_BYTES = 8 << 20
"""Bytes read (and converted) at a time when a tensor is read into another dtype or device."""

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors dtype names and the torch dtypes they read as."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file, not yet read: its ``shape``, ``dtype`` and first byte."""

    path: Path
    name: str
    shape: torch.Size
    dtype: torch.dtype
    offset: int  # of the tensor's first byte, from the start of the file

    def is_floating_point(self) -> bool:
        """Whether the stored values are floats (as ``torch.Tensor.is_floating_point``)."""
        return self.dtype.is_floating_point

    def read_into(self, out: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """Read the tensor into ``out`` (contiguous, of its shape, any dtype and device) and return it.

        Read straight into ``out`` when it is a CPU tensor of the stored dtype; otherwise a chunk at
        a time into ``scratch`` (a CPU ``uint8`` tensor; default: :data:`CHUNK_BYTES` of its own),
        each chunk converted into ``out``. A loader reading many tensors passes one scratch to all,
        so no large buffer is freed and allocated again between tensors (glibc then keeps the
        freed ones as holes in the process's heap)."""
        if tuple(out.shape) != tuple(self.shape) or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous tensor of shape {list(self.shape)} for {self.name!r}, got "
                f"{list(out.shape)}"
            )
        out_N = out.view(-1)
        N, itemsize = out_N.numel(), self.dtype.itemsize
        direct = out.dtype == self.dtype and out.device.type == "cpu"
        if not direct and scratch is None:
            scratch = torch.empty(min(CHUNK_BYTES, N * itemsize), dtype=torch.uint8)
        if not direct and (scratch.dtype != torch.uint8 or scratch.device.type != "cpu"):
            raise ValueError(f"scratch must be a CPU uint8 tensor, got {scratch.dtype} on {scratch.device}")
        step = max(1, CHUNK_BYTES // itemsize) if direct else scratch.numel() // itemsize
        if step < 1:
            raise ValueError(f"scratch must hold at least one {self.dtype} value ({itemsize} bytes)")
        buffer_N = None if direct else scratch[: step * itemsize].view(self.dtype)
        with open(self.path, "rb") as file:
            file.seek(self.offset)
            for start in range(0, N, step):
                count = min(step, N - start)
                chunk_N = out_N[start : start + count] if direct else buffer_N[:count]
                self._read_exactly(file, chunk_N)
                if not direct:
                    out_N[start : start + count].copy_(chunk_N)
        return out

    def load(
        self,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        scratch: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The tensor as a new one in ``dtype`` (default: as stored) on ``device`` (``scratch``: see
        :meth:`read_into`)."""
        out = torch.empty(self.shape, dtype=dtype or self.dtype, device=device)
        return self.read_into(out, scratch)

    def _read_exactly(self, file: BinaryIO, chunk_N: torch.Tensor) -> None:
        view = memoryview(chunk_N.view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            n = file.readinto(view[done:])
            if not n:
                raise ValueError(f"{self.path}: tensor {self.name!r} is cut short (the file ends first)")
            done += n


def _stored_tensors(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of one safetensors file, from its header (``ValueError`` naming the file when it
    is not a readable safetensors file, or holds a dtype torch does not read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):  # safetensors checks the header and the offsets
            pass
        with open(path, "rb") as file:
            (size,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(size))
    except (SafetensorError, OSError, ValueError, struct.error) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from None
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(
                f"{path}: tensor {name!r} has dtype {info['dtype']}, which the native target does not "
                f"read ({', '.join(_DTYPES)})"
            )
        start = 8 + size + info["data_offsets"][0]
        tensors[name] = StoredTensor(path, name, torch.Size(info["shape"]), _DTYPES[info["dtype"]], start)
    return tensors


def _shard_files(path: Path) -> list[str]:
    """The safetensors files of a checkpoint directory (``model.safetensors`` or a sharded index)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index}: not a valid safetensors index ({err})") from None
    if (path / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise ValueError(
        f"no safetensors weights in {path} (model.safetensors or model.safetensors.index.json); "
        "the native target never unpickles .bin checkpoints: re-save with safe_serialization=True"
    )


def open_safetensors_state(path: str | os.PathLike) -> Checkpoint:
    """Every tensor of a local checkpoint directory as a :class:`StoredTensor` (headers read, no
    data), in a :class:`Checkpoint` that remembers each tensor's file."""
    path = Path(path)
    state = Checkpoint()
    for name in _shard_files(path):
        state.update_from(_stored_tensors(path / name), path / name)
    return state


def load_safetensors_state(path: str | os.PathLike) -> Checkpoint:
    """All tensors of a local checkpoint directory (``model.safetensors`` or a sharded index), read
    as stored, in a :class:`Checkpoint` that remembers each tensor's file."""
    state = open_safetensors_state(path)
    for name, stored in list(state.items()):
        state[name] = stored.load()
    return state
