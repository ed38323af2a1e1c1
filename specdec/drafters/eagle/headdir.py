"""What a speculators / SGLang head directory must hold, checked as it is read.

Legend: N draft vocabulary, V target vocabulary.

The contract (docs/formats.md): ``config.json`` beside the weights in :data:`WEIGHTS_FILE`, or in
the shards that :data:`WEIGHTS_INDEX` names (no other file is read); every weight tensor of the
format present, floating point, and of the shape ``config.json`` gives it (``lm_head`` has
``draft_vocab_size`` rows); ``d2t`` holds N integer offsets (``target_id = i + d2t[i]``) that map the
draft ids one-to-one into [0, V); ``t2d``, when present, is the bool ``[V]`` mask of exactly those
target ids. A break is a ``ValueError`` naming the folder, the file and the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.drafters.eagle.config import EagleConfig

__all__ = ["WEIGHTS_FILE", "WEIGHTS_INDEX", "read_weights", "check_shapes", "draft_vocab"]

WEIGHTS_FILE = "model.safetensors"
"""Where both formats keep a head's tensors (what our export writes)."""
WEIGHTS_INDEX = "model.safetensors.index.json"
"""Else: the Hugging Face shard index, whose ``weight_map`` names each tensor's shard file."""

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json")


def read_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, str]]:
    """A head directory's tensors (a ``model.`` prefix dropped), metadata, and each tensor's file,
    from exactly the files the formats name: :data:`WEIGHTS_FILE`, else the shards that
    :data:`WEIGHTS_INDEX` maps each tensor to (only the tensors it maps). No other file is read, so
    a stray old ``*.safetensors`` beside them changes nothing."""
    from specdec.drafters.eagle.weights import read_head_file

    if (path / WEIGHTS_FILE).is_file():
        tensors, meta = read_head_file(path / WEIGHTS_FILE)
        state = _drop_prefix(tensors, path / WEIGHTS_FILE)
        return state, meta, dict.fromkeys(state, WEIGHTS_FILE)
    index = path / WEIGHTS_INDEX
    if not index.is_file():
        present = sorted(f.name for f in path.iterdir() if f.suffix in _WEIGHT_SUFFIXES)
        present = [name for name in present if name != "config.json"]
        found = f"; it holds {present}, which the format does not read" if present else ""
        raise ValueError(
            f"head directory {path}: no {WEIGHTS_FILE} (nor {WEIGHTS_INDEX} naming its shards), where "
            f"the speculators and SGLang formats keep the weights{found}"
        )
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as err:
        raise ValueError(f"{index}: expected a JSON object with a 'weight_map' ({err})") from None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(v, str) for v in weight_map.values())
    ):
        raise ValueError(f"{index}: expected a non-empty 'weight_map' of tensor name -> shard file name")
    state: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {}
    source: dict[str, str] = {}
    for shard in sorted(set(weight_map.values())):
        names = [k for k, v in weight_map.items() if v == shard]
        if shard in ("", ".", "..") or Path(shard).name != shard or not (path / shard).is_file():
            raise ValueError(
                f"{index}: shard {shard!r} (of tensor {names[0]!r}) is not a file in {path}; expected "
                "the name of a .safetensors file beside the index"
            )
        tensors, m = read_head_file(path / shard)
        missing = [k for k in names if k not in tensors]
        if missing:
            raise ValueError(f"{index} maps tensor {missing[0]!r} to {shard}, which does not hold it")
        picked = _drop_prefix({k: tensors[k] for k in names}, path / shard)
        twice = sorted(set(picked) & set(state))
        if twice:
            raise ValueError(f"{index}: tensor {twice[0]!r} appears twice (with and without 'model.')")
        state.update(picked)
        meta.update(m)
        source.update(dict.fromkeys(picked, shard))
    return state, meta, source


def _drop_prefix(tensors: dict[str, torch.Tensor], file: Path) -> dict[str, torch.Tensor]:
    """``tensors`` with a leading ``model.`` dropped from their names; ``ValueError`` on a clash."""
    state = {k.removeprefix("model."): v for k, v in tensors.items()}
    if len(state) != len(tensors):
        clash = next(k for k in tensors if k.startswith("model.") and k.removeprefix("model.") in tensors)
        raise ValueError(f"{file}: tensor {clash!r} appears twice (with and without 'model.')")
    return state


def check_shapes(
    state: dict[str, torch.Tensor],
    source: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
    config: EagleConfig,
    path: Path,
) -> None:
    """Each weight tensor named in ``shapes`` present in ``state``, floating point and of that
    shape; ``ValueError`` naming the folder, the file, the tensor, its shape and the expected one
    (for ``lm_head.weight``'s rows: ``config.json``'s ``draft_vocab_size`` and both sizes)."""
    missing = [k for k in shapes if k not in state]
    if missing:
        files = ", ".join(sorted(set(source.values())) or [WEIGHTS_FILE])
        raise ValueError(f"head {path}: {files} lacks the format's tensor(s) {missing}")
    lm_head = state.get("lm_head.weight")
    if lm_head is not None and lm_head.dim() == 2 and lm_head.shape[0] != config.draft_vocab_size:
        raise ValueError(
            f"head {path}: config.json gives draft_vocab_size {config.draft_vocab_size}, but "
            f"lm_head.weight in {source['lm_head.weight']} has {lm_head.shape[0]} rows (one per draft token)"
        )
    for name, want in shapes.items():
        t = state[name]
        if not t.dtype.is_floating_point:
            raise ValueError(f"head {path}: {name} in {source[name]} is {t.dtype}; expected floating point")
        if tuple(t.shape) != want:
            raise ValueError(
                f"head {path}: {name} in {source[name]} has shape {list(t.shape)}; config.json gives "
                f"{list(want)}"
            )


def draft_vocab(
    state: dict[str, torch.Tensor], source: dict[str, str], config: EagleConfig, path: Path
) -> torch.Tensor:
    """The target id of each draft id ``[N]``: ``i + d2t[i]`` (no ``d2t``: the identity, as vLLM and
    SGLang read it), after checking ``d2t`` and ``t2d`` against the contract (module doc);
    ``ValueError`` naming the folder, the file, the tensor and what was expected."""
    N, V = config.draft_vocab_size, config.vocab_size
    offsets_N = state.get("d2t")
    if offsets_N is None:
        vocab_N = torch.arange(N)
    else:
        where = f"head {path}: d2t in {source['d2t']}"
        if offsets_N.dtype.is_floating_point or offsets_N.dtype.is_complex or offsets_N.dtype == torch.bool:
            raise ValueError(
                f"{where} is {offsets_N.dtype}; expected integer offsets (target id = i + d2t[i])"
            )
        if tuple(offsets_N.shape) != (N,):
            raise ValueError(
                f"{where} has shape {list(offsets_N.shape)}; expected [{N}], one offset per draft id "
                f"(config.json draft_vocab_size {N})"
            )
        vocab_N = torch.arange(N) + offsets_N.to(torch.long)
        outside = torch.nonzero((vocab_N < 0) | (vocab_N >= V)).flatten()
        if outside.numel():
            i = int(outside[0])
            raise ValueError(
                f"{where} maps draft id {i} to target id {int(vocab_N[i])} (d2t[{i}] = {int(offsets_N[i])}), "
                f"outside the target vocabulary [0, {V}) ({outside.numel()} such ids)"
            )
        sorted_N = torch.sort(vocab_N).values
        repeated = torch.nonzero(sorted_N[1:] == sorted_N[:-1]).flatten()
        if repeated.numel():
            t = int(sorted_N[repeated[0]])
            ids = torch.nonzero(vocab_N == t).flatten().tolist()
            raise ValueError(
                f"{where} maps draft ids {ids} all to target id {t}; expected a one-to-one map "
                f"({torch.unique(vocab_N).numel()} distinct target ids for {N} draft ids)"
            )
    mask_V = state.get("t2d")
    if mask_V is not None:
        where = f"head {path}: t2d in {source['t2d']}"
        if mask_V.dtype != torch.bool or tuple(mask_V.shape) != (V,):
            raise ValueError(
                f"{where} is {mask_V.dtype} {list(mask_V.shape)}; expected a bool mask [{V}] over the "
                "target vocabulary (vocab_size in config.json)"
            )
        want_V = torch.zeros(V, dtype=torch.bool)
        want_V[vocab_N] = True
        differ = torch.nonzero(mask_V != want_V).flatten()
        if differ.numel():
            t = int(differ[0])
            said = "maps a draft id to it" if bool(want_V[t]) else "maps no draft id to it"
            raise ValueError(
                f"{where} disagrees with d2t at {differ.numel()} target ids, first {t}: t2d marks it "
                f"{bool(mask_V[t])}, d2t {said} (t2d marks {int(mask_V.sum())} ids, d2t maps {N})"
            )
    return vocab_N
