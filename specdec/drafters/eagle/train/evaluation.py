"""How good the trained head is on held-out data: top-1 agreement with the target on held-out
windows during training (:func:`heldout_accuracy`), and α and τ of real speculative decoding of
held-out prompts after it (:func:`evaluate_heldout`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.drafters.eagle import EagleHead
from specdec.drafters.eagle.train.config import TrainConfig
from specdec.drafters.eagle.train.dataset import FeatureData
from specdec.drafters.eagle.train.objective import Batches, unrolled_losses

__all__ = ["evaluate_heldout", "heldout_accuracy"]


@torch.no_grad()
def heldout_accuracy(
    head: EagleHead,
    data: FeatureData,
    seqs: list[int],
    vocab_index_V: torch.Tensor,
    cfg: TrainConfig,
    feature_std: float,
    max_windows: int = 24,
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
    from specdec.drafters.eagle.train.sources import load_prompts
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
