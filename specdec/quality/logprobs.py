"""Per-token log-probabilities of a token sequence under a target: the one formula every quality
measure here uses (perplexity, KL divergence, and the server's prompt log-probs).

Legend: T sequence length, N scored positions, V vocabulary.

The log-probability of token ``ids[t]`` after ``ids[:t]`` is
``torch.log_softmax(logits.float(), dim=-1)[t - 1, ids[t]]``, with the target's logits from one
forward over the sequence from an empty cache (row 0). Nothing else is applied: no temperature,
top-k or top-p.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.protocols import Target

__all__ = ["log_softmax", "sequence_logits", "token_logprobs"]


def log_softmax(logits_NV: torch.Tensor) -> torch.Tensor:
    """``torch.log_softmax(logits_NV.float(), dim=-1)``: the log-probabilities of every quality
    measure here, in float32 whatever the target's dtype."""
    return torch.log_softmax(logits_NV.float(), dim=-1)


def _check_ids(target: Target, ids: Sequence[int] | torch.Tensor, argument: str) -> torch.Tensor:
    """``ids`` as a 1-D int64 tensor on the target's device; ``ValueError`` naming ``argument``."""
    try:
        ids_T = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{argument} must be a 1-D sequence of token ids, got {type(ids).__name__}") from err
    if ids_T.dim() != 1 or ids_T.numel() < 1 or ids_T.dtype.is_floating_point or ids_T.dtype == torch.bool:
        raise ValueError(
            f"{argument} must be a non-empty 1-D sequence of integer token ids, "
            f"got shape {tuple(ids_T.shape)} of {ids_T.dtype}"
        )
    low, high = int(ids_T.min()), int(ids_T.max())
    if low < 0 or high >= target.vocab_size:
        raise ValueError(f"{argument} must hold ids in [0, {target.vocab_size}), got ids in [{low}, {high}]")
    limit = getattr(target, "max_context_length", None)
    if limit and ids_T.numel() > limit:
        raise ValueError(
            f"{argument} holds {ids_T.numel()} tokens, more than the target's context of {limit}"
        )
    return ids_T.to(device=getattr(target, "device", "cpu"), dtype=torch.long)


@torch.inference_mode()
def sequence_logits(
    target: Target, ids: Sequence[int] | torch.Tensor, *, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """The target's logits ``[T, V]`` (or ``[N, V]`` at ``positions``, block positions in
    ``[0, T)``) from one forward over ``ids`` from an empty cache. The target's cache is reset."""
    ids_T = _check_ids(target, ids, "ids")
    T = ids_T.numel()
    index_1N = None
    if positions is not None:
        index_1N = torch.as_tensor(positions, dtype=torch.long, device=ids_T.device).reshape(1, -1)
        if index_1N.numel() and (int(index_1N.min()) < 0 or int(index_1N.max()) >= T):
            raise ValueError(f"positions must lie in [0, {T}), got {index_1N.min()}..{index_1N.max()}")
    target.reset(1, T)
    start_1 = torch.zeros(1, dtype=torch.long, device=ids_T.device)
    out = target.forward(ids_T.unsqueeze(0), start_1, logits_index_BN=index_1N)
    return out.logits_BTV[0]


def token_logprobs(target: Target, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """``[T - 1]`` float32: ``log p(ids[t] | ids[:t])`` for t = 1 .. T-1 under ``target``
    (:func:`log_softmax` of its logits, gathered at the next token). The first token has none."""
    ids_T = _check_ids(target, ids, "ids")
    if ids_T.numel() < 2:
        return torch.zeros(0, dtype=torch.float32, device=ids_T.device)
    logits_NV = sequence_logits(target, ids_T, positions=torch.arange(ids_T.numel() - 1))
    return log_softmax(logits_NV).gather(-1, ids_T[1:, None])[:, 0]
