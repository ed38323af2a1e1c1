"""The data cache: the target's features over the training text, on disk and in memory.

Legend: S sequences, N tokens, D hidden size, A aux layers, k top-k.

:func:`build_dataset` makes it in two stages, each resumable: the target's continuations of every
prompt source (:mod:`.sources`, one JSON file per job), then every sequence run through the target
once (:mod:`.features`): per token the feature (fp16) and the target's top-k next-token
probabilities. The cache is written in shards of 64 sequences with a manifest, so an interrupted
run resumes where it stopped. Shards are content-addressed (``shards/<target>-<hash of names and
tokens>``), shared by every config whose sequences they hold: a config that adds a source extracts
features for the new sequences only (new sources come after the old ones in the sequence order).
Aux-layer features (EAGLE-3) sit beside each shard (:func:`aux_shard_name`).
:func:`load_dataset` reads a finished cache into one :class:`FeatureData`.

Layout under ``~/.cache/specdec/eagle-data/`` (``docs/caches.md``): ``<target>-<DataConfig key>/``
(``config.json``, ``manifest.json``), ``shards/``, and the continuation files beside them.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.drafters.eagle.train.config import DataConfig
from specdec.drafters.eagle.train.features import extract_features, extract_layer_features
from specdec.drafters.eagle.train.sources import (
    LESSON_PREFIX,
    Prompt,
    function_prompts,
    generate_continuations,
    load_prompts,
    repeat_sequences,
    self_instruct_prompts,
    self_instruct_requests,
    text_sequences,
)
from specdec.prompt_sets import has_chat_template

__all__ = [
    "FeatureData",
    "aux_shard_name",
    "build_aux_features",
    "build_dataset",
    "dataset_dir",
    "load_dataset",
    "shard_key",
    "target_cache_name",
    "write_atomically",
]


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, then rename it to ``path``: a file at
    ``path`` is always whole (an interrupted run leaves no half-written shard or checkpoint)."""
    tmp = path.with_suffix(".tmp")
    write(tmp)
    tmp.replace(path)


def _write_json(path: Path, obj) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(obj)))


def _save_shard(path: Path, tensors: dict[str, torch.Tensor], **metadata: str) -> None:
    """``tensors`` as a safetensors file at ``path`` (written atomically) with ``metadata``."""
    from safetensors.torch import save_file

    write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def _finished_manifest(path: Path) -> dict:
    """The manifest of the finished cache at ``path``; ``ValueError`` while it is incomplete."""
    manifest = json.loads((path / "manifest.json").read_text())
    if not manifest.get("complete"):
        raise ValueError(f"dataset {path} is incomplete; run build_dataset first")
    return manifest


def aux_shard_name(shard: str, layers: tuple[int, ...]) -> str:
    """The file beside a feature shard that holds its tokens' layer-``layers`` features."""
    return shard.removesuffix(".safetensors") + "-aux-" + "-".join(f"l{i}" for i in layers) + ".safetensors"


def _write_aux(out: Path, aux_NAD: torch.Tensor, layers: tuple[int, ...]) -> None:
    """Write one shard's layer features (fp16 ``[N, A, D]``) atomically beside the shard."""
    if float(aux_NAD.float().abs().max()) > 6e4:
        raise ValueError("layer features overflow fp16")
    _save_shard(out, {"aux": aux_NAD}, layers=json.dumps(list(layers)))


def build_aux_features(path: Path, layers: tuple[int, ...], log=print) -> None:
    """Add the outputs of decoder layers ``layers`` to a finished cache, shard by shard (a shard's
    aux file is skipped when present, so an interrupted run resumes; :func:`build_dataset` with
    ``aux_layers`` writes them with the shards it extracts, leaving this only the shards it reused)."""
    from safetensors.torch import load_file

    from specdec.targets.loading import load_hf_model

    manifest = _finished_manifest(path)
    todo = [s for s in manifest["shards"] if not (path / aux_shard_name(s, layers)).exists()]
    if not todo:
        return
    config = json.loads((path / "config.json").read_text())
    model = load_hf_model(config["target"])
    log(f"[data] layer {list(layers)} features for {len(todo)} of {len(manifest['shards'])} shards")
    t0 = time.perf_counter()
    for n, shard in enumerate(todo, start=1):
        t = load_file(str(path / shard))
        seqs = [s.tolist() for s in torch.split(t["tokens"].long(), t["lengths"].tolist())]
        aux = torch.cat(extract_layer_features(model, seqs, layers))
        _write_aux(path / aux_shard_name(shard, layers), aux, layers)
        log(f"  layer features: {n}/{len(todo)} shards, {time.perf_counter() - t0:.0f}s")


@dataclass
class FeatureData:
    """The whole cache in memory: flat per-token arrays and per-sequence offsets."""

    tokens: torch.Tensor  # [N] int64
    features: torch.Tensor  # [N, D] fp16
    topk_ids: torch.Tensor  # [N, k] int64
    topk_probs: torch.Tensor  # [N, k] fp16
    offsets: torch.Tensor  # [S+1] int64
    heldout: torch.Tensor  # [S] bool
    names: list[str]
    aux: torch.Tensor | None = None  # [N, A, D] fp16: outputs of the cache's aux layers (EAGLE-3)

    @classmethod
    def join(
        cls,
        *,
        tokens: torch.Tensor,
        features: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_probs: torch.Tensor,
        lengths: torch.Tensor,
        heldout: torch.Tensor,
        names: list[str],
        aux: torch.Tensor | None = None,
    ) -> FeatureData:
        """Sequences of ``lengths`` tokens laid end to end in the per-token arrays (a shard's layout)
        as one :class:`FeatureData`: token ids as int64, the offsets from the lengths."""
        lengths = lengths.to(torch.int64)
        return cls(
            tokens=tokens.long(),
            features=features,
            topk_ids=topk_ids.long(),
            topk_probs=topk_probs,
            offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
            heldout=heldout,
            names=names,
            aux=aux,
        )

    def span(self, s: int) -> tuple[int, int]:
        """Sequence ``s``'s tokens: ``[a, b)`` in the per-token arrays."""
        return int(self.offsets[s]), int(self.offsets[s + 1])

    def sequences(self, heldout: bool) -> list[int]:
        """The sequences of one split (held out or training), in cache order."""
        return [i for i in range(len(self.names)) if bool(self.heldout[i]) == heldout]

    def natural(self, heldout: bool) -> list[int]:
        """:meth:`sequences` without the copy lessons: the text the target reads in real use."""
        return [i for i in self.sequences(heldout) if not self.names[i].startswith(LESSON_PREFIX)]


def target_cache_name(target: str) -> str:
    """The name a target's cache files carry: a built-in model name as it is; a checkpoint
    directory or GGUF file as its name and a hash of its absolute path, its ``config.json`` and its
    weight files' names, sizes and modification times (another checkpoint written to the same path
    gets a cache of its own; nothing is read from the weights)."""
    from specdec.targets.loading import BUILTIN_MODELS

    if target in BUILTIN_MODELS:
        return target
    path = Path(target).expanduser().resolve()
    if not path.exists():
        raise ValueError(f"DataConfig.target: {target!r} is neither a built-in model name nor a path")
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    h = hashlib.sha1(str(path).encode())
    for f in files:
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.suffix in (".safetensors", ".bin", ".gguf", ".pt"):
            st = f.stat()
            h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return f"{path.stem}-{h.hexdigest()[:8]}"


def dataset_dir(cfg: DataConfig, root: Path | None = None) -> Path:
    """The cache directory of ``cfg``: ``<root>/<target>-<cfg.key()>`` (``root`` by default
    ``~/.cache/specdec/eagle-data``)."""
    from specdec.targets.loading import cache_dir

    return (root or cache_dir() / "eagle-data") / f"{target_cache_name(cfg.target)}-{cfg.key()}"


def shard_key(target: str, topk: int, chunk: list[tuple[str, bool, list[int]]]) -> str:
    """Content address of a feature shard: the target, k, and every sequence's name, split and tokens
    (features are a function of these alone)."""
    h = hashlib.sha1(f"{target}|{topk}".encode())
    for name, held, ids in chunk:
        h.update(json.dumps([name, bool(held), list(ids)]).encode())
    return f"{target}-{h.hexdigest()[:16]}"


def _continued(
    prompts: list[Prompt], conts: dict[str, dict[str, list[list[int]]]]
) -> list[tuple[str, bool, list[int]]]:
    """(name, held out, prompt + continuation) for every continuation of every prompt, in the jobs'
    order; a prompt without continuations (held out) is its prompt alone."""
    seqs = []
    for p in prompts:
        have = [name for name in conts if p.pid in conts[name]]
        for name in have:
            for j, cont in enumerate(conts[name][p.pid]):
                seqs.append((f"{p.pid}/{name}{j}", p.heldout, list(p.ids) + cont))
        if not have:
            seqs.append((p.pid, p.heldout, list(p.ids)))
    return seqs


def build_dataset(
    cfg: DataConfig, root: Path | None = None, log=print, aux_layers: tuple[int, ...] = ()
) -> Path:
    """Generate continuations and features (skipping stages already cached); returns the directory.

    ``aux_layers``: also write the outputs of these decoder layers beside every shard this call
    extracts (:func:`aux_shard_name`), from the same forward as its features, so an empty cache
    needs no second pass (:func:`build_aux_features` still adds them to reused shards)."""
    from specdec.targets.loading import load_hf_model, load_tokenizer

    out = dataset_dir(cfg, root)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    if manifest_path.exists() and json.loads(manifest_path.read_text()).get("complete"):
        log(f"[data] cached: {out}")
        return out
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    tokenizer = load_tokenizer(cfg.target)
    prompts = load_prompts(tokenizer)
    log(f"[data] {len(prompts)} prompts ({sum(p.heldout for p in prompts)} held out) -> {out}")
    (bench, functions, requests), conts = _continuations(cfg, out, tokenizer, prompts, log)
    # Sources added later come last, so the shards of older configs stay the same and are shared.
    seqs = _continued(bench + functions, conts) + text_sequences(tokenizer, cfg) + _continued(requests, conts)
    if cfg.repeat_sequences:
        seqs += repeat_sequences(
            tokenizer, seqs, cfg.repeat_sequences, length=cfg.repeat_length, seed=cfg.seed
        )
        log(f"[data] {cfg.repeat_sequences} copy lessons of {cfg.repeat_length} tokens")
    total = sum(len(s) for _, _, s in seqs)
    log(f"[data] {len(seqs)} sequences, {total} tokens; features in shards")
    shards = _feature_shards(cfg, out, load_hf_model(cfg.target), seqs, aux_layers, log)
    _write_json(manifest_path, {"shards": shards, "complete": True, "num_tokens": total})
    return out


def _continuations(
    cfg: DataConfig, out: Path, tokenizer, prompts: list[Prompt], log
) -> tuple[list[list[Prompt]], dict[str, dict[str, list[list[int]]]]]:
    """Stage 1: the target's continuations of every prompt source, each job cached in its own JSON
    file beside the config directories (configs that share a job generate it once). Returns the
    prompt sources (benchmark prompts, function prompts, self-instructed requests) and the
    continuations by job name and prompt id."""
    from specdec.targets import load_target
    from specdec.targets.loading import gguf_source

    # A GGUF model makes its data with float activations (``gguf``: transformers' output on every
    # machine), not with the machine's default format (``gguf-q8`` where integer dot products run),
    # so the cache, keyed by the target's name, holds the same data whichever machine made it.
    target = load_target(cfg.target, **({"weights": "gguf"} if gguf_source(cfg.target) else {}))
    tname = target_cache_name(cfg.target)
    fn_prompts = function_prompts(tokenizer, cfg.function_prompts, cfg.seed) if cfg.function_prompts else []
    if fn_prompts:
        functions = sum(p.kind == "code" for p in fn_prompts)
        log(f"[data] {len(fn_prompts)} prompts from {functions} standard-library functions")
    trained = [p for p in prompts if not p.heldout]
    jobs = [("greedy", 0.0, cfg.greedy_tokens, 1, prompts if cfg.heldout_continuations else trained)]
    if fn_prompts:
        jobs.append(("functions", 0.0, cfg.greedy_tokens, 1, fn_prompts))
    if cfg.sample_tokens > 0 and cfg.sample_continuations > 0:
        jobs.append(("sample", cfg.sample_temperature, cfg.sample_tokens, cfg.sample_continuations, trained))
    self_prompts: list[Prompt] = []
    if cfg.self_instruct > 0 and not has_chat_template(tokenizer):
        log("[data] self-instruct: skipped, the target's tokenizer has no chat template")
    elif cfg.self_instruct > 0:
        req_path = (
            out.parent
            / f"{tname}-self-instruct-n{cfg.self_instruct}-t{cfg.self_instruct_tokens}-s{cfg.seed}.json"
        )
        if req_path.exists():
            requests = json.loads(req_path.read_text())
        else:
            log(f"[data] self-instruct: sampling {cfg.self_instruct} user requests from the target")
            requests = self_instruct_requests(
                target,
                cfg.self_instruct,
                max_tokens=cfg.self_instruct_tokens,
                seed=cfg.seed,
                batch_size=cfg.gen_batch_size,
                log=log,
            )
            _write_json(req_path, requests)
        self_prompts = self_instruct_prompts(tokenizer, requests)
        log(f"[data] self-instruct: {len(requests)} requests -> {len(self_prompts)} prompts")
        jobs.append(("self-greedy", 0.0, cfg.greedy_tokens, 1, self_prompts))
        if cfg.sample_tokens > 0:
            jobs.append(("self-sample", cfg.sample_temperature, cfg.sample_tokens, 1, self_prompts))
    conts: dict[str, dict[str, list[list[int]]]] = {}
    for name, temp, n, k, ps in jobs:
        key = hashlib.sha1(json.dumps([p.ids for p in ps]).encode()).hexdigest()[:8]
        cont_path = out.parent / f"{tname}-specdec-{name}-T{temp:g}-n{n}x{k}-s{cfg.seed}-{key}.json"
        if cont_path.exists():
            conts[name] = json.loads(cont_path.read_text())
            continue
        log(f"[data] {name}: {k} continuation(s) of {len(ps)} prompts, {n} new tokens each")
        gen = generate_continuations(
            target,
            ps,
            max_new_tokens=n,
            temperature=temp,
            num_samples=k,
            batch_size=cfg.gen_batch_size,
            seed=cfg.seed,
            log=log,
        )
        conts[name] = {p.pid: g for p, g in zip(ps, gen, strict=True)}
        _write_json(cont_path, conts[name])
    return [prompts, fn_prompts, self_prompts], conts


def _feature_shards(
    cfg: DataConfig, out: Path, model, seqs: list, aux_layers: tuple[int, ...], log
) -> list[str]:
    """Stage 2: features and top-k of every sequence, in content-addressed shards of 64 sequences
    (a shard already on disk is reused); returns the shard names in sequence order."""
    shard_size, shards, reused = 64, [], 0
    tname = target_cache_name(cfg.target)
    t0 = time.perf_counter()
    (out.parent / "shards").mkdir(exist_ok=True)
    for start in range(0, len(seqs), shard_size):
        chunk = seqs[start : start + shard_size]
        name = f"../shards/{shard_key(tname, cfg.topk, chunk)}.safetensors"
        shards.append(name)
        if (out / name).exists():
            reused += 1
            continue
        feats, ids, probs, aux = extract_features(
            model, [s for _, _, s in chunk], cfg.topk, aux_layers=aux_layers
        )
        if max(float(f.float().abs().max()) for f in feats) > 6e4:
            raise ValueError("features overflow fp16; store them as bf16 instead")
        if aux is not None:  # before the shard: a shard on disk means its work is done
            _write_aux(out / aux_shard_name(name, aux_layers), torch.cat(aux), aux_layers)
        tensors = {
            "tokens": torch.tensor([t for _, _, s in chunk for t in s], dtype=torch.int32),
            "features": torch.cat(feats),
            "topk_ids": torch.cat(ids),
            "topk_probs": torch.cat(probs),
            "lengths": torch.tensor([len(s) for _, _, s in chunk], dtype=torch.int64),
            "heldout": torch.tensor([h for _, h, _ in chunk], dtype=torch.bool),
        }
        _save_shard(out / name, tensors, names=json.dumps([n for n, _, _ in chunk]))
        done = min(start + shard_size, len(seqs))
        log(f"  features: {done}/{len(seqs)} sequences, {time.perf_counter() - t0:.0f}s")
    if reused:
        log(f"[data] {reused} of {len(shards)} shards were already in {out.parent / 'shards'}")
    return shards


def load_dataset(path: Path, aux_layers: tuple[int, ...] = ()) -> FeatureData:
    """Read every shard of a finished cache into one :class:`FeatureData` (with the outputs of
    decoder layers ``aux_layers``, which :func:`build_aux_features` must have added)."""
    from safetensors import safe_open

    manifest = _finished_manifest(path)
    parts: dict[str, list] = {
        k: [] for k in ("tokens", "features", "topk_ids", "topk_probs", "lengths", "heldout")
    }
    names: list[str] = []
    for shard in manifest["shards"]:
        with safe_open(str(path / shard), framework="pt") as f:
            for k in parts:
                parts[k].append(f.get_tensor(k))
            names += json.loads(f.metadata()["names"])
    aux = None
    if aux_layers:
        files = [path / aux_shard_name(shard, aux_layers) for shard in manifest["shards"]]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ValueError(
                f"dataset {path} lacks layer {list(aux_layers)} features; run build_aux_features"
            )
        aux_parts = []
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                aux_parts.append(f.get_tensor("aux"))
        aux = torch.cat(aux_parts)
    return FeatureData.join(**{k: torch.cat(v) for k, v in parts.items()}, names=names, aux=aux)
