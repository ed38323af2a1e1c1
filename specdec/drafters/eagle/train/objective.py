"""What one training step computes: the EAGLE head unrolled over its own draft steps, and the loss.

Legend: B batch, T tokens, D hidden size, H heads, d head size, k top-k, V vocabulary, S unrolled
draft steps.

Loss per position (EAGLE, arXiv 2401.15077, with EAGLE-3's training-time test, arXiv 2503.01840):
smooth-L1 between predicted and true next feature (in units of the features' std), plus
``ce_weight`` × cross-entropy against the target's next-token distribution restricted to the draft
vocabulary; uniform noise on the input features (EAGLE). The head is unrolled S steps as at
inference: step s feeds the head its own step-(s−1) predictions, attending to true-feature keys for
the prefix and to its own earlier predictions, exactly like the s-th draft token at inference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specdec.drafters.eagle import EagleHead
from specdec.drafters.eagle.train.config import TrainConfig
from specdec.drafters.eagle.train.dataset import FeatureData

__all__ = ["Batches", "step1_input", "unrolled_features", "unrolled_losses"]


class Batches:
    """Seeded random windows of ``seq_len + 1`` tokens from the training sequences."""

    def __init__(self, data: FeatureData, seqs: list[int], seq_len: int, batch_size: int, seed: int) -> None:
        self.data, self.seq_len, self.batch_size = data, seq_len, batch_size
        self.windows = []
        for s in seqs:
            a, b = data.span(s)
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
