"""Offline byte corpora for the tiny language models: local text files only, split by file.

Legend: B sequences, S sequence length.

A corpus in :data:`CORPORA` lists files already on the machine (nothing is downloaded); every
``heldout_every``-th file in sorted order is held out, so held-out text comes from files the model never
saw. ``stdlib`` (the top-level modules of this Python's standard library) is fixed for a given Python
version; ``repo`` (this checkout's docs and sources) changes with the checkout.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specdec.registry import Registry

__all__ = [
    "CORPORA",
    "Corpus",
    "load_corpus",
    "sample_batch",
    "heldout_windows",
    "stdlib_files",
    "repo_files",
]


def stdlib_files() -> list[Path]:
    """The top-level modules of this Python's standard library (``<stdlib>/*.py``), sorted."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def repo_files() -> list[Path]:
    """This repository's docs and MoE/kernels/experiments sources (changes with the checkout), sorted."""
    root = Path(__file__).resolve().parents[1]
    patterns = ("docs/*.md", "README.md", "moe/*.py", "kernels/**/*.py", "experiments/*.py")
    return sorted({p for pattern in patterns for p in root.glob(pattern) if p.is_file()})


CORPORA = Registry(
    "corpus",
    "specdec.corpora",
    builtins={
        "stdlib": "experiments.text_corpus:stdlib_files",
        "repo": "experiments.text_corpus:repo_files",
    },
)
"""Name -> ``fn() -> sorted list of text files`` (local files only)."""


@dataclass(frozen=True)
class Corpus:
    """Training and held-out bytes (uint8 tensors) and where they came from."""

    train: Tensor
    heldout: Tensor
    info: dict[str, Any]


def load_corpus(name: str, *, heldout_every: int = 10, max_bytes: int = 0) -> Corpus:
    """Read corpus ``name``; every ``heldout_every``-th file is held out; ``max_bytes`` > 0 caps a split."""
    files = CORPORA.get(name)()
    if len(files) < heldout_every:
        raise ValueError(f"corpus {name!r} has {len(files)} files, fewer than heldout_every={heldout_every}")
    splits: dict[str, bytearray] = {"train": bytearray(), "heldout": bytearray()}
    for i, path in enumerate(files):
        part = splits["heldout" if i % heldout_every == heldout_every - 1 else "train"]
        if not max_bytes or len(part) < max_bytes:
            part += path.read_bytes() + b"\n"
    data = {k: bytes(v[:max_bytes] if max_bytes else v) for k, v in splits.items()}
    for split, raw in data.items():
        if len(raw) < 4096:
            raise ValueError(f"corpus {name!r}: only {len(raw)} {split} bytes (need >= 4096)")
    digest = hashlib.sha256(data["train"] + b"\0" + data["heldout"]).hexdigest()[:16]
    info = {"corpus": name, "files": len(files), "sha256_16": digest}
    info |= {f"{split}_bytes": len(raw) for split, raw in data.items()}
    tensors = {k: torch.frombuffer(bytearray(v), dtype=torch.uint8) for k, v in data.items()}
    return Corpus(train=tensors["train"], heldout=tensors["heldout"], info=info)


def sample_batch(data: Tensor, batch: int, seq_len: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(inputs, targets) [B, S] int64: random windows of ``data``."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=generator)
    windows_BX = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return windows_BX[:, :-1], windows_BX[:, 1:]


def heldout_windows(data: Tensor, count: int, seq_len: int) -> Tensor:
    """``count`` evenly spaced windows of S + 1 bytes of ``data`` -> [count, S + 1] int64."""
    starts = torch.linspace(0, data.numel() - seq_len - 1, count).long()
    return torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
