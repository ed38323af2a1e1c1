"""Train the EAGLE draft head for a target on its own features (CPU-friendly: ~1.4 h on 2 cores).

Legend: B batch, T tokens, D hidden size, N draft vocabulary, H heads, S unrolled draft steps.

Usage::

    python -m experiments train-drafter [--steps N] [--out specdec/weights/eagle-smollm2-135m.safetensors]
    python -m experiments train-drafter --target /path/to/llama-checkpoint   # any Llama-family target
    python -m experiments.train_drafter --help

Recipe (EAGLE, arXiv 2401.15077, with EAGLE-3's draft vocabulary and training-time test,
arXiv 2503.01840):

1. Data (``experiments.drafter_data``, cached on disk): the target's features and top-k
   next-token probabilities over HumanEval/MT-Bench prompts, the target's own continuations of
   them, and Python/documentation text. Held out by prompt.
2. Draft vocabulary: the N tokens the target most often predicts (top-1) on the training split.
3. Loss per position: smooth-L1 between predicted and true next feature (in units of the features'
   std), plus 0.1 × cross-entropy
   against the target's next-token distribution restricted to the draft vocabulary. Uniform noise
   on input features (EAGLE). The head is unrolled S steps as at inference (training-time test):
   step s feeds the head its own step-(s−1) predictions, attending to true-feature keys for the
   prefix and to its own earlier predictions, exactly like the s-th draft token at inference.
   EAGLE-3's fused input (default ``--aux-layers 1,14``): the step-1 input feature fuses the
   outputs of target layers 1 and 14 with the last layer's (``EagleHead.project``; the layer
   features are written with the cache's shards, or added to an existing cache once by
   ``build_aux_features``). ``--reg-weight 0 --ce-weight 1``
   trains on EAGLE-3's token loss alone (measured: far slower to learn at this budget).
4. AdamW with warmup and cosine decay; a checkpoint every ``--ckpt-every`` steps (an interrupted
   run resumes); seeded.
5. Held-out τ and α: real speculative decoding (``specdec.generate``) on held-out prompts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from experiments.config_cli import add_config_arguments, config_from_args
from experiments.drafter_data import (
    DataConfig,
    FeatureData,
    build_aux_features,
    build_dataset,
    load_dataset,
    target_cache_name,
)
from specdec.drafters.eagle import (
    Eagle3Head,
    EagleConfig,
    EagleHead,
    describe,
    load_eagle_head,
    resolve_weights,
    save_eagle_head,
)
from specdec.drafters.eagle.weights import stored_draft_vocab
from specdec.targets.hf import hf_parts

__all__ = [
    "TrainConfig",
    "train",
    "main",
    "build_draft_vocab",
    "step1_input",
    "unrolled_features",
    "unrolled_losses",
    "evaluate_heldout",
]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that determines the trained head."""

    data: DataConfig = field(default_factory=DataConfig)
    draft_vocab_size: int = 8192
    """N: the draft vocabulary, the tokens the target most often predicts on the training split."""
    steps: int = 4000
    """Optimizer steps (4,000 for the shipped head: 81 min on 2 cores)."""
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


def build_draft_vocab(
    data: FeatureData, train_seqs: list[int], n: int, vocab_size: int | None = None
) -> tuple[torch.Tensor, dict]:
    """The ``n`` tokens the target most often predicts (top-1) on the training split, by frequency.

    Ties keep id order. Tokens that are never a top-1 prediction come after all that are, ordered by
    how often they appear anywhere in the stored top-k (a vocabulary larger than the distinct top-1
    predictions fills up with the target's likely alternatives, not with arbitrary ids), then tokens
    never seen in the top-k, by id, up to the target's ``vocab_size`` (default: the largest stored id
    + 1)."""
    seen = int(data.topk_ids.max()) + 1 if data.topk_ids.numel() else 1
    size = max(seen, vocab_size or 0)
    if n > size:
        raise ValueError(f"draft_vocab_size must be at most the target's vocabulary ({size}), got {n}")
    counts = torch.zeros(size, dtype=torch.long)
    anywhere = torch.zeros(size, dtype=torch.long)
    for s in train_seqs:
        a, b = int(data.offsets[s]), int(data.offsets[s + 1])
        counts += torch.bincount(data.topk_ids[a:b, 0], minlength=size)[:size]
        anywhere += torch.bincount(data.topk_ids[a:b].reshape(-1), minlength=size)[:size]
    key = torch.where(counts > 0, counts * (int(anywhere.max()) + 1), anywhere)
    order = torch.argsort(key, descending=True, stable=True)
    total = counts.sum().item()
    coverage = {
        int(k): round(counts[order[:k]].sum().item() / total, 4) for k in (1024, 2048, 4096, 8192, 16384)
    }
    return order[:n].clone(), coverage


class Batches:
    """Seeded random windows of ``seq_len + 1`` tokens from the training sequences."""

    def __init__(self, data: FeatureData, seqs: list[int], seq_len: int, batch_size: int, seed: int) -> None:
        self.data, self.seq_len, self.batch_size = data, seq_len, batch_size
        self.windows = []
        for s in seqs:
            a, b = int(data.offsets[s]), int(data.offsets[s + 1])
            for start in range(a, b - 2, seq_len):
                self.windows.append((start, min(start + seq_len + 1, b)))
        self.seed = seed

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """Batch number ``step`` (a pure function of seed and step, so resuming is exact); with aux
        layer features in the data, ``aux`` is ``[B, T, A, D]``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return self.take(torch.randint(len(self.windows), (self.batch_size,), generator=g).tolist())

    def take(self, pick: list[int]) -> dict[str, torch.Tensor]:
        """A batch of the windows numbered ``pick`` (in :attr:`windows`), one row each."""
        T = max(self.windows[i][1] - self.windows[i][0] for i in pick)
        D = self.data.features.shape[1]
        k = self.data.topk_ids.shape[1]
        B = len(pick)
        out = {
            "features": torch.zeros(B, T, D),
            "tokens": torch.zeros(B, T, dtype=torch.long),
            "topk_ids": torch.zeros(B, T, k, dtype=torch.long),
            "topk_probs": torch.zeros(B, T, k),
            "valid": torch.zeros(B, T, dtype=torch.bool),
        }
        aux = self.data.aux
        if aux is not None:
            out["aux"] = torch.zeros(B, T, *aux.shape[1:])
        for r, i in enumerate(pick):
            a, b = self.windows[i]
            n = b - a
            out["features"][r, :n] = self.data.features[a:b].float()
            out["tokens"][r, :n] = self.data.tokens[a:b]
            out["topk_ids"][r, :n] = self.data.topk_ids[a:b]
            out["topk_probs"][r, :n] = self.data.topk_probs[a:b].float()
            out["valid"][r, :n] = True
            if aux is not None:
                out["aux"][r, :n] = aux[a:b].float()
        return out


def _attend_unrolled(q_BHTd, keys, values, s: int) -> torch.Tensor:
    """Attention of unrolled step ``s`` (1-based): query t sees step-1 keys at positions ≤ t−s+1 and
    the step-r key at position t−s+r for r = 2..s (its own chain of predicted features)."""
    B, H, T, d = q_BHTd.shape
    rep = H // keys[0].shape[1]
    k1 = keys[0].repeat_interleave(rep, dim=1)
    v1 = values[0].repeat_interleave(rep, dim=1)
    scale = 1.0 / math.sqrt(d)
    scores = [torch.matmul(q_BHTd, k1.transpose(-1, -2)) * scale]
    ar = torch.arange(T)
    mask = ar.unsqueeze(0) <= (ar.unsqueeze(1) - (s - 1))  # [T, T]: key j visible to query t
    scores[0] = scores[0].masked_fill(~mask, float("-inf"))
    extra_v = []
    for r in range(2, s + 1):
        shift = s - r  # key at t - shift
        kr = keys[r - 1].repeat_interleave(rep, dim=1)
        vr = values[r - 1].repeat_interleave(rep, dim=1)
        kr = F.pad(kr, (0, 0, shift, 0))[:, :, :T]
        vr = F.pad(vr, (0, 0, shift, 0))[:, :, :T]
        scores.append((q_BHTd * kr).sum(-1, keepdim=True) * scale)
        extra_v.append(vr)
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    probs = torch.nan_to_num(probs)  # query rows with no visible key (t < s-1) are unused
    out = torch.matmul(probs[..., :T], v1)
    for i, vr in enumerate(extra_v):
        out = out + probs[..., T + i : T + i + 1] * vr
    return out


def unrolled_features(
    head: EagleHead,
    features_BTD: torch.Tensor,
    next_tokens_BT: torch.Tensor,
    steps: int,
    tokens_BT: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Predicted features of ``steps`` unrolled draft steps (training-time test, EAGLE-3).

    Step 1 is teacher forcing: input ``(f_t, x_{t+1})`` at position t. Step s feeds the step-(s−1)
    prediction made at t−1 (the head's own guess of f_t) with the true token, and its query at t
    attends to step-1 keys at positions ≤ t−s+1 and to the step-r key at t−s+r for r = 2..s: the
    s-th draft token at inference, after true features up to position t−s+1. Returns one
    ``[B, T, D]`` tensor per step (valid for t ≥ s−1). ``tokens_BT``: x_t, the tokens at the
    features' positions, for a head with ``prev_token_input`` (the same at every step: step s's
    pair at t is still the draft token at t+1 after the token at t).
    """
    B, T, _ = features_BTD.shape
    positions = torch.arange(T).expand(B, T)
    keys, values, preds = [], [], []
    feat_in = features_BTD
    for s in range(1, steps + 1):
        if s > 1:
            feat_in = F.pad(preds[-1], (0, 0, 1, 0))[:, :T]  # f̂ predicted at t−1 for position t
        h = head.fuse(feat_in, next_tokens_BT, tokens_BT)
        q, k, v = head.qkv(h, positions)
        keys.append(k)
        values.append(v)
        preds.append(head.feature(head.finish(h, _attend_unrolled(q, keys, values, s))))
    return preds


def step1_input(head: EagleHead, feature_BTD: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The first draft step's input feature at the batch's first T positions: ``feature_BTD`` itself,
    or for an EAGLE-3 head fused with the batch's aux-layer outputs (:meth:`EagleHead.project`)."""
    if not head.config.aux_layers:
        return feature_BTD
    if "aux" not in batch:
        raise ValueError("this head fuses aux layers, but the batch has no aux features")
    return head.project(feature_BTD, batch["aux"][:, : feature_BTD.shape[1]])


def unrolled_losses(
    head: EagleHead,
    batch: dict[str, torch.Tensor],
    vocab_index_V: torch.Tensor,
    cfg: TrainConfig,
    feature_std: float,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """Training-time-test losses: regression + CE per unrolled step, weighted, and top-1 accuracy."""
    feats = batch["features"]
    tokens = batch["tokens"]
    B, T1, D = feats.shape
    T = T1 - 1
    inp_feat = feats[:, :T]
    if cfg.feature_noise > 0 and head.training:
        noise = torch.rand(inp_feat.shape, generator=generator) * 2 - 1
        inp_feat = inp_feat + noise * cfg.feature_noise * feature_std
    inp_feat = step1_input(head, inp_feat, batch)
    tgt_feat = feats[:, 1:]  # f_{t+1}
    valid = batch["valid"][:, 1:]
    # Target distribution over the draft vocabulary at position t+1 (renormalised top-k).
    ids = vocab_index_V[batch["topk_ids"][:, 1:]]  # [B, T, k], -1 outside the draft vocab
    probs = batch["topk_probs"][:, 1:] * (ids >= 0)
    mass = probs.sum(-1, keepdim=True)
    soft = probs / mass.clamp_min(1e-6)
    top1 = ids[..., 0]
    out = {"loss": torch.zeros(())}
    for s, pred in enumerate(
        unrolled_features(head, inp_feat, tokens[:, 1:], cfg.unroll, tokens[:, :T]), start=1
    ):
        w = (valid & (torch.arange(T) >= s - 1)).float()
        # Features are large (std ≈ 39 for SmolLM2, a few dims in the hundreds): regress them in
        # units of their std so the loss sits in smooth-L1's quadratic zone and balances the CE.
        if cfg.reg_weight > 0:
            reg_tok = F.smooth_l1_loss(pred / feature_std, tgt_feat / feature_std, reduction="none").mean(-1)
            reg = (reg_tok * w).sum() / w.sum()
        else:  # token loss only (EAGLE-3)
            reg = torch.zeros(())
        logp = torch.log_softmax(head.logits(pred).float(), dim=-1)
        ce_tok = -(soft * logp.gather(-1, ids.clamp(min=0))).sum(-1)
        wc = w * (mass.squeeze(-1) > 0)
        ce = (ce_tok * wc).sum() / wc.sum().clamp_min(1.0)
        wa = w * (top1 >= 0)
        acc = ((logp.argmax(-1) == top1).float() * wa).sum() / wa.sum().clamp_min(1.0)
        out["loss"] = out["loss"] + cfg.step_decay ** (s - 1) * (cfg.reg_weight * reg + cfg.ce_weight * ce)
        out[f"reg{s}"], out[f"ce{s}"], out[f"acc{s}"] = reg.detach(), ce.detach(), acc.detach()
    return out


def _key_fields(cfg: TrainConfig) -> dict:
    """The config as the checkpoint directory's key (``init_from`` by its file's contents)."""
    fields = asdict(cfg)
    if cfg.init_from is not None:
        fields["init_from"] = hashlib.sha256(resolve_weights(cfg.init_from).read_bytes()).hexdigest()
    return fields


def _head_from_weights(cfg: TrainConfig, parts) -> tuple[EagleHead, torch.Tensor]:
    """The head of ``cfg.init_from`` as a trainable fp32 module (attached to ``parts``) and its draft
    vocabulary in stored (most frequent first) order; ``ValueError`` when it does not fit ``cfg``."""
    path = resolve_weights(cfg.init_from)
    head, _ = load_eagle_head(path, parts)  # checks the target's fingerprint
    c = head.config
    have = (c.aux_layers, c.draft_vocab_size, c.prev_token_input)
    want = (tuple(cfg.aux_layers), cfg.draft_vocab_size, cfg.prev_token_input)
    if have != want:
        raise ValueError(
            f"init_from: {path.name} has (aux_layers, draft_vocab_size, prev_token_input) = {have}, this "
            f"run asks for {want}; fine-tuning keeps the head's shape"
        )
    return head.requires_grad_(True).train(), stored_draft_vocab(path)


def _lr(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def heldout_accuracy(
    head, data, seqs, vocab_index_V, cfg, feature_std, max_windows: int = 24
) -> dict[str, float]:
    """Teacher-forced / unrolled top-1 agreement with the target on held-out windows."""
    head.eval()
    batches = Batches(data, seqs, cfg.seq_len, min(max_windows, 8), seed=12345)
    stats: dict[str, float] = {}
    n = max(1, max_windows // batches.batch_size)
    for i in range(n):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
            out = unrolled_losses(head, batches.batch(i), vocab_index_V, cfg, feature_std)
        for k, v in out.items():
            stats[k] = stats.get(k, 0.0) + float(v) / n
    head.train()
    return stats


def evaluate_heldout(
    weights: Path, cfg: TrainConfig, log=print, drafters: tuple[str, ...] = ("eagle",)
) -> dict:
    """Real speculative decoding (greedy, γ = 5) of held-out prompts with the trained head: pooled α
    and τ per drafter (``specdec.metrics.merge_metrics``), and tok/s against plain decoding."""
    import specdec
    from experiments.drafter_data import load_prompts
    from specdec.metrics import merge_metrics
    from specdec.targets import load_target
    from specdec.targets.loading import load_tokenizer

    tokenizer = load_tokenizer(cfg.data.target)
    target = load_target(cfg.data.target)
    held = [p for p in load_prompts(tokenizer) if p.heldout]
    # As ``specdec bench`` runs them: raw HumanEval and MT-Bench first turns, alternating.
    he = [p for p in held if p.kind == "humaneval"]
    mt = [p for p in held if p.kind == "mtbench" and p.pid.endswith("/0")]
    mixed = [p for pair in zip(he, mt, strict=False) for p in pair][: cfg.eval_prompts]
    result: dict = {"prompts": len(mixed), "gamma": 5, "new_tokens": cfg.eval_new_tokens}
    for name in ("none", *drafters):
        runs = []
        for i, p in enumerate(mixed):
            out = specdec.generate(
                target,
                [list(p.ids)],
                drafter=name,
                drafter_options=None if name == "none" else {"weights": str(weights)},
                max_new_tokens=cfg.eval_new_tokens,
                temperature=0.0,
                gamma=5,
            )
            runs.append(out.metrics)
            if name != "none":
                m = out.metrics
                log(
                    f"  eval {name} {i + 1}/{len(mixed)} {p.pid}: tau={m.mean_accepted_tokens:.2f} "
                    f"alpha={m.acceptance_rate:.2f}"
                )
        m = merge_metrics(runs)
        result[name] = {
            "alpha": round(m.acceptance_rate, 4),
            "tau": round(m.mean_accepted_tokens, 3),
            "tokens_per_second": round(m.tokens_per_second, 2),
        }
    for name in drafters:
        result[name]["speedup_vs_plain"] = round(
            result[name]["tokens_per_second"] / max(1e-9, result["none"]["tokens_per_second"]), 3
        )
    return result


@dataclass
class _Run:
    """What :func:`train` sets up before the optimisation loop."""

    data: FeatureData
    train_seqs: list[int]
    held_seqs: list[int]
    n_train: int
    coverage: dict
    parts: object
    head: EagleHead
    vocab_index_V: torch.Tensor
    feature_std: float


def _prepare(cfg: TrainConfig, data_root: Path | None, log) -> tuple[_Run, Path]:
    """The data cache (built once), the draft vocabulary, and the head to train (fresh or from a file)."""
    from specdec.targets.loading import load_hf_model

    if cfg.init_from is not None:
        resolve_weights(cfg.init_from)  # a missing file fails now, not after building the data
    data_dir = build_dataset(cfg.data, data_root, log=log, aux_layers=cfg.aux_layers)
    if cfg.aux_layers:
        build_aux_features(data_dir, cfg.aux_layers, log=log)
    data = load_dataset(data_dir, cfg.aux_layers)
    train_seqs, held_seqs = data.sequences(False), data.sequences(True)
    n_train = int(sum(data.offsets[s + 1] - data.offsets[s] for s in train_seqs))
    log(
        f"[train] data: {len(train_seqs)} train / {len(held_seqs)} held-out sequences, {n_train} train "
        f"tokens, {data.features.numel() * 2 / 2**20:.0f} MiB of features"
    )
    model = load_hf_model(cfg.data.target)
    vocab_N, coverage = build_draft_vocab(data, train_seqs, cfg.draft_vocab_size, model.config.vocab_size)
    log(f"[train] top-1 coverage of the draft vocab by size: {coverage}")
    parts = hf_parts(model)
    feature_std = float(data.features[:200_000].float().std())
    if cfg.init_from is not None:
        head, vocab_N = _head_from_weights(cfg, parts)
        log(f"[train] starting from the weights {resolve_weights(cfg.init_from)}")
    else:
        # Aux layers carry a few huge outlier dims on some tokens (attention sinks): scale each by
        # its typical token size (median RMS), not by a std that the outliers dominate.
        aux_rms = (
            [] if data.aux is None else data.aux[:200_000].float().pow(2).mean(-1).sqrt().median(0).values
        )
        scales = {
            "feature_scale": 1.0 / feature_std,
            "embed_scale": 1.0 / float(parts.embed_VD.float().std()),
            "aux_scales": tuple(1.0 / float(r) for r in aux_rms),
        }
        if cfg.compat is not None:  # EAGLE-3's layer: its norms scale the inputs
            scales = {"aux_scales": (1.0,) * len(cfg.aux_layers), "layout": "eagle3"}
        econf = EagleConfig.from_hf_config(
            model.config,
            draft_vocab_size=cfg.draft_vocab_size,
            aux_layers=tuple(cfg.aux_layers),
            prev_token_input=cfg.prev_token_input,
            **scales,
        )
        torch.manual_seed(cfg.seed)  # the same initial head whether or not the data was just built
        if cfg.compat is not None:
            head = Eagle3Head(econf).attach(parts, vocab_N, init_output=True)
        else:
            head = EagleHead(econf).attach(parts, vocab_N)
    head.draft_vocab_N = vocab_N  # frequency order for saving; attach() scores with an id-sorted copy
    vocab_index_V = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    vocab_index_V[torch.sort(vocab_N).values] = torch.arange(cfg.draft_vocab_size)
    log(f"[train] {describe(head)}; feature std {feature_std:.3f}")
    run = _Run(data, train_seqs, held_seqs, n_train, coverage, parts, head, vocab_index_V, feature_std)
    return run, data_dir


def _optimise(run: _Run, cfg: TrainConfig, work: Path, log) -> list[dict]:
    """AdamW over the seeded batches, resuming from ``work/ckpt.pt``; returns the held-out curve."""
    head = run.head
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    ckpt_path = work / "ckpt.pt"
    step, history = 0, []
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=True)
        head.load_state_dict(ckpt["head"])
        opt.load_state_dict(ckpt["opt"])
        step, history = int(ckpt["step"]), json.loads(ckpt["history"])
        log(f"[train] resumed at step {step} from {ckpt_path}")
    batches = Batches(run.data, run.train_seqs, cfg.seq_len, cfg.batch_size, cfg.seed)
    noise_gen = torch.Generator()
    head.train()
    t0, tokens_seen, start_step = time.perf_counter(), 0, step
    while step < cfg.steps:
        for g in opt.param_groups:
            g["lr"] = _lr(step, cfg)
        noise_gen.manual_seed(cfg.seed * 7919 + step)
        batch = batches.batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
            losses = unrolled_losses(head, batch, run.vocab_index_V, cfg, run.feature_std, noise_gen)
        opt.zero_grad(set_to_none=True)
        losses["loss"].backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        tokens_seen += int(batch["valid"].sum())
        if step % 10 == 0 or step == cfg.steps:
            el = time.perf_counter() - t0
            accs = " ".join(f"acc{s}={float(losses[f'acc{s}']):.3f}" for s in range(1, cfg.unroll + 1))
            log(
                f"[train] step {step}/{cfg.steps} loss={float(losses['loss'].detach()):.4f} {accs} "
                f"lr={_lr(step, cfg):.2e} {tokens_seen / el:.0f} tok/s, "
                f"eta {(cfg.steps - step) * el / (step - start_step) / 60:.1f} min"
            )
        if step % cfg.eval_every == 0 or step == cfg.steps:
            stats = heldout_accuracy(head, run.data, run.held_seqs, run.vocab_index_V, cfg, run.feature_std)
            history.append({"step": step, **{k: round(v, 4) for k, v in stats.items()}})
            log(
                f"[eval] step {step}: held-out "
                + " ".join(f"{k}={v:.3f}" for k, v in stats.items() if "acc" in k)
            )
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            state = {
                "head": head.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "history": json.dumps(history),
            }
            torch.save(state, ckpt_path.with_suffix(".tmp"))
            ckpt_path.with_suffix(".tmp").replace(ckpt_path)
    return history


def train(
    cfg: TrainConfig,
    *,
    out: Path,
    work: Path | None = None,
    data_root: Path | None = None,
    evaluate: bool = True,
    log=print,
) -> dict:
    """Build (or reuse) the data cache, train, save the head to ``out``; return a summary."""
    t_start = time.perf_counter()
    cfg = resolve_for_target(cfg)
    run, data_dir = _prepare(cfg, data_root, log)
    cfg_key = hashlib.sha1(json.dumps(_key_fields(cfg), sort_keys=True, default=str).encode()).hexdigest()[
        :10
    ]
    work = work or data_dir / f"train-{cfg_key}"
    work.mkdir(parents=True, exist_ok=True)
    history = _optimise(run, cfg, work, log)
    train_s = time.perf_counter() - t_start
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "config": json.loads(json.dumps(asdict(cfg), default=str)),
        "draft_vocab_coverage": run.coverage,
        "train_tokens": run.n_train,
        "heldout_curve": history,
        "wall_s_data_and_train": round(train_s),
    }
    save = lambda: save_eagle_head(
        run.head, out, target_name=cfg.data.target, embed_VD=run.parts.embed_VD, extra=summary
    )
    save()
    log(f"[train] saved {out} ({out.stat().st_size / 2**20:.1f} MiB) after {train_s / 60:.1f} min")
    if evaluate:
        summary["heldout_decode"] = evaluate_heldout(out, cfg, log=log)
        log(f"[eval] held-out decoding: {summary['heldout_decode']}")
        save()
    (out.with_suffix(".json")).write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m experiments train-drafter [options]``; one option per :class:`TrainConfig` field."""
    p = argparse.ArgumentParser(
        prog="python -m experiments train-drafter", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to save the head (default specdec/weights/eagle-<target>.safetensors, the target's "
        "built-in name or its checkpoint folder's name and hash)",
    )
    p.add_argument(
        "--data-root", type=Path, default=None, help="feature cache root (default ~/.cache/specdec)"
    )
    p.add_argument("--work", type=Path, default=None, help="checkpoint directory (default inside the cache)")
    p.add_argument("--no-eval", action="store_true", help="skip held-out speculative decoding")
    add_config_arguments(p, TrainConfig)
    a = p.parse_args(argv)
    cfg = config_from_args(TrainConfig, a)
    out = a.out or Path("specdec/weights") / f"eagle-{target_cache_name(cfg.data.target)}.safetensors"
    train(
        cfg,
        out=out,
        work=a.work,
        data_root=a.data_root,
        evaluate=not a.no_eval,
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
