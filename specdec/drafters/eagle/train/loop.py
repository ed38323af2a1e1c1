"""Train the EAGLE draft head for a target on its own features, on the CPU (the model card gives the
shipped head's recipe and time).

Legend: V target vocabulary, N draft vocabulary, D hidden size.

Recipe (EAGLE, arXiv 2401.15077, with EAGLE-3's draft vocabulary and training-time test,
arXiv 2503.01840):

1. Data (:mod:`.dataset`, cached on disk): the target's features and top-k next-token
   probabilities over the training text (:mod:`.sources`). Held out by prompt.
2. Draft vocabulary (:func:`build_draft_vocab`): the N tokens the target most often predicts
   (top-1) on the training split.
3. Loss (:mod:`.objective`): the head unrolled S steps as at inference, regression to the next
   feature plus cross-entropy against the target's next-token distribution. EAGLE-3's fused input
   (default ``aux_layers (1, 14)``): the step-1 input feature fuses the outputs of target layers 1
   and 14 with the last layer's (``EagleHead.project``; the layer features are written with the
   cache's shards, or added to an existing cache once by :func:`.dataset.build_aux_features`).
   ``reg_weight 0, ce_weight 1`` trains on EAGLE-3's token loss alone (measured: far slower to
   learn at this budget).
4. AdamW with warmup and cosine decay; a checkpoint every ``ckpt_every`` steps (an interrupted run
   resumes to the uninterrupted run's weights); seeded.
5. Held-out τ and α (:mod:`.evaluation`): real speculative decoding on held-out prompts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.drafters.eagle import (
    Eagle3Head,
    EagleConfig,
    EagleHead,
    describe,
    load_eagle_head,
    resolve_weights,
    save_eagle_head,
    stored_draft_vocab,
)
from specdec.drafters.eagle.train.config import TrainConfig, config_key, resolve_for_target
from specdec.drafters.eagle.train.dataset import (
    FeatureData,
    build_aux_features,
    build_dataset,
    load_dataset,
    write_atomically,
)
from specdec.drafters.eagle.train.evaluation import evaluate_heldout, heldout_accuracy
from specdec.drafters.eagle.train.objective import Batches, unrolled_losses
from specdec.targets.hf import hf_parts

__all__ = ["build_draft_vocab", "train"]


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
        a, b = data.span(s)
        counts += torch.bincount(data.topk_ids[a:b, 0], minlength=size)[:size]
        anywhere += torch.bincount(data.topk_ids[a:b].reshape(-1), minlength=size)[:size]
    key = torch.where(counts > 0, counts * (int(anywhere.max()) + 1), anywhere)
    order = torch.argsort(key, descending=True, stable=True)
    total = counts.sum().item()
    coverage = {
        int(k): round(counts[order[:k]].sum().item() / total, 4) for k in (1024, 2048, 4096, 8192, 16384)
    }
    return order[:n].clone(), coverage


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
    """The learning rate at ``step``: linear warmup, then cosine decay to 5 % of ``cfg.lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


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
    n_train = sum(b - a for a, b in map(data.span, train_seqs))
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
            write_atomically(ckpt_path, functools.partial(torch.save, state))
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
    work = work or data_dir / f"train-{config_key(_key_fields(cfg))}"
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
