"""Speculative verification by rejection sampling (chain drafts).

Legend: B batch, K draft length (γ), V vocabulary.

Leviathan et al. 2023 (arXiv 2211.17192, Algorithm 1) and Chen et al. 2023 (arXiv 2302.01318,
Algorithm 2). With ``target_probs`` the target's processed distribution and ``draft_probs`` the
drafter's, at each draft position k in order:

- **accepted token**: the draft token x_k is kept with probability min(1, target(x_k) / draft(x_k));
- **recovered token**: at the first rejection, a token is drawn from
  norm(max(target_probs − draft_probs, 0)) at that position and the row stops there;
- **bonus token**: if all K drafts are accepted, one more token is drawn from the target's
  distribution at position K (the (K+1)-th row of ``target_probs``).

Each row therefore emits between 1 and K+1 tokens, and every emitted token is distributed exactly
as the target's processed distribution given the tokens before it.

``draft_probs=None`` means a deterministic (point-mass) proposal, as from n-gram lookup or a greedy
drafter: draft(x_k) = 1, so x_k is kept with probability target(x_k), and the residual is the target
with x_k removed.

Edge cases, all exact:

- draft(x) == target(x): accepted with probability 1, no 0/0.
- draft(x) == 0 (the drafter proposed a token it gives no mass): always rejected.
- A residual with zero mass can only be reached with probability 0 under a consistent proposal
  (it needs target ≤ draft everywhere, which makes acceptance certain). It is reached through an
  inconsistent proposal (draft(x) == 0); then the recovered token is drawn from the target itself.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec.host_sync import avoids_host
from specdec.sampling import sample_from_probs

__all__ = ["VerifyResult", "greedy_verify", "rejection_sample", "validate_verify_inputs"]

# Tolerance on Σ probs = 1 (float32 sums over a 50k vocabulary are off by ~1e-5).
_NORM_ATOL = 1e-3


class VerifyResult(NamedTuple):
    """``tokens [B, K+1]``: accepted drafts, then one recovered or bonus token, then ``-1`` padding.
    ``num_accepted [B]``: how many draft tokens were accepted (0..K)."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor


def _check_probs(name: str, probs: torch.Tensor) -> None:
    if not probs.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {probs.dtype}")
    if probs.numel() == 0:
        return
    if torch.isnan(probs).any():
        raise ValueError(f"{name} contains NaN")
    if (probs < 0).any():
        raise ValueError(f"{name} contains negative probabilities (min {probs.min().item():.3g})")
    sums = probs.double().sum(dim=-1)
    worst = (sums - 1.0).abs().max().item()
    if worst > _NORM_ATOL:
        raise ValueError(
            f"{name} must be normalised over the last (vocab) dim: a row sums to "
            f"{sums.flatten()[(sums - 1.0).abs().flatten().argmax()].item():.6g} (tolerance {_NORM_ATOL})"
        )


def validate_verify_inputs(
    target_probs_BKV: torch.Tensor,
    draft_tokens_BK: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None,
) -> None:
    """Raise ``ValueError`` naming the argument when shapes, vocabularies or values are wrong."""
    if not isinstance(target_probs_BKV, torch.Tensor) or target_probs_BKV.ndim != 3:
        raise ValueError(
            "target_probs_BKV must be a tensor of shape [B, K+1, V], got "
            f"{getattr(target_probs_BKV, 'shape', type(target_probs_BKV).__name__)}"
        )
    if not isinstance(draft_tokens_BK, torch.Tensor) or draft_tokens_BK.ndim != 2:
        raise ValueError(
            "draft_tokens_BK must be a tensor of shape [B, K], got "
            f"{getattr(draft_tokens_BK, 'shape', type(draft_tokens_BK).__name__)}"
        )
    B, K1, V = target_probs_BKV.shape
    if draft_tokens_BK.shape[0] != B:
        raise ValueError(
            f"batch mismatch: draft_tokens_BK has B={draft_tokens_BK.shape[0]}, target_probs_BKV has B={B}"
        )
    K = draft_tokens_BK.shape[1]
    if K1 != K + 1:
        raise ValueError(
            f"draft length mismatch: target_probs_BKV must have K+1={K + 1} positions for K={K} draft "
            f"tokens, got {K1}"
        )
    if V < 1:
        raise ValueError("target_probs_BKV must have a vocab dim V >= 1")
    if draft_tokens_BK.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ValueError(f"draft_tokens_BK must be an integer tensor, got dtype {draft_tokens_BK.dtype}")
    if draft_tokens_BK.device != target_probs_BKV.device:
        raise ValueError(
            f"draft_tokens_BK is on {draft_tokens_BK.device}, target_probs_BKV on {target_probs_BKV.device}"
        )
    if draft_tokens_BK.numel() and (int(draft_tokens_BK.min()) < 0 or int(draft_tokens_BK.max()) >= V):
        raise ValueError(
            f"draft_tokens_BK must lie in [0, V={V}), got values in "
            f"[{int(draft_tokens_BK.min())}, {int(draft_tokens_BK.max())}]"
        )
    _check_probs("target_probs_BKV", target_probs_BKV)
    if draft_probs_BKV is not None:
        if not isinstance(draft_probs_BKV, torch.Tensor) or draft_probs_BKV.ndim != 3:
            raise ValueError(
                "draft_probs_BKV must be None or a tensor of shape [B, K, V], got "
                f"{getattr(draft_probs_BKV, 'shape', type(draft_probs_BKV).__name__)}"
            )
        if draft_probs_BKV.shape[:2] != (B, K):
            raise ValueError(
                f"draft_probs_BKV must have shape [B={B}, K={K}, V], got {tuple(draft_probs_BKV.shape)}"
            )
        if draft_probs_BKV.shape[2] != V:
            raise ValueError(
                f"vocab mismatch: draft_probs_BKV has V={draft_probs_BKV.shape[2]}, "
                f"target_probs_BKV has V={V}"
            )
        if draft_probs_BKV.device != target_probs_BKV.device:
            raise ValueError(
                f"draft_probs_BKV is on {draft_probs_BKV.device}, target_probs_BKV on "
                f"{target_probs_BKV.device}"
            )
        _check_probs("draft_probs_BKV", draft_probs_BKV)


def rejection_sample(
    target_probs_BKV: torch.Tensor,
    draft_tokens_BK: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
    validate: bool = True,
) -> VerifyResult:
    """Verify K draft tokens per row against the target; keep the target distribution exactly.

    Args:
        target_probs_BKV: ``[B, K+1, V]`` target probabilities at each draft position and one more
            (for the bonus token), already processed by :func:`specdec.sampling.logits_to_probs`.
        draft_tokens_BK: ``[B, K]`` proposed token ids.
        draft_probs_BKV: ``[B, K, V]`` drafter probabilities the tokens were sampled from, processed
            by the same function; ``None`` for a deterministic (point-mass) proposal.
        generator: source of randomness; the same seed gives the same tokens.
        validate: check shapes and values (on by default; switch off in a hot loop whose inputs
            are known to be valid).

    Returns:
        ``VerifyResult(tokens [B, K+1] long, num_accepted [B] long)``: per row the accepted drafts,
        one recovered or bonus token, then ``-1`` padding.

    Implements Leviathan et al. 2023 (arXiv 2211.17192), Algorithm 1; Chen et al. 2023
    (arXiv 2302.01318), Algorithm 2.
    """
    if validate:
        validate_verify_inputs(target_probs_BKV, draft_tokens_BK, draft_probs_BKV)
    B, K1, V = target_probs_BKV.shape
    K = K1 - 1
    device = target_probs_BKV.device
    # float64 inputs stay float64 (exact enumeration in specdec.testing); narrower ones run in float32.
    work_dtype = torch.float64 if target_probs_BKV.dtype == torch.float64 else torch.float32
    target_probs_BKV = target_probs_BKV.to(work_dtype)
    draft_tokens_BK = draft_tokens_BK.long()

    # --- accept / reject each draft token -------------------------------------------------
    target_at_draft_BK = target_probs_BKV[:, :K].gather(-1, draft_tokens_BK.unsqueeze(-1)).squeeze(-1)
    if draft_probs_BKV is None:
        draft_at_draft_BK = torch.ones_like(target_at_draft_BK)
    else:
        draft_probs_BKV = draft_probs_BKV.to(work_dtype)
        draft_at_draft_BK = draft_probs_BKV.gather(-1, draft_tokens_BK.unsqueeze(-1)).squeeze(-1)
    # drawn on the generator's device (a CPU generator gives the same numbers for probabilities on
    # any device), then moved to the probabilities'
    drawn_on = generator.device if generator is not None else device
    u_BK = torch.rand((B, K), generator=generator, device=drawn_on).to(device)
    # u < target/draft  <=>  u * draft < target: P(accept) = min(1, target/draft), no division,
    # p == q accepts surely (u < 1), draft == 0 is rejected explicitly.
    accepted_BK = (u_BK * draft_at_draft_BK < target_at_draft_BK) & (draft_at_draft_BK > 0)
    # Number of leading accepts: the row stops at its first rejection.
    num_accepted_B = accepted_BK.long().cumprod(dim=-1).sum(dim=-1)

    # --- one recovered (first rejection) or bonus (all accepted) token per row -----------
    rows_B = torch.arange(B, device=device)
    stop_B = num_accepted_B  # position of the recovered/bonus token, in 0..K
    target_at_stop_BV = target_probs_BKV[rows_B, stop_B]
    rejected_B = stop_B < K
    if K > 0 and (avoids_host(rejected_B) or bool(rejected_B.any())):  # no host read on a device
        stop_clamped_B = stop_B.clamp(max=K - 1)
        if draft_probs_BKV is None:
            draft_at_stop_BV = torch.zeros_like(target_at_stop_BV)
            draft_at_stop_BV[rows_B, draft_tokens_BK[rows_B, stop_clamped_B]] = 1.0
        else:
            draft_at_stop_BV = draft_probs_BKV[rows_B, stop_clamped_B]
        residual_BV = (target_at_stop_BV - draft_at_stop_BV).clamp_(min=0.0)
        # A residual with no mass is unreachable under a consistent proposal (see module doc);
        # fall back to the target so the output is still a valid target sample.
        empty_B = residual_BV.sum(dim=-1) <= 0
        residual_BV = torch.where(empty_B.unsqueeze(-1), target_at_stop_BV, residual_BV)
        # Bonus rows (all accepted) draw from the target itself.
        stop_dist_BV = torch.where(rejected_B.unsqueeze(-1), residual_BV, target_at_stop_BV)
    else:
        stop_dist_BV = target_at_stop_BV
    stop_token_B = sample_from_probs(stop_dist_BV, generator, validate=not avoids_host(stop_dist_BV))

    # --- assemble [accepted..., recovered/bonus, -1...] -----------------------------------
    positions_K1 = torch.arange(K + 1, device=device)
    tokens_BK1 = torch.full((B, K + 1), -1, dtype=torch.long, device=device)
    if K > 0:
        keep_BK = positions_K1[:K].unsqueeze(0) < num_accepted_B.unsqueeze(1)
        tokens_BK1[:, :K] = torch.where(keep_BK, draft_tokens_BK, tokens_BK1[:, :K])
    tokens_BK1[rows_B, stop_B] = stop_token_B
    return VerifyResult(tokens_BK1, num_accepted_B)


def greedy_verify(target_logits_BKV: torch.Tensor, draft_tokens_BK: torch.Tensor) -> VerifyResult:
    """:func:`rejection_sample` at temperature 0 for a point-mass proposal, without probabilities.

    The target's processed distribution is then the one-hot of its argmax (ties to the lowest id,
    as :func:`specdec.sampling.logits_to_probs`), so a draft token is accepted exactly when it is
    the argmax, and the recovered or bonus token is the argmax at the first mismatch (or after the
    last draft): the same tokens ``rejection_sample`` returns for those inputs, without building
    ``[B, K+1, V]`` one-hot tensors or drawing random numbers.

    Args:
        target_logits_BKV: ``[B, K+1, V]`` target logits (any temperature-free scale).
        draft_tokens_BK: ``[B, K]`` proposed token ids.
    """
    if target_logits_BKV.ndim != 3 or draft_tokens_BK.ndim != 2:
        raise ValueError(
            f"target_logits_BKV must be [B, K+1, V] and draft_tokens_BK [B, K], got "
            f"{tuple(target_logits_BKV.shape)} and {tuple(draft_tokens_BK.shape)}"
        )
    B, K1, _ = target_logits_BKV.shape
    K = K1 - 1
    if draft_tokens_BK.shape != (B, K):
        raise ValueError(
            f"draft_tokens_BK must have shape [B={B}, K={K}], got {tuple(draft_tokens_BK.shape)}"
        )
    if not avoids_host(target_logits_BKV) and target_logits_BKV.dtype == torch.float32:
        # numpy's single-threaded argmax (first maximum, as torch's): ATen's parallel one waits on
        # waking OpenMP threads, most of a small decode step's verification on 2 cores
        argmax_BK1 = torch.from_numpy(target_logits_BKV.detach().numpy().argmax(axis=-1))
    else:
        argmax_BK1 = target_logits_BKV.float().argmax(dim=-1)
    match_BK = draft_tokens_BK.long() == argmax_BK1[:, :K]
    num_accepted_B = match_BK.long().cumprod(dim=-1).sum(dim=-1)
    positions_K1 = torch.arange(K1, device=argmax_BK1.device)
    keep_BK1 = positions_K1.unsqueeze(0) <= num_accepted_B.unsqueeze(1)
    return VerifyResult(torch.where(keep_BK1, argmax_BK1, -1), num_accepted_B)
