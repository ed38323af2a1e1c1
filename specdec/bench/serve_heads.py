"""The EAGLE-3 head ``llama-server:eagle3`` drafts with: ours, exported and converted to GGUF once.

:func:`prepare_eagle3_head` makes ``HEAD.gguf`` in a cache folder, in two steps:

1. export: the head file (``--llama-head``, default the shipped ``eagle3-smollm2-135m.safetensors``)
   written in vLLM's speculators format in float32, with the target's checkpoint folder as its
   verifier (``specdec export-head HEAD --format speculators --dtype float32 --verifier TARGET_DIR``;
   a speculators or SGLang head folder is taken as it is);
2. conversion: llama.cpp's own script, ``python convert_hf_to_gguf.py HEAD_DIR --target-model-dir
   TARGET_DIR --outfile HEAD.gguf --outtype f32`` (:func:`convert_command`). TARGET_DIR is the
   target's Hugging Face folder (:func:`specdec.targets.loading.resolve_checkpoint`: a GGUF target is
   converted once into our cache, with its ``config.json``, ``tokenizer.json`` and
   ``tokenizer_config.json``): the script reads the target's vocabulary size, layer count and hidden
   size from its ``config.json``, and writes the target's tokenizer into the head's GGUF.

The script is ``--llama-convert``, else ``$LLAMA_CONVERT``, else the ``convert_hf_to_gguf.py`` of the
llama.cpp tree ``llama-server`` was built from (:func:`find_converter`: a folder above the binary, or
the source folder its build's ``CMakeCache.txt`` names). It runs under this Python, which needs
``transformers`` and ``sentencepiece`` (the script imports it even for a ``tokenizer.json``); its own
``gguf-py`` comes from the tree. Whatever is missing is a ``ValueError`` naming it, before any server
starts. The cache folder (under :func:`specdec.targets.loading.cache_dir`, ``llama-heads/``) is keyed
by the head file, the target folder and the script (each path, size and modification time), so a
new head, target or llama.cpp tree converts again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "LLAMA_CONVERT_ENV",
    "CONVERTER",
    "DEFAULT_HEAD",
    "find_converter",
    "convert_command",
    "head_cache_dir",
    "prepare_eagle3_head",
    "prepare_heads",
]

LLAMA_CONVERT_ENV = "LLAMA_CONVERT"
"""The environment variable naming llama.cpp's ``convert_hf_to_gguf.py`` (``--llama-convert`` wins)."""
CONVERTER = "convert_hf_to_gguf.py"
DEFAULT_HEAD = "eagle3-smollm2-135m.safetensors"
"""The shipped exportable head (trained for ``smollm2-135m``)."""
CONVERTER_NEEDS = ("transformers", "sentencepiece")
"""Modules the script imports that a Python may lack (``torch`` and ``numpy`` come with ours)."""
_SEARCH_UP = 4


def _script_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise ValueError(f"{what}={str(path)!r} is not a file (expected llama.cpp's {CONVERTER})")
    return path


def find_converter(binary: Path | None, explicit: str | None = None) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py``: ``explicit`` (``--llama-convert``), else
    ``$LLAMA_CONVERT``, else the one in a folder up to four levels above ``binary`` (its symlinks
    resolved; an in-tree ``build/bin/``), else the one in the source folder that a ``CMakeCache.txt``
    in those folders names (an out-of-tree build). ``ValueError`` naming what was looked at."""
    if explicit:
        return _script_file(Path(explicit).expanduser(), "--llama-convert")
    named = os.environ.get(LLAMA_CONVERT_ENV)
    if named:
        return _script_file(Path(named).expanduser(), f"${LLAMA_CONVERT_ENV}")
    looked = []
    if binary is not None:
        for folder in list(Path(binary).resolve().parents)[:_SEARCH_UP]:
            candidates = [folder / CONVERTER]
            source = _cmake_source_dir(folder / "CMakeCache.txt")
            if source is not None:
                candidates.append(source / CONVERTER)
            for candidate in candidates:
                if candidate.is_file():
                    return candidate
            looked.append(str(folder))
    where = f" (none in {', '.join(looked)} or a source folder their CMakeCache.txt names)" if looked else ""
    raise ValueError(
        f"llama-server:eagle3 needs llama.cpp's {CONVERTER} to convert the head: give --llama-convert "
        f"PATH or set ${LLAMA_CONVERT_ENV}{where}; docs/serving.md shows where the llama.cpp tree is"
    )


def _cmake_source_dir(cache: Path) -> Path | None:
    """The source folder a CMake build folder's ``CMakeCache.txt`` names (``CMAKE_HOME_DIRECTORY``)."""
    try:
        text = cache.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.split(":")[0] == "CMAKE_HOME_DIRECTORY" and value:
            return Path(value.strip())
    return None


def convert_command(
    converter: Path, head_dir: Path, target_dir: Path, out: Path, *, python: str | None = None
) -> list[str]:
    """llama.cpp's conversion of a speculators / SGLang head folder to one GGUF file, in float32."""
    return [
        python or sys.executable, str(converter), str(head_dir), "--target-model-dir", str(target_dir),
        "--outfile", str(out), "--outtype", "f32",
    ]  # fmt: skip


def _stamp(path: Path) -> list:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def head_cache_dir(head: Path, target_dir: Path, converter: Path) -> Path:
    """``<cache>/llama-heads/<head stem>-<key>``, the key 16 hex digits of a SHA-256 of the head's,
    the target folder's ``config.json``'s and the script's path, size and modification time."""
    from specdec.targets.loading import cache_dir

    parts = [_stamp(head if head.is_file() else head / "config.json")]
    parts += [_stamp(target_dir / "config.json"), _stamp(converter)]
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
    return cache_dir() / "llama-heads" / f"{head.stem}-{key}"


def _check_target_dir(target_dir: Path) -> None:
    missing = [n for n in ("config.json", "tokenizer_config.json") if not (target_dir / n).is_file()]
    if not ((target_dir / "tokenizer.json").is_file() or (target_dir / "tokenizer.model").is_file()):
        missing.append("tokenizer.json")
    if missing:
        raise ValueError(
            f"{target_dir}: the target's folder lacks {', '.join(missing)}, which llama.cpp's {CONVERTER} "
            "reads (--target-model-dir)"
        )


def _check_head_target(head: Path, target: str) -> None:
    """A head file trained for another built-in target is refused (its features would not match)."""
    from specdec.drafters.eagle.weights import read_head_file
    from specdec.targets.loading import BUILTIN_MODELS

    if not head.is_file() or target not in BUILTIN_MODELS:
        return
    trained_for = read_head_file(head, tensors=False)[1].get("target")
    if trained_for and trained_for != target:
        raise ValueError(f"--llama-head {head.name} was trained for {trained_for!r}, not --target {target}")


def prepare_eagle3_head(
    target: str,
    *,
    converter: Path,
    head: str | None = None,
    python: str | None = None,
    say=None,
) -> Path:
    """The GGUF head for ``llama-server:eagle3`` (module doc), converted unless the cache holds it;
    ``ValueError`` for a missing module, head or target file, ``RuntimeError`` with the last lines
    of the script's log when it fails."""
    from specdec.drafters.eagle.weights import resolve_weights
    from specdec.targets.loading import resolve_checkpoint

    if python is None:
        missing = [m for m in CONVERTER_NEEDS if importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(
                f"llama.cpp's {CONVERTER} imports {', '.join(missing)}, which this Python lacks "
                f"(pip install {' '.join(missing)})"
            )
    head_path = resolve_weights(head or DEFAULT_HEAD)
    _check_head_target(head_path, target)
    target_dir = resolve_checkpoint(target)
    _check_target_dir(target_dir)
    folder = head_cache_dir(head_path, target_dir, converter)
    gguf = folder / "head.gguf"
    if gguf.is_file():
        return gguf
    folder.mkdir(parents=True, exist_ok=True)
    head_dir = head_path
    if head_path.is_file():
        import torch

        from specdec.drafters.eagle.formats import export_head_file

        head_dir = export_head_file(
            head_path, "speculators", folder / "speculators", dtype=torch.float32, verifier=str(target_dir)
        )
    partial = folder / "head.gguf.partial"
    command = convert_command(converter, head_dir, target_dir, partial, python=python)
    log = folder / "convert.log"
    if say is not None:
        say(f"llama-server:eagle3: converting {head_path.name} to GGUF: {' '.join(command)}")
    with open(log, "wb") as out:
        status = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if status != 0 or not partial.is_file():
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
        raise RuntimeError(
            f"{CONVERTER} failed (status {status}) converting {head_path} with --target-model-dir "
            f"{target_dir}; its log ({log}): {' | '.join(lines[-8:])}"
        )
    partial.rename(gguf)  # a half-written file is never picked up
    return gguf


def prepare_heads(
    specs: Sequence[Any],
    *,
    target: str,
    head: str | None = None,
    converter: str | None = None,
    say: Callable[[str], None] | None = None,
) -> dict[str, Path | str]:
    """``{server name: its converted head, or why it could not be made}`` for every
    ``llama-server:eagle3`` among ``specs`` that will run (one without a llama-server or a GGUF
    target is skipped later, and converts nothing). ``converter``: ``--llama-convert``. A missing
    script, module or file is a ``ValueError`` here, before any server starts; a failed conversion
    stops only that server."""
    from specdec.bench import serve_peers as peers

    heads: dict[str, Path | str] = {}
    for spec in specs:
        if (
            spec.kind != "llama-server"
            or spec.mode != "eagle3"
            or peers.llama_server_skipped(spec.name, target)
        ):
            continue
        script = find_converter(peers.find_llama_server(), converter)
        try:
            heads[spec.name] = made = prepare_eagle3_head(target, converter=script, head=head, say=say)
        except RuntimeError as err:
            heads[spec.name] = str(err)
        else:
            if say is not None:
                say(f"{spec.name}: head {made}")
    return heads
