"""A tiny byte-level MoE language model and a seeded CPU training loop.

Legend: B sequences, S sequence length, D model dim, H FFN hidden dim (per expert), V vocabulary (256
bytes), E experts, K experts per token, L MoE layers, T tokens.

The model is a pre-norm decoder: learned positions, ``layers`` blocks of causal attention and a
feed-forward that is either one dense SwiGLU (``num_experts=0``, the FLOP-matched baseline) or a
``moe.MoE`` of E SwiGLU experts of the same hidden size H, so that top-1 routing keeps the active FLOPs
per token of the dense model for every E (Switch Transformer, Fedus et al., arXiv 2101.03961, Sec. 2).
The output head is tied to the byte embedding.

Data is text already on the machine (:mod:`experiments.text_corpus`: whole files held out); training
batches are random windows of the training bytes, seeded by (seed, step), so every run with the same
seed sees the same batches.

``experiments.catalog.switch_tables`` trains it (loss against E at fixed active FLOPs, capacity and
aux-loss sweeps); ``experiments.catalog.moe_verify_cost`` reads its routing of held-out text.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import moe
from experiments.config import validate_config
from experiments.text_corpus import Corpus, heldout_windows, load_corpus, sample_batch

__all__ = [
    "VOCAB_SIZE",
    "TinyLMConfig",
    "TinyTrainConfig",
    "TinyMoELM",
    "count_params",
    "active_flops_per_token",
    "load_imbalance",
    "evaluate",
    "train",
    "train_step",
    "make_optimizer",
    "torch_threads",
    "routed_experts",
    "save_checkpoint",
    "load_checkpoint",
]

VOCAB_SIZE = 256
CHECKPOINT_FILE = "model.safetensors"


@dataclass(frozen=True, kw_only=True)
class TinyLMConfig:
    """The architecture. ``num_experts=0`` is a dense SwiGLU FFN of hidden ``hidden_dim`` (no router)."""

    dim: int = 128
    heads: int = 4
    layers: int = 4
    seq_len: int = 128
    hidden_dim: int = 256
    num_experts: int = 8
    top_k: int = 1
    router: str = "switch"
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        validate_config(self)
        for name in ("dim", "heads", "layers", "seq_len", "hidden_dim", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"TinyLMConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(f"TinyLMConfig.dim={self.dim} must be divisible by heads={self.heads}")
        if self.num_experts < 0 or (self.num_experts and self.top_k > self.num_experts):
            raise ValueError(
                "TinyLMConfig.num_experts must be 0 (dense) or >= top_k, "
                f"got num_experts={self.num_experts}, top_k={self.top_k}"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"TinyLMConfig.capacity_factor must be None or > 0, got {self.capacity_factor}")
        if self.aux_loss_coef < 0 or self.z_loss_coef < 0:
            raise ValueError(
                f"TinyLMConfig.aux_loss_coef and z_loss_coef must be >= 0, "
                f"got {self.aux_loss_coef}, {self.z_loss_coef}"
            )

    @property
    def dense(self) -> bool:
        """Whether the FFN is one dense SwiGLU."""
        return self.num_experts == 0


@dataclass(frozen=True, kw_only=True)
class TinyTrainConfig:
    """One training run: the model, the corpus and the optimisation (AdamW, warmup, cosine decay).

    ``threads``: torch intra-op threads while training. One is the default: these matmuls are too small
    to share, and on a shared CPU two spinning OpenMP threads ran ~5x slower than one here; it also makes
    a run's numbers independent of the machine's core count. Run shards in parallel to use more cores.
    """

    model: TinyLMConfig = TinyLMConfig()
    corpus: str = "stdlib"
    max_corpus_bytes: int = 0
    heldout_every: int = 10
    steps: int = 400
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    eval_interval: int = 100
    eval_sequences: int = 64
    threads: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        validate_config(self)
        for name in ("steps", "batch_size", "eval_interval", "eval_sequences", "heldout_every", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"TinyTrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.heldout_every < 2:
            raise ValueError(f"TinyTrainConfig.heldout_every must be >= 2, got {self.heldout_every}")
        if self.max_corpus_bytes < 0 or self.warmup_steps < 0:
            raise ValueError("TinyTrainConfig.max_corpus_bytes and warmup_steps must be >= 0")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.grad_clip > 0):
            raise ValueError(
                "TinyTrainConfig needs lr > 0, 0 <= min_lr_ratio <= 1, grad_clip > 0, got "
                f"lr={self.lr}, min_lr_ratio={self.min_lr_ratio}, grad_clip={self.grad_clip}"
            )


# --------------------------------------------------------------------------------------------- model
class Attention(nn.Module):
    """Causal multi-head self-attention (PyTorch's scaled_dot_product_attention)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x_BSD: Tensor) -> Tensor:
        batch, seq, dim = x_BSD.shape
        q, k, v = self.qkv(x_BSD).view(batch, seq, 3, self.heads, dim // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(batch, seq, dim))


class Block(nn.Module):
    """Pre-norm transformer block: attention, then a dense or MoE SwiGLU feed-forward."""

    def __init__(self, dim: int, heads: int, ffn: nn.Module) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(dim), Attention(dim, heads)
        self.ffn_norm, self.ffn = nn.RMSNorm(dim), ffn

    def forward(self, x_BSD: Tensor) -> Tensor:
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD))
        return x_BSD + self.ffn(self.ffn_norm(x_BSD))


class DenseFFN(moe.SharedExperts):
    """One dense SwiGLU mapping [..., D] to [..., D] (moe's fused shared-expert SwiGLU, ungated)."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.reshape(-1, self.dim)).view(x.shape)


def build_ffn(config: TinyLMConfig) -> nn.Module:
    """The feed-forward of one block: a dense SwiGLU, or a moe.MoE with experts of the same size."""
    if config.dense:
        return DenseFFN(config.dim, config.hidden_dim)
    return moe.MoE(
        config.dim,
        config.hidden_dim,
        config.num_experts,
        config.top_k,
        router=config.router,
        capacity_factor=config.capacity_factor,
        aux_loss_coef=config.aux_loss_coef,
        z_loss_coef=config.z_loss_coef,
    )


class TinyMoELM(nn.Module):
    """Byte-level decoder: embeddings, ``layers`` blocks, tied output head; logits [B, S, V]."""

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(VOCAB_SIZE, config.dim)
        self.pos = nn.Parameter(torch.zeros(config.seq_len, config.dim))
        self.blocks = nn.ModuleList(
            Block(config.dim, config.heads, build_ffn(config)) for _ in range(config.layers)
        )
        self.norm = nn.RMSNorm(config.dim)
        nn.init.normal_(self.embed.weight, std=0.02)  # small tied logits: the first loss is about ln 256

    def forward(self, tokens_BS: Tensor) -> Tensor:
        x_BSD = self.embed(tokens_BS) + self.pos[: tokens_BS.shape[1]]
        for block in self.blocks:
            x_BSD = block(x_BSD)
        return self.norm(x_BSD) @ self.embed.weight.T


def count_params(config: TinyLMConfig) -> dict[str, int]:
    """Total parameters, and those one token uses (routed experts: K of E), of the model ``config`` builds."""
    with torch.device("meta"):
        model = TinyMoELM(config)
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for layer in moe.moe_layers(model) for p in layer.experts.parameters())
    unused = 0 if config.dense else expert * (config.num_experts - config.top_k) // config.num_experts
    return {"total": total, "active": total - unused}


def active_flops_per_token(config: TinyLMConfig) -> int:
    """Forward matmul FLOPs per token (2 per multiply-add), routed experts counted K times.

    Per layer: QKV and output projections 8D², attention scores and values 4D·(S+1)/2 (mean causal
    context), FFN 6DH·K (dense: K = 1), router 2DE; plus the tied head 2DV. Norms, softmax and the
    dispatch are not counted.
    """
    d, s, h = config.dim, config.seq_len, config.hidden_dim
    k = 1 if config.dense else config.top_k
    per_layer = 8 * d * d + 2 * d * (s + 1) + 6 * d * h * k + 2 * d * config.num_experts
    return config.layers * per_layer + 2 * d * VOCAB_SIZE


# --------------------------------------------------------------------------------------------- training
@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` torch intra-op threads, then restore the previous number."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def load_imbalance(counts_E: Tensor) -> dict[str, float]:
    """max/mean and coefficient of variation (population std / mean) of per-expert slot counts."""
    counts = counts_E.double()
    mean = counts.mean()
    if mean == 0:
        return {"max_over_mean": float("nan"), "cv": float("nan")}
    return {"max_over_mean": float(counts.max() / mean), "cv": float(counts.std(unbiased=False) / mean)}


def _layer_stats(layers: list[moe.MoE]) -> dict[str, Any]:
    """Drop fraction and router-load imbalance (before dropping) per layer, and their means."""
    if not layers:
        return {}
    per_layer = [{**load_imbalance(layer.routed_counts), **layer.stats()} for layer in layers]
    mean = lambda key: sum(s[key] for s in per_layer) / len(per_layer)  # noqa: E731
    return {
        "drop_fraction": mean("drop_fraction"),
        "load_max_over_mean": mean("max_over_mean"),
        "load_cv": mean("cv"),
        "routed_counts": [s["routed_counts"] for s in per_layer],
    }


@torch.no_grad()
def evaluate(model: TinyMoELM, windows_NX: Tensor, batch_size: int) -> dict[str, Any]:
    """Held-out loss (nats/byte, eval mode) over ``windows_NX``, in batches of the training size.

    Capacity applies per forward over its B·S tokens, as in training; returns the loss, perplexity,
    bits per byte, and the MoE drop fraction and load imbalance over the held-out tokens.
    """
    was_training = model.training
    model.eval()
    layers = moe.moe_layers(model)
    for layer in layers:
        layer.reset_stats()
    total, count = 0.0, 0
    for chunk in windows_NX.split(batch_size):
        logits = model(chunk[:, :-1])
        total += F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), chunk[:, 1:].reshape(-1), reduction="sum")
        count += chunk[:, 1:].numel()
    model.train(was_training)
    loss = float(total) / count
    return {"loss": loss, "ppl": math.exp(loss), "bpb": loss / math.log(2), **_layer_stats(layers)}


def train_step(
    model: TinyMoELM,
    optimizer: torch.optim.Optimizer,
    inputs_BS: Tensor,
    targets_BS: Tensor,
    grad_clip: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """One optimizer step on LM loss + the MoE router losses; returns (lm_loss, router_loss, grad_norm)."""
    logits = model(inputs_BS)
    lm_loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets_BS.reshape(-1))
    router_loss = moe.collect_aux_losses(model)
    (lm_loss + router_loss).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return lm_loss.detach(), router_loss.detach(), grad_norm


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW(β = (0.9, 0.95), no weight decay)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def _lr_at(config: TinyTrainConfig, step: int) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * (
        config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


def train(
    config: TinyTrainConfig,
    *,
    log: Callable[[dict[str, Any], int], None] | None = None,
    corpus: Corpus | None = None,
) -> tuple[TinyMoELM, dict[str, Any]]:
    """Train ``config`` from scratch (seeded); ``log(metrics, step)`` gets every step and every evaluation.

    Returns the trained model (eval mode) and a JSON summary: sizes, FLOPs, the final held-out
    evaluation, mean training drop fraction, training throughput and the evaluation curve.
    """
    with torch_threads(config.threads):
        return _train(config, log, corpus)


def _train(
    config: TinyTrainConfig,
    log: Callable[[dict[str, Any], int], None] | None,
    corpus: Corpus | None,
) -> tuple[TinyMoELM, dict[str, Any]]:
    log = log or (lambda metrics, step: None)
    corpus = corpus or load_corpus(
        config.corpus, heldout_every=config.heldout_every, max_bytes=config.max_corpus_bytes
    )
    mc = config.model
    torch.manual_seed(config.seed)
    model = TinyMoELM(mc)
    layers = moe.moe_layers(model)
    optimizer = make_optimizer(model, config.lr)
    windows = heldout_windows(corpus.heldout, config.eval_sequences, mc.seq_len)
    generator = torch.Generator().manual_seed(config.seed)
    tokens_per_step = config.batch_size * mc.seq_len
    curve: list[dict[str, float]] = []
    step_seconds: list[float] = []
    drop_sum = 0.0
    model.train()
    for step in range(1, config.steps + 1):
        inputs, targets = sample_batch(corpus.train, config.batch_size, mc.seq_len, generator)
        lr = _lr_at(config, step - 1)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for layer in layers:
            layer.reset_stats()
        started = time.perf_counter()
        lm_loss, router_loss, grad_norm = train_step(model, optimizer, inputs, targets, config.grad_clip)
        elapsed = time.perf_counter() - started
        step_seconds.append(elapsed)
        stats = _layer_stats(layers)
        drop_sum += stats.get("drop_fraction", 0.0)
        record = {
            "loss": lm_loss.item(),
            "router_loss": router_loss.item(),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens_per_s": tokens_per_step / elapsed,
        }
        if layers:
            record |= {k: stats[k] for k in ("drop_fraction", "load_max_over_mean", "load_cv")}
        if step % config.eval_interval == 0 or step == config.steps:
            heldout = evaluate(model, windows, config.batch_size)
            record |= {f"eval_{k}": v for k, v in heldout.items() if k != "routed_counts"}
            curve.append({"step": step, "loss": heldout["loss"]})
        log(record, step)
    model.eval()
    params = count_params(mc)
    return model, {
        "params_total": params["total"],
        "params_active": params["active"],
        "active_flops_per_token": active_flops_per_token(mc),
        "train_tokens": config.steps * tokens_per_step,
        "train_seconds": sum(step_seconds),
        # the median step: robust to other jobs on a shared machine; the mean includes their bursts
        "tokens_per_s": tokens_per_step / statistics.median(step_seconds),
        "tokens_per_s_mean": len(step_seconds) * tokens_per_step / sum(step_seconds),
        "threads": torch.get_num_threads(),
        "train_drop_fraction": drop_sum / config.steps if layers else None,
        "heldout": heldout,
        "curve": curve,
        "corpus": corpus.info,
    }


# --------------------------------------------------------------------------------------------- routing
@torch.no_grad()
def routed_experts(model: TinyMoELM, stream: Tensor, num_tokens: int) -> list[Tensor]:
    """The router's choices for the first ``num_tokens`` bytes of ``stream``, per MoE layer: [T, K] each.

    The stream is fed in consecutive chunks of S bytes (eval mode), so row t is the routing of byte t of
    contiguous text; capacity dropping does not change the choices recorded here.
    """
    layers = moe.moe_layers(model)
    if not layers:
        raise ValueError("model has no MoE layers (dense FFN): nothing is routed")
    seq_len = model.config.seq_len
    if not 0 < num_tokens <= stream.numel():
        raise ValueError(f"num_tokens must be in [1, {stream.numel()}] (the stream length), got {num_tokens}")
    captured: list[list[Tensor]] = [[] for _ in layers]
    hooks = [
        layer.router.register_forward_hook(lambda _m, _in, out, i=i: captured[i].append(out.experts_TK))
        for i, layer in enumerate(layers)
    ]
    model.eval()
    try:
        for start in range(0, num_tokens, seq_len):
            model(stream[start : min(start + seq_len, num_tokens)].long().unsqueeze(0))
    finally:
        for hook in hooks:
            hook.remove()
    return [torch.cat(parts) for parts in captured]


def save_checkpoint(model: TinyMoELM, path: Path) -> None:
    """The weights as safetensors."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


def load_checkpoint(config: TinyLMConfig, path: Path) -> TinyMoELM:
    """A model for ``config`` with the weights at ``path`` (safetensors; strict), in eval mode."""
    from safetensors.torch import load_file

    model = TinyMoELM(config)
    model.load_state_dict(load_file(str(path)), strict=True)
    return model.eval()
