"""Train the EAGLE draft head for a target on its own features (CPU-friendly: ~1.4 h on 2 cores).

Legend: B batch, T tokens, D hidden size, N draft vocabulary, H heads, S unrolled draft steps.

Usage::

    python -m experiments train-drafter [--steps N] [--out specdec/weights/eagle-smollm2-135m.safetensors]
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

from experiments.drafter_data import DataConfig, FeatureData, build_aux_features, build_dataset, load_dataset
from specdec.drafters.eagle import (
    EagleConfig,
    EagleHead,
    describe,
    load_eagle_head,
    resolve_weights,
    save_eagle_head,
    stored_draft_vocab,
    target_parts,
)

__all__ = [
    "TrainConfig",
    "train",
    "main",
    "build_draft_vocab",
    "grow_draft_vocab",
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
    steps: int = 4000
    """4,000 in the recipe since 2026-12-01 (3,000 before, on less data): 81 min measured here."""
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
    feature (``(1, 14)`` of SmolLM2's 30: a low and a middle layer; ``()``: the EAGLE-1 input, the
    last layer alone). Their features are captured in the same forward as the cache's features for
    shards extracted now, and added to shards already cached by ``build_aux_features`` (about half a
    target pass)."""
    prev_token_input: bool = True
    """Feed the head ``embed(x_t)`` too (``EagleConfig.prev_token_input``): a key for copying from
    the context (on in the recipe since 2026-12-01, with the data's copy lessons). With
    ``init_from`` a head without it gains the block, zero-initialised (the starting head's
    predictions unchanged)."""
    num_layers: int = 1
    """Decoder layers in the head (``EagleConfig.num_layers``). With ``init_from`` a head with fewer
    layers gains the missing ones on top, their output projections at zero (the starting head's
    predictions unchanged)."""
    eval_every: int = 100
    ckpt_every: int = 50
    autocast_bf16: bool = True
    """Matrix products in bfloat16 (autocast; fp32 master weights and loss): ~3× faster on CPUs
    with AVX512-BF16/AMX. The head still runs in fp32 at inference."""
    seed: int = 0
    eval_prompts: int = 24
    """Held-out prompts decoded with the trained head to report τ and α."""
    eval_new_tokens: int = 128
    init_from: str | None = None
    """Start from these head weights (a path, or a shipped file's name such as
    ``eagle-smollm2-135m.safetensors``) instead of a fresh head: fine-tuning, e.g. EAGLE-3's token
    loss alone (``reg_weight=0``) after the regression recipe. The head keeps the file's draft
    vocabulary and input scales; its aux layers must equal this config's, and a larger
    ``draft_vocab_size`` grows the file's vocabulary by the data's most frequent other tokens.
    The optimizer and the schedule (warmup, then cosine over ``steps``) start afresh. The file's
    contents (sha256) are part of the checkpoint key."""


def build_draft_vocab(data: FeatureData, train_seqs: list[int], n: int) -> tuple[torch.Tensor, dict]:
    """The ``n`` tokens the target most often predicts (top-1) on the training split, by frequency.

    Ties keep id order. Tokens that are never a top-1 prediction come after all that are, ordered by
    how often they appear anywhere in the stored top-k (a vocabulary larger than the distinct top-1
    predictions fills up with the target's likely alternatives, not with arbitrary ids)."""
    size = int(data.topk_ids.max()) + 1 if data.topk_ids.numel() else 1
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
    L = head.config.num_layers
    keys, values, preds = [[] for _ in range(L)], [[] for _ in range(L)], []
    feat_in = features_BTD
    for s in range(1, steps + 1):
        if s > 1:
            feat_in = F.pad(preds[-1], (0, 0, 1, 0))[:, :T]  # f̂ predicted at t−1 for position t
        h = head.fuse(feat_in, next_tokens_BT, tokens_BT)
        for i in range(L):  # each layer attends to its own keys of the earlier steps
            q, k, v = head.qkv(h, positions, i)
            keys[i].append(k)
            values[i].append(v)
            h = head.finish(h, _attend_unrolled(q, keys[i], values[i], s), i)
        preds.append(head.feature(h))
    return preds


def step1_input(head: EagleHead, feature_BTD: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The first draft step's input feature at the batch's first T positions: ``feature_BTD`` itself,
    or for an EAGLE-3 head fused with the batch's aux-layer outputs (:meth:`EagleHead.project`)."""
    if head.fc_aux is None:
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
    """The config as the checkpoint directory's key. Fields added later are left out when they hold
    the value that reproduces the older recipe (no regression weight change, no aux layers), so
    older runs keep their directories."""
    fields = asdict(cfg)
    for name, legacy in (
        ("reg_weight", 1.0),
        ("aux_layers", ()),
        ("init_from", None),
        ("prev_token_input", False),
        ("num_layers", 1),
    ):
        if fields[name] == legacy:
            del fields[name]
    if cfg.init_from is not None:  # the starting weights by content, not by name
        fields["init_from"] = hashlib.sha256(resolve_weights(cfg.init_from).read_bytes()).hexdigest()
    return fields


def grow_draft_vocab(stored_N: torch.Tensor, frequent_M: torch.Tensor, n: int) -> torch.Tensor:
    """``stored_N`` (kept first, in its order) extended to ``n`` tokens by the most frequent tokens of
    ``frequent_M`` (frequency order) that it lacks."""
    if n < stored_N.numel():
        raise ValueError(f"n must be >= the stored vocabulary's {stored_N.numel()} tokens, got {n}")
    have = torch.zeros(int(max(stored_N.max(), frequent_M.max())) + 1, dtype=torch.bool)
    have[stored_N] = True
    extra = frequent_M[~have[frequent_M]][: n - stored_N.numel()]
    if stored_N.numel() + extra.numel() < n:
        raise ValueError(
            f"draft_vocab_size {n}: the data rank only {stored_N.numel() + extra.numel()} distinct tokens"
        )
    return torch.cat([stored_N, extra])


def _head_from_weights(cfg: TrainConfig, parts, frequent_M: torch.Tensor) -> tuple[EagleHead, torch.Tensor]:
    """The head of ``cfg.init_from`` as a trainable fp32 module (attached to ``parts``), and its draft
    vocabulary in stored (most frequent first) order; ``ValueError`` when it does not fit ``cfg``.

    A larger ``cfg.draft_vocab_size`` than the file's grows the vocabulary: the file's tokens first,
    then the most frequent others of ``frequent_M`` (the head's trainable weights do not depend on the
    vocabulary; its LM-head rows are the target's)."""
    path = resolve_weights(cfg.init_from)
    head, _ = load_eagle_head(path, parts)  # checks the target's fingerprint
    c = head.config
    if c.aux_layers != tuple(cfg.aux_layers):
        raise ValueError(
            f"init_from: {path.name} fuses target layers {list(c.aux_layers)}, but this run's "
            f"aux_layers are {list(cfg.aux_layers)} (pass --aux-layers {','.join(map(str, c.aux_layers))!r})"
        )
    if c.draft_vocab_size > cfg.draft_vocab_size:
        raise ValueError(
            f"init_from: {path.name} has a draft vocabulary of {c.draft_vocab_size}, but this run's "
            f"draft_vocab_size is {cfg.draft_vocab_size}; a vocabulary can grow, not shrink "
            f"(pass --draft-vocab-size {c.draft_vocab_size} or more)"
        )
    if c.prev_token_input and not cfg.prev_token_input:
        raise ValueError(
            f"init_from: {path.name} feeds the previous token (prev_token_input), but this run does not "
            "(pass --prev-token-input)"
        )
    if c.num_layers > cfg.num_layers:
        raise ValueError(
            f"init_from: {path.name} has {c.num_layers} decoder layers, but this run's num_layers is "
            f"{cfg.num_layers}; layers can be added, not removed (pass --num-layers {c.num_layers} or more)"
        )
    vocab_N = stored_draft_vocab(path)
    if c.draft_vocab_size < cfg.draft_vocab_size:
        vocab_N = grow_draft_vocab(vocab_N, frequent_M, cfg.draft_vocab_size)
    wanted = replace(
        c,
        draft_vocab_size=cfg.draft_vocab_size,
        prev_token_input=cfg.prev_token_input,
        num_layers=cfg.num_layers,
    )
    if wanted != c:
        # Rebuild with the grown vocabulary, the x_t block in fc and/or more layers, each added
        # at zero output so that the starting head computes what the file's does.
        state = {**head.state_dict(), "draft_vocab_N": vocab_N}
        if wanted.prev_token_input and not c.prev_token_input:
            fc = state["fc.weight"]
            state["fc.weight"] = torch.cat([fc, fc.new_zeros(fc.shape[0], c.hidden_size)], 1)
        torch.manual_seed(cfg.seed)  # the added layers' other weights: a seeded fresh init
        head = EagleHead(wanted)
        for i in range(c.num_layers - 1, wanted.num_layers - 1):  # the added layers
            added = head.extra_layers[i].zero_output().state_dict()
            state.update({f"extra_layers.{i}.{k}": v for k, v in added.items()})
        head.load_state_dict(state, strict=True)
        head.attach(parts, vocab_N)
    head.requires_grad_(True).train()
    return head, vocab_N


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
    from specdec.targets.loading import load_hf_model

    t_start = time.perf_counter()
    if cfg.init_from is not None:
        resolve_weights(cfg.init_from)  # a missing file fails now, not after building the data
    data_dir = build_dataset(cfg.data, data_root, log=log, aux_layers=cfg.aux_layers)
    if cfg.aux_layers:
        build_aux_features(data_dir, cfg.aux_layers, log=log)
    data = load_dataset(data_dir, cfg.aux_layers)
    train_seqs, held_seqs = data.sequences(False), data.sequences(True)
    n_train = int(sum(data.offsets[s + 1] - data.offsets[s] for s in train_seqs))
    log(
        f"[train] data: {len(train_seqs)} train / {len(held_seqs)} held-out sequences, "
        f"{n_train} train tokens, "
        f"{data.features.numel() * 2 / 2**20:.0f} MiB of features"
    )
    # One ranking serves both starts: a fresh head takes its first draft_vocab_size tokens, a head
    # grown from --init-from the most frequent ones its file lacks (twice the size leaves room).
    frequent_M, coverage = build_draft_vocab(data, train_seqs, 2 * cfg.draft_vocab_size)
    vocab_N = frequent_M[: cfg.draft_vocab_size].clone()
    log(f"[train] top-1 coverage of the draft vocab by size: {coverage}")

    model = load_hf_model(cfg.data.target)
    parts = target_parts(model)  # the HF model exposes model.embed_tokens etc. via .model
    feature_std = float(data.features[:200_000].float().std())
    embed_std = float(parts.embed_VD.float().std())
    # Aux layers carry a few huge outlier dims on some tokens (attention sinks): scale each by its
    # typical token size (median RMS), not by a std that the outliers dominate.
    aux_rms = [] if data.aux is None else data.aux[:200_000].float().pow(2).mean(-1).sqrt().median(0).values
    if cfg.init_from is not None:
        head, vocab_N = _head_from_weights(cfg, parts, frequent_M)
        econf = head.config
        log(f"[train] starting from the weights {resolve_weights(cfg.init_from)}")
    else:
        econf = EagleConfig.from_hf_config(
            model.config,
            draft_vocab_size=cfg.draft_vocab_size,
            feature_scale=1.0 / feature_std,
            embed_scale=1.0 / embed_std,
            aux_layers=tuple(cfg.aux_layers),
            aux_scales=tuple(1.0 / float(r) for r in aux_rms),
            prev_token_input=cfg.prev_token_input,
            num_layers=cfg.num_layers,
        )
        torch.manual_seed(cfg.seed)  # the same initial head whether or not the data was just built
        head = EagleHead(econf).attach(parts, vocab_N)
    head.draft_vocab_N = vocab_N  # frequency order for saving; attach() scores with an id-sorted copy
    vocab_index_V = torch.full((econf.vocab_size,), -1, dtype=torch.long)
    vocab_index_V[torch.sort(vocab_N).values] = torch.arange(cfg.draft_vocab_size)
    log(
        f"[train] {describe(head)}; feature std {feature_std:.3f}, embedding std {embed_std:.4f}"
        + (
            f", aux layers {list(cfg.aux_layers)} median RMS {[round(float(r), 3) for r in aux_rms]}"
            if cfg.aux_layers
            else ""
        )
    )

    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    cfg_key = hashlib.sha1(json.dumps(_key_fields(cfg), sort_keys=True, default=str).encode()).hexdigest()[
        :10
    ]
    work = work or data_dir / f"train-{cfg_key}"
    work.mkdir(parents=True, exist_ok=True)
    ckpt_path = work / "ckpt.pt"
    step = 0
    history: list[dict] = []
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=True)
        head.load_state_dict(ckpt["head"])
        opt.load_state_dict(ckpt["opt"])
        step = int(ckpt["step"])
        history = json.loads(ckpt["history"])
        log(f"[train] resumed at step {step} from {ckpt_path}")
    batches = Batches(data, train_seqs, cfg.seq_len, cfg.batch_size, cfg.seed)
    noise_gen = torch.Generator()
    head.train()
    t0, tokens_seen, start_step = time.perf_counter(), 0, step
    while step < cfg.steps:
        for g in opt.param_groups:
            g["lr"] = _lr(step, cfg)
        noise_gen.manual_seed(cfg.seed * 7919 + step)
        batch = batches.batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
            losses = unrolled_losses(head, batch, vocab_index_V, cfg, feature_std, noise_gen)
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
            stats = heldout_accuracy(head, data, held_seqs, vocab_index_V, cfg, feature_std)
            history.append({"step": step, **{k: round(v, 4) for k, v in stats.items()}})
            log(
                f"[eval] step {step}: held-out "
                + " ".join(f"{k}={v:.3f}" for k, v in stats.items() if "acc" in k)
            )
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            tmp = ckpt_path.with_suffix(".tmp")
            torch.save(
                {
                    "head": head.state_dict(),
                    "opt": opt.state_dict(),
                    "step": step,
                    "history": json.dumps(history),
                },
                tmp,
            )
            tmp.replace(ckpt_path)
    train_s = time.perf_counter() - t_start
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "config": json.loads(json.dumps(asdict(cfg), default=str)),
        "draft_vocab_coverage": coverage,
        "train_tokens": n_train,
        "heldout_curve": history,
        "wall_s_data_and_train": round(train_s),
    }
    save_eagle_head(head, out, target_name=cfg.data.target, embed_VD=parts.embed_VD, extra=summary)
    log(f"[train] saved {out} ({out.stat().st_size / 2**20:.1f} MiB) after {train_s / 60:.1f} min")
    if evaluate:
        summary["heldout_decode"] = evaluate_heldout(out, cfg, log=log)
        log(f"[eval] held-out decoding: {summary['heldout_decode']}")
        save_eagle_head(head, out, target_name=cfg.data.target, embed_VD=parts.embed_VD, extra=summary)
    (out.with_suffix(".json")).write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m experiments train-drafter [options]``."""
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="train-drafter", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("specdec/weights/eagle-smollm2-135m.safetensors"))
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--draft-vocab-size", type=int, default=d.draft_vocab_size)
    p.add_argument("--unroll", type=int, default=d.unroll)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--ce-weight", type=float, default=d.ce_weight)
    p.add_argument(
        "--reg-weight",
        type=float,
        default=d.reg_weight,
        help="weight of the feature regression loss (0: token loss only, as EAGLE-3)",
    )
    p.add_argument(
        "--aux-layers",
        default=",".join(map(str, d.aux_layers)),
        help="EAGLE-3 fused input: comma-separated target decoder layers (0-based) whose outputs join "
        "the last layer's feature (default: %(default)s; an empty string: the EAGLE-1 input alone)",
    )
    p.add_argument(
        "--init-from",
        default=None,
        help="start from these head weights (a path, or a shipped file's name such as "
        "eagle-smollm2-135m.safetensors) instead of a fresh head: fine-tuning; a larger "
        "--draft-vocab-size than the file's grows its vocabulary",
    )
    p.add_argument(
        "--prev-token-input",
        action=argparse.BooleanOptionalAction,
        default=d.prev_token_input,
        help="also feed the head embed(x_t), the token at the feature's position, a key for copying "
        "from the context (default: %(default)s); with --init-from, a head without it gains the "
        "block at zero",
    )
    p.add_argument(
        "--num-layers",
        type=int,
        default=d.num_layers,
        help="decoder layers in the head (default: %(default)s, EAGLE's one); with --init-from, "
        "layers the file lacks are added on top at zero output",
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--text-tokens", type=int, default=d.data.text_tokens)
    p.add_argument("--greedy-tokens", type=int, default=d.data.greedy_tokens)
    p.add_argument("--sample-tokens", type=int, default=d.data.sample_tokens)
    p.add_argument(
        "--sample-continuations",
        type=int,
        default=d.data.sample_continuations,
        help="sampled continuations per training HumanEval/MT-Bench prompt",
    )
    p.add_argument(
        "--function-prompts",
        type=int,
        default=d.data.function_prompts,
        help="standard-library functions used as extra prompts (x3: code, instruction, chat)",
    )
    p.add_argument(
        "--self-instruct",
        type=int,
        default=d.data.self_instruct,
        help="user requests sampled from the target itself (Magpie); each kept one is 2 prompts",
    )
    p.add_argument(
        "--self-instruct-rounds",
        type=int,
        default=d.data.self_instruct_rounds,
        help="rounds of --self-instruct requests, each with its own seed (later rounds add to the cache)",
    )
    p.add_argument(
        "--repeat-sequences",
        type=int,
        default=d.data.repeat_sequences,
        help="copy lessons: sequences of a shuffled word span written again and again after a "
        "training sequence's opening (default: %(default)s)",
    )
    p.add_argument(
        "--data-root", type=Path, default=None, help="feature cache root (default ~/.cache/specdec)"
    )
    p.add_argument("--work", type=Path, default=None, help="checkpoint directory (default inside the cache)")
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts)
    p.add_argument("--no-eval", action="store_true", help="skip held-out speculative decoding")
    p.add_argument(
        "--no-autocast", action="store_true", help="train in fp32 (slower) instead of bf16 autocast"
    )
    a = p.parse_args(argv)
    for name in (
        "sample_continuations",
        "function_prompts",
        "self_instruct",
        "self_instruct_rounds",
        "repeat_sequences",
    ):
        if getattr(a, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(a, name)}")
    for name in (
        "steps",
        "draft_vocab_size",
        "unroll",
        "batch_size",
        "seq_len",
        "eval_prompts",
        "num_layers",
    ):
        if getattr(a, name) < (0 if name == "eval_prompts" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    try:
        aux_layers = tuple(int(x) for x in a.aux_layers.split(",") if x.strip())
    except ValueError:
        raise ValueError(
            f"--aux-layers must be comma-separated layer indices, got {a.aux_layers!r}"
        ) from None
    if any(i < 0 for i in aux_layers) or len(set(aux_layers)) != len(aux_layers):
        raise ValueError(f"--aux-layers must be distinct indices >= 0, got {a.aux_layers!r}")
    if a.reg_weight < 0 or a.ce_weight < 0 or a.reg_weight + a.ce_weight == 0:
        raise ValueError(
            f"--reg-weight and --ce-weight must be >= 0 and not both 0, got {a.reg_weight} and {a.ce_weight}"
        )
    cfg = replace(
        d,
        aux_layers=aux_layers,
        reg_weight=a.reg_weight,
        init_from=a.init_from,
        prev_token_input=a.prev_token_input,
        num_layers=a.num_layers,
        steps=a.steps,
        draft_vocab_size=a.draft_vocab_size,
        unroll=a.unroll,
        lr=a.lr,
        ce_weight=a.ce_weight,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        seed=a.seed,
        eval_prompts=a.eval_prompts,
        autocast_bf16=not a.no_autocast,
        data=replace(
            d.data,
            text_tokens=a.text_tokens,
            greedy_tokens=a.greedy_tokens,
            sample_tokens=a.sample_tokens,
            sample_continuations=a.sample_continuations,
            function_prompts=a.function_prompts,
            self_instruct=a.self_instruct,
            self_instruct_rounds=a.self_instruct_rounds,
            repeat_sequences=a.repeat_sequences,
        ),
    )
    train(
        cfg,
        out=a.out,
        work=a.work,
        data_root=a.data_root,
        evaluate=not a.no_eval,
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
