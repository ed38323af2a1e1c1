"""The training recipe's two configs: :class:`DataConfig` (what goes into the data cache) and
:class:`TrainConfig` (everything that determines the trained head), and :func:`config_key`, the
hash that names the cache directory and the checkpoint directory.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace

__all__ = ["DataConfig", "TrainConfig", "config_key", "resolve_for_target"]


def config_key(fields: dict) -> str:
    """A directory's key: the first 10 hex digits of the sha1 of ``fields`` as sorted JSON (a value
    JSON cannot hold, by its ``str``)."""
    return hashlib.sha1(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:10]


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What goes into the cache. Changing any field changes the cache directory."""

    target: str = "smollm2-135m"
    """A built-in model name or the path of a checkpoint the native target loads (any Llama-family
    model): its own tokenizer and chat template build the prompts, and its own continuations,
    features and top-k make the data (:func:`.dataset.target_cache_name` names its cache files)."""
    greedy_tokens: int = 128
    """New tokens of the greedy continuation of every training prompt."""
    sample_tokens: int = 128
    """New tokens of a T=``sample_temperature`` continuation of every training prompt (0: none)."""
    sample_temperature: float = 0.7
    sample_continuations: int = 4
    """Sampled continuations per training HumanEval/MT-Bench prompt."""
    function_prompts: int = 400
    """Standard-library functions turned into prompts (each as code, instruction and chat
    instruction: 3 prompts), continued greedily for ``greedy_tokens``."""
    self_instruct: int = 800
    """User requests sampled from the chat model itself (Magpie); the complete, distinct ones become
    prompts (raw and chat: 2 each), continued greedily and by one T=``sample_temperature`` sample."""
    self_instruct_tokens: int = 96
    """Longest sampled request; requests without an end of turn by then are dropped."""
    heldout_continuations: bool = False
    """Also generate continuations of held-out prompts (only used for held-out monitoring)."""
    text_tokens: int = 400_000
    """Tokens of Python and documentation text found on the machine (standard-library sources and
    the installed packages' docs, :func:`.sources.text_sequences`; every 10th file held out). 400 k in the
    recipe since 2026-12-01 (30 k before): the head trained on them drafts the benchmark prompts a
    little better (its model card). The docs part depends on what is installed, so the data differ
    slightly between machines."""
    repeat_sequences: int = 1500
    """Copy lessons (:func:`.sources.repeat_sequences`): sequences of a shuffled word span written again and
    again after a training sequence's opening, all training data (0: none, the recipe before
    2026-12-01). They taught the shipped head to copy from its context (its model card)."""
    repeat_length: int = 257
    """Tokens in each copy-lesson sequence (257: one training window of 256 + 1)."""
    text_chunk: int = 512
    topk: int = 8
    gen_batch_size: int = 64
    seed: int = 0

    def key(self) -> str:
        """The cache directory's name: a hash of every field."""
        return config_key(asdict(self))


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that determines the trained head."""

    data: DataConfig = field(default_factory=DataConfig)
    draft_vocab_size: int = 8192
    """N: the draft vocabulary, the tokens the target most often predicts on the training split."""
    steps: int = 4000
    """Optimizer steps."""
    seq_len: int = 256
    batch_size: int = 12
    lr: float = 1e-3
    warmup: int = 60
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    feature_noise: float = 0.1
    """Uniform noise U(−a, a) × feature std added to step-1 input features."""
    ce_weight: float = 0.1
    unroll: int = 3
    """S: draft steps unrolled in training (1 = plain teacher forcing)."""
    step_decay: float = 0.8
    """Weight of unrolled step s is step_decay**(s−1)."""
    reg_weight: float = 1.0
    """Weight of the feature regression (EAGLE-1's smooth-L1 to the next feature); 0 trains on the
    token loss alone, as EAGLE-3 does (then the head's output is free to be any useful state)."""
    aux_layers: tuple[int, ...] = (1, 14)
    """EAGLE-3 fused input: target decoder layers (0-based) whose outputs join the last layer's
    feature (``(1, 14)`` of SmolLM2's 30: a low and a middle layer; left at this default, a target of
    another depth L gets the same pair, ``(1, L/2−1)``, see :func:`resolve_for_target`; ``()``: the
    EAGLE-1 input, the last layer alone). Their features are captured in the same forward as the
    cache's features for shards extracted now, and added to shards already cached by
    ``build_aux_features`` (about half a target pass)."""
    prev_token_input: bool = True
    """Feed the head ``embed(x_t)`` too (``EagleConfig.prev_token_input``): a key for copying from
    the context (taught by the data's copy lessons)."""
    eval_every: int = 100
    ckpt_every: int = 50
    autocast_bf16: bool = True
    """Matrix products in bfloat16 (autocast; fp32 master weights and loss): ~3× faster on CPUs
    with AVX512-BF16/AMX, but several times slower than fp32 on AVX2-only CPUs (PyTorch's fallback
    bf16 GEMM): set it False there. The shipped head was trained with it on. The head still runs in
    fp32 at inference."""
    seed: int = 0
    eval_prompts: int = 24
    """Held-out prompts decoded with the trained head to report τ and α."""
    eval_new_tokens: int = 128
    init_from: str | None = None
    """Start from these head weights (a path, or a shipped file's name) instead of a fresh head:
    fine-tuning. The file's head must have this config's shape (aux layers, draft vocabulary size,
    prev_token_input); it keeps its draft vocabulary and input scales. The optimizer and schedule
    start afresh; the file's contents (sha256) are part of the checkpoint key."""
    compat: str | None = None
    """``"speculators"``: train a head that vLLM's speculators format and SGLang's can express
    (``EagleConfig.layout="eagle3"``, :mod:`specdec.drafters.eagle.formats`): EAGLE-3's layer over
    the outputs of ``aux_layers`` only (when left at the default: the engines' own default, the
    residual entering layers 2, L/2 and L−3), no previous-token input, token loss only
    (``prev_token_input`` False, ``reg_weight`` 0, ``feature_noise`` 0)."""

    def __post_init__(self) -> None:
        if self.compat not in (None, "speculators"):
            raise ValueError(f"TrainConfig.compat must be None or 'speculators', got {self.compat!r}")
        if self.compat is not None:
            object.__setattr__(self, "prev_token_input", False)
            object.__setattr__(self, "reg_weight", 0.0)
            object.__setattr__(self, "feature_noise", 0.0)
        for name in (
            "draft_vocab_size",
            "steps",
            "seq_len",
            "batch_size",
            "unroll",
            "eval_every",
            "ckpt_every",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be an int >= 1, got {value!r}")
        if self.eval_prompts < 0:
            raise ValueError(f"TrainConfig.eval_prompts must be >= 0, got {self.eval_prompts}")
        if any(i < 0 for i in self.aux_layers) or len(set(self.aux_layers)) != len(self.aux_layers):
            raise ValueError(f"TrainConfig.aux_layers must be distinct indices >= 0, got {self.aux_layers}")
        if self.reg_weight < 0 or self.ce_weight < 0 or self.reg_weight + self.ce_weight == 0:
            raise ValueError(
                "reg_weight and ce_weight must be >= 0 and not both 0, got "
                f"{self.reg_weight}, {self.ce_weight}"
            )


def resolve_for_target(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the aux layers fitted to the target's depth L when left at the default:
    ``(1, L/2−1)``, a low and a middle layer (``(1, 14)`` for SmolLM2's 30; on a target too shallow
    for two such layers, the ones that exist below the last); with ``compat``, the serving engines'
    default (vLLM and SGLang capture the residual entering layers 2, L/2 and L−3: the outputs of
    layers 1, L/2−1 and L−4). ``ValueError`` naming ``aux_layers`` when they do not fit the target."""
    from specdec.targets.loading import load_hf_config

    hf_config = load_hf_config(cfg.data.target)
    L, V = int(hf_config.num_hidden_layers), int(hf_config.vocab_size)
    if cfg.draft_vocab_size > V:
        raise ValueError(
            f"draft_vocab_size must be at most the target's vocabulary ({V}), got {cfg.draft_vocab_size}"
        )
    layers = tuple(cfg.aux_layers)
    if layers == TrainConfig.aux_layers:
        if cfg.compat is not None:
            layers = (1, L // 2 - 1, L - 4)
            if len(set(layers)) != 3 or min(layers) < 0:
                raise ValueError(
                    f"aux_layers: the engines' default layers (1, L/2-1, L-4) = {layers} coincide on a "
                    f"{L}-layer target; give three distinct --aux-layers below {L - 1}"
                )
        else:
            layers = tuple(sorted({i for i in (1, L // 2 - 1) if 0 <= i < L - 1}))
    if any(i >= L - 1 for i in layers):
        raise ValueError(
            f"aux_layers must be decoder layers below the last ({L - 1}) of the {L}-layer target "
            f"{cfg.data.target!r}, got {layers}"
        )
    return replace(cfg, aux_layers=layers)
