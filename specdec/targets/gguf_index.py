"""A GGUF file's header and tensor index, read and checked without touching the tensor data.

:func:`read_gguf_index` checks what a reader would otherwise trust: the tensor and key counts the
header claims against the file's size (before anything is allocated for them), every metadata value
and tensor entry (name, shape, type), and every tensor's bytes inside the file, one after another
without overlap. A truncated or malformed file is a one-line ``ValueError`` naming the file and the
field or tensor, where ``gguf``'s own reader fails with ``struct.error``, a UTF-8 decode error or
``cannot reshape array``. Little-endian GGUF versions 2 and 3 (what llama.cpp writes) are read.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUFArray", "GGUFTensor", "GGUFIndex", "read_gguf_index"]

# GGUF metadata value types (gguf-py's GGUFValueType): struct formats of the scalars; 8 string; 9 array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MIN_KEY_BYTES, _MIN_TENSOR_BYTES = 13, 24  # the smallest metadata entry and tensor entry


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array, by its item type and length (its items are not kept)."""

    item_type: int
    length: int


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor entry: ``dims`` as GGUF lists them (fastest first), ``offset`` from the file start."""

    name: str
    dims: tuple[int, ...]
    kind: str
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape in PyTorch's order (``[O, I]`` for a matrix)."""
        return self.dims[::-1]


@dataclass(frozen=True)
class GGUFIndex:
    """A GGUF file's header, metadata (scalars and strings; arrays by length) and tensor index."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    data_start: int
    file_size: int


class _Cursor:
    """Reads little-endian GGUF fields from a buffer, every read checked against its end."""

    def __init__(self, path: Path, buf: Any, size: int) -> None:
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise self.fail(
                f"truncated GGUF header: {what} at byte {self.pos} needs {n} bytes, the file has {self.size}"
            )

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize("<" + fmt)
        self.need(n, what)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return value

    def count(self, each: int, what: str) -> int:
        """A u64 count of items of at least ``each`` bytes, checked against the bytes left."""
        n = self.scalar("Q", what)
        if n * each > self.size - self.pos:
            raise self.fail(
                f"GGUF {what} is {n}, more than the {self.size - self.pos} bytes left in the file can hold "
                "(a truncated or corrupt header)"
            )
        return n

    def string(self, what: str) -> str:
        n = self.count(1, f"length of {what}")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {self.pos - n} is not UTF-8") from None

    def value(self, kind: int, what: str) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind != _ARRAY:
            raise self.fail(f"{what} has unknown GGUF value type {kind}")
        item = self.scalar("I", f"{what} item type")
        if item in _SCALARS:
            each = struct.calcsize("<" + _SCALARS[item])
            n = self.count(each, f"{what} length")
            self.pos += n * each
        elif item == _STRING:
            n = self.count(8, f"{what} length")
            for _ in range(n):  # skipped, not decoded (a vocabulary has ~10^5 of them)
                length = self.count(1, f"length of a string in {what}")
                self.pos += length
        else:
            raise self.fail(f"{what} is an array of GGUF value type {item}, which is not read")
        return GGUFArray(item, n)


def read_gguf_index(path: str | os.PathLike) -> GGUFIndex:
    """Read and check a GGUF file's header and tensor index (``ValueError`` naming the file and the
    field or tensor): counts within the file's size, known value and tensor types, shapes that the
    tensor types' blocks divide, and every tensor's bytes inside the file without overlap."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ValueError(f"{path}: not a GGUF file ({size} bytes, shorter than a GGUF header)")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as err:
        raise ValueError(f"{path}: not a readable GGUF file ({err.strerror or err})") from None
    try:
        cur = _Cursor(path, buf, size)
        if bytes(buf[:4]) != b"GGUF":
            raise cur.fail("not a GGUF file (no GGUF magic)")
        cur.pos = 4
        version = cur.scalar("I", "version")
        if version not in (2, 3):
            big = struct.unpack(">I", struct.pack("<I", version))[0]
            kind = "a big-endian GGUF file, not read" if big in (2, 3) else f"GGUF version {version}"
            raise cur.fail(f"{kind} (little-endian versions 2 and 3 are read)")
        num_tensors, num_keys = cur.scalar("Q", "tensor count"), cur.scalar("Q", "metadata key count")
        if num_tensors * _MIN_TENSOR_BYTES + num_keys * _MIN_KEY_BYTES > size - cur.pos:
            raise cur.fail(
                f"GGUF header claims {num_tensors} tensors and {num_keys} metadata keys, more than the "
                f"file's {size} bytes can hold"
            )
        metadata: dict[str, Any] = {}
        for k in range(num_keys):
            key = cur.string(f"metadata key {k}")
            if key in metadata:
                raise cur.fail(f"GGUF metadata key {key!r} appears twice")
            metadata[key] = cur.value(cur.scalar("I", f"type of metadata {key!r}"), f"metadata {key!r}")
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise cur.fail(f"GGUF metadata 'general.alignment' must be a power of two, got {alignment!r}")
        entries, names = [], set()
        for k in range(num_tensors):
            name = cur.string(f"name of tensor {k}")
            if name in names:
                raise cur.fail(f"GGUF tensor {name!r} appears twice")
            n_dims = cur.scalar("I", f"dimension count of tensor {name!r}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise cur.fail(f"GGUF tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS} are valid)")
            dims = tuple(cur.scalar("Q", f"shape of tensor {name!r}") for _ in range(n_dims))
            type_id, offset = cur.scalar("I", f"type of {name!r}"), cur.scalar("Q", f"offset of {name!r}")
            entries.append((name, dims, type_id, offset))
            names.add(name)
        data_start = -(-cur.pos // alignment) * alignment
        tensors = {e[0]: _tensor_entry(path, *e, alignment, data_start, size) for e in entries}
        ordered = sorted(tensors.values(), key=lambda t: t.offset)
        for a, b in zip(ordered, ordered[1:], strict=False):
            if a.offset + a.nbytes > b.offset:
                raise cur.fail(
                    f"GGUF tensor {a.name!r} {list(a.shape)} {a.kind} ({a.nbytes} bytes at byte {a.offset}) "
                    f"overlaps tensor {b.name!r} (from byte {b.offset}): a shape or an offset is wrong"
                )
        return GGUFIndex(path, version, metadata, tensors, data_start, size)
    finally:
        buf.close()


def _tensor_entry(
    path: Path,
    name: str,
    dims: tuple[int, ...],
    type_id: int,
    offset: int,
    alignment: int,
    start: int,
    size: int,
) -> GGUFTensor:
    """One checked tensor entry (its bytes inside the file)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        kind = GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(f"{path}: GGUF tensor {name!r} has unknown type id {type_id}") from None
    if kind not in GGML_QUANT_SIZES:
        raise ValueError(f"{path}: GGUF tensor {name!r} has type {kind.name}, which has no block size")
    block, type_bytes = GGML_QUANT_SIZES[kind]
    shape = list(dims[::-1])
    if min(dims) < 1 or dims[0] % block:
        raise ValueError(
            f"{path}: GGUF tensor {name!r} of type {kind.name} has shape {shape}: every dimension must be "
            f">= 1 and the last a multiple of {block}"
        )
    if offset % alignment:
        raise ValueError(f"{path}: GGUF tensor {name!r} has offset {offset}, not a multiple of {alignment}")
    nbytes = int(np.prod(dims, dtype=object)) // block * type_bytes
    begin = start + offset
    if begin + nbytes > size:
        raise ValueError(
            f"{path}: GGUF tensor {name!r} {shape} {kind.name} needs bytes {begin}..{begin + nbytes}, "
            f"past the end of the file ({size} bytes): the file is truncated or the tensor's shape is wrong"
        )
    return GGUFTensor(name, tuple(int(d) for d in dims), kind.name, begin, nbytes)
