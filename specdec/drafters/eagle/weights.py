"""Head files: safetensors with the trainable weights (bf16), the draft vocabulary and metadata.

A head file holds ``fc.*``, ``fc_aux.*`` (EAGLE-3), the layer (``qkv_proj``, ``o_proj``,
``post_norm``, ``gate_up_proj``, ``down_proj``) and ``draft_vocab_N`` (int64, most frequent first);
its metadata holds ``config`` (:class:`EagleConfig` as JSON), ``target`` (a name) and
``target_fingerprint`` (so weights never run silently against another target), and ``extra`` (the
training summary). Files are read with ``safetensors`` only: nothing is unpickled.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from specdec.drafters.eagle.config import EagleConfig
from specdec.drafters.eagle.eagle3 import Eagle3Head
from specdec.drafters.eagle.model import EagleHead
from specdec.drafters.eagle.packed import PackedEagleHead
from specdec.protocols import TargetParts

__all__ = [
    "DEFAULT_WEIGHTS",
    "fingerprint",
    "target_mismatch",
    "read_head_file",
    "resolve_weights",
    "load_eagle_head",
    "save_eagle_head",
    "stored_draft_vocab",
    "weight_dtype_of",
    "load_packed_head",
    "head_class",
    "read_head_config",
    "build_head",
]

DEFAULT_WEIGHTS = "eagle-smollm2-135m.safetensors"
"""The shipped head for ``smollm2-135m`` (in ``specdec/weights/``)."""


def fingerprint(embed_VD: torch.Tensor) -> str:
    """A cheap check that weights meet the target they were trained for."""
    return f"{float(embed_VD[:256].double().abs().sum()):.4f}"


FINGERPRINT_RTOL = 1e-4
"""How far a target's fingerprint may sit from the one a head was made for, relative to it: the same
target with its embedding stored in bfloat16 or float16 (rounded once) moves it by ~3e-6 (SmolLM2:
14150.4129 -> 14150.3767); another model's embedding moves it far more."""


def target_mismatch(meta: dict, embed_VD: torch.Tensor, path: Path) -> str | None:
    """Why head weights with metadata ``meta`` (read from ``path``) do not fit the target whose
    embedding is ``embed_VD``; None when they do (or carry no fingerprint). A target whose embedding
    is stored in a half dtype fits the head made for its float32 one (:data:`FINGERPRINT_RTOL`)."""
    want = meta.get("target_fingerprint")
    if want and abs(float(want) - float(fingerprint(embed_VD))) > FINGERPRINT_RTOL * abs(float(want)):
        return (
            f"weights {path.name} were trained for target {meta.get('target')!r}, not this target "
            "(its embedding differs)"
        )
    return None


def head_class(config: EagleConfig) -> type[EagleHead] | type[Eagle3Head]:
    """The module of a head's layout: :class:`EagleHead` (``"specdec"``) or :class:`Eagle3Head`."""
    return Eagle3Head if config.layout == "eagle3" else EagleHead


def resolve_weights(weights: str | Path | None) -> Path:
    """A head-weights path: a file, a speculators / SGLang head directory
    (:mod:`specdec.drafters.eagle.formats`), or the name of a file shipped in ``specdec/weights/``
    (None: the default head)."""
    if weights is None:
        weights = DEFAULT_WEIGHTS
    path = Path(weights)
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return path
    shipped = resources.files("specdec") / "weights" / str(weights)
    if shipped.is_file():
        return Path(str(shipped))
    if path.is_dir():
        from specdec.drafters.eagle.headdir import WEIGHTS_FILE, WEIGHTS_INDEX

        raise ValueError(
            f"weights {str(weights)!r}: the folder has no config.json; a head folder (vLLM's speculators "
            f"or SGLang's format, docs/formats.md) holds config.json and {WEIGHTS_FILE} (or "
            f"{WEIGHTS_INDEX} and its shards)"
        )
    raise ValueError(
        f"weights {str(weights)!r}: no such file, and not a shipped file in specdec/weights/ "
        "(train one with: specdec train-head)"
    )


def read_head_file(path: Path, *, tensors: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A head file's tensors (unless ``tensors=False``) and metadata; ``ValueError`` naming the file
    when it is not a readable safetensors file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()} if tensors else {}
    except (SafetensorError, OSError, RuntimeError) as err:
        raise ValueError(f"head file {path}: not a readable safetensors file ({err})") from None
    return state, meta


def read_head_config(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], EagleConfig]:
    """A head file's tensors, metadata and :class:`EagleConfig`; ``ValueError`` naming the file when
    its config metadata is missing or invalid."""
    state, meta = read_head_file(path)
    if "config" not in meta:
        raise ValueError(f"head file {path} carries no EAGLE config metadata (not a draft head file?)")
    try:
        config = EagleConfig.from_json(json.loads(meta["config"]))
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise ValueError(
            f"head file {path}: its config metadata is not a valid EagleConfig ({err})"
        ) from None
    return state, meta, config


def build_head(config: EagleConfig, state: dict[str, torch.Tensor], path: Path) -> EagleHead | Eagle3Head:
    """The (unattached, float32) module of ``config``'s layout holding a head file's tensors, its
    ``draft_vocab_N`` in stored order (most frequent first); ``ValueError`` naming ``path`` when they
    do not fit the config."""
    head = head_class(config)(config)
    if "draft_vocab_N" not in state:
        raise ValueError(f"head file {path} has no draft_vocab_N tensor")
    _check_draft_vocab(state["draft_vocab_N"], config, path)
    try:
        head.load_state_dict({**state, "draft_vocab_N": state["draft_vocab_N"].to(torch.long)}, strict=True)
    except RuntimeError as err:  # missing / unexpected keys, or shapes that do not fit the config
        detail = " ".join(line.strip() for line in str(err).splitlines()[1:])[:500]
        raise ValueError(f"head file {path} does not fit its own config: {detail}") from None
    return head


def _check_draft_vocab(vocab_N: torch.Tensor, config: EagleConfig, path: Path) -> None:
    """A head file's ``draft_vocab_N``: ``draft_vocab_size`` distinct integer ids in [0,
    ``vocab_size``); ``ValueError`` naming the file, the field and both sizes otherwise."""
    N, V = config.draft_vocab_size, config.vocab_size
    if vocab_N.dtype.is_floating_point or vocab_N.dtype.is_complex or vocab_N.dtype == torch.bool:
        raise ValueError(f"head file {path}: draft_vocab_N is {vocab_N.dtype}; expected integer token ids")
    if vocab_N.dim() != 1 or vocab_N.numel() != N:
        raise ValueError(
            f"head file {path}: its config's draft_vocab_size is {N}, but draft_vocab_N has shape "
            f"{list(vocab_N.shape)} (expected [{N}])"
        )
    vocab_N = vocab_N.to(torch.long)
    if int(vocab_N.min()) < 0 or int(vocab_N.max()) >= V:
        raise ValueError(
            f"head file {path}: draft_vocab_N holds ids outside the target vocabulary [0, {V}) "
            f"(min {int(vocab_N.min())}, max {int(vocab_N.max())})"
        )
    if torch.unique(vocab_N).numel() != N:
        raise ValueError(
            f"head file {path}: draft_vocab_N repeats token ids ({torch.unique(vocab_N).numel()} "
            f"distinct of {N}); expected each id once"
        )


def stored_draft_vocab(weights: str | Path | None) -> torch.Tensor:
    """The draft vocabulary ``[N]`` of head weights in stored order (most frequent first)."""
    state, _ = read_head_file(resolve_weights(weights))
    if "draft_vocab_N" not in state:
        raise ValueError(f"head file {resolve_weights(weights)} has no draft_vocab_N tensor")
    return state["draft_vocab_N"].to(torch.long)


def load_eagle_head(
    weights: str | Path | None,
    parts: TargetParts,
    *,
    dtype: torch.dtype = torch.float32,
    device: Any = None,
    draft_vocab_size: int | None = None,
) -> tuple[EagleHead, dict]:
    """Load a head for the target whose tensors are ``parts``; returns (head attached to the target,
    metadata). ``draft_vocab_size``: score only the n most frequent tokens of the stored draft
    vocabulary (faster, lower acceptance; default all). ``ValueError`` naming the file for a file
    that is not a head file, a head of the wrong shape, or a head trained for another target."""
    path = resolve_weights(weights)
    if path.is_dir():
        from specdec.drafters.eagle.formats import import_head

        if draft_vocab_size is not None:
            raise ValueError("draft_vocab_size: a speculators / SGLang head keeps its whole draft vocabulary")
        head, meta = import_head(path, parts, dtype=dtype)
        return head.to(device=device or parts.embed_VD.device), meta
    state, meta, config = read_head_config(path)
    reason = target_mismatch(meta, parts.embed_VD, path)
    if reason is not None:
        raise ValueError(reason)
    head = build_head(config, state, path)
    vocab = head.draft_vocab_N
    head = head.to(device=device or parts.embed_VD.device, dtype=dtype).eval()
    head.requires_grad_(False)
    if draft_vocab_size is not None:
        if isinstance(draft_vocab_size, bool) or not 1 <= draft_vocab_size <= vocab.numel():
            raise ValueError(f"draft_vocab_size must be in [1, {vocab.numel()}], got {draft_vocab_size!r}")
        vocab = vocab[:draft_vocab_size]  # stored most frequent first
    return head.attach(parts, vocab), meta


def save_eagle_head(
    head: EagleHead, path: str | Path, *, target_name: str, embed_VD: torch.Tensor, extra: dict | None = None
) -> None:
    """Write the trainable weights (bf16) and the draft vocabulary (int64) as safetensors."""
    from safetensors.torch import save_file

    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    state["draft_vocab_N"] = head.draft_vocab_N.detach().to(torch.int64).cpu().contiguous()
    meta = {
        "config": json.dumps(asdict(head.config)),
        "target": target_name,
        "target_fingerprint": fingerprint(embed_VD),
        "extra": json.dumps(extra or {}),
    }
    save_file({k: v.cpu() for k, v in state.items()}, str(path), metadata=meta)


_WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def weight_dtype_of(value: torch.dtype | str | None) -> torch.dtype | None:
    """``weight_dtype`` as a torch dtype (None stays None); ``ValueError`` for anything else."""
    if value is None or value in _WEIGHT_DTYPES.values():
        return value
    if isinstance(value, str) and value in _WEIGHT_DTYPES:
        return _WEIGHT_DTYPES[value]
    raise ValueError(f"weight_dtype must be one of {sorted(_WEIGHT_DTYPES)} (or None), got {value!r}")


def load_packed_head(
    target: Any,
    weights: str | Path | None = None,
    *,
    draft_vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    linear_backend: str = "auto",
    weight_dtype: torch.dtype | str | None = None,
) -> tuple[PackedEagleHead, dict]:
    """Load, attach and pack a head for ``target`` (a :class:`~specdec.protocols.FeatureTarget`),
    and ask the target to capture the head's aux layers; returns (packed head, metadata).

    ``weight_dtype`` (default: bfloat16 where the packed CPU kernel runs, else ``dtype``): how the
    packed weights are stored (see :class:`PackedEagleHead`); the head's products take int8 rows
    where the target's do (a ``gguf-q8`` target on the packed kernels: ``int8``).
    """
    from specdec.protocols import FeatureTarget
    from specdec.targets.linear import resolve_backend

    if not isinstance(target, FeatureTarget):
        raise ValueError(
            f"EAGLE heads read the target's features: the target must be a FeatureTarget (parts(), "
            f"capture_layers(), hidden_BTD from forward: the native Llama target or HFTarget), got "
            f"{type(target).__name__}"
        )
    parts = target.parts()
    head, meta = load_eagle_head(weights, parts, dtype=dtype, draft_vocab_size=draft_vocab_size)
    storage = weight_dtype_of(weight_dtype)
    packed = resolve_backend(linear_backend, parts.embed_VD.device) == "packed"
    if storage is None:
        storage = torch.bfloat16 if packed else dtype
    if head.config.aux_layers:  # an EAGLE-3 head reads low and middle layers too
        target.capture_layers(head.config.aux_layers)
    if isinstance(head, Eagle3Head):  # no packed fast path for this layout: the module runs as is
        return head, meta
    # int8 rows where the target runs int8 products itself (gguf-q8)
    int8 = packed and getattr(target, "weights", None) == "gguf-q8"
    return PackedEagleHead(head, backend=linear_backend, weight_dtype=storage, int8=int8), meta
