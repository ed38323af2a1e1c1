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

**Randomness** is public and keyed (:mod:`specdec.verify.noise`): every draw is taken from a
:class:`~specdec.verify.noise.PositionNoise` at the sequence position it decides, not from a
generator consumed in call order:

- **accepted token** at position p: draft x_p is kept iff ``u < target(x_p) / draft(x_p)`` with
  ``u = noise.uniform_BK(p, "accept")``;
- **recovered token** at the first rejection p: Gumbel-max sample
  (:func:`specdec.verify.noise.sample_keyed`) from the residual with stream ``"residual"``;
- **bonus token** after K acceptances: Gumbel-max sample from the target with stream ``"sample"``.

Why it stays exact: the token committed at position p is a function of the prefix, the draft at p
and the noise at p only (acceptance never looks ahead), and the noise at p is independent of the
noise at every other position, of the other streams and of the other rows. A draft drawn with the
``"draft"`` stream or with :func:`specdec.verify.noise.draft_keyed` keeps this; a drafter must never
read the ``"accept"`` or ``"residual"`` streams, and must not choose its depth from draws at
positions it then drops. So a request's output is a function of its seed and the drafter's
proposals, whatever rows share its batch and however the engine splits its steps; ``gumbel``
(:mod:`specdec.verify.gumbel`) removes the dependence on the proposals too.

**Acceptance hook.** ``draft_scale`` l multiplies the draft measure: x_k is kept with probability
min(1, target(x_k) / (l · draft(x_k))) and the residual is norm(max(target − l · draft, 0)). l = 1 is
the exact rule above; ``lenient`` (:mod:`specdec.verify.lenient`) passes its lenience.
"""

from __future__ import annotations

import torch

from specdec.host_sync import avoids_host
from specdec.verify.contract import VerifyResult, validate_keyed_inputs, validate_verify_inputs
from specdec.verify.noise import PositionNoise, sample_with_keys

__all__ = ["greedy_verify", "rejection_sample"]


def rejection_sample(
    target_probs_BKV: torch.Tensor,
    draft_tokens_BK: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None = None,
    *,
    noise: PositionNoise,
    positions_BK: torch.Tensor,
    draft_scale: float = 1.0,
    validate: bool = True,
) -> VerifyResult:
    """Verify K draft tokens per row against the target; keep the target distribution exactly.

    Args:
        target_probs_BKV: ``[B, K+1, V]`` target probabilities at each draft position and one more
            (for the bonus token), already processed by :func:`specdec.sampling.logits_to_probs`.
        draft_tokens_BK: ``[B, K]`` proposed token ids.
        draft_probs_BKV: ``[B, K, V]`` drafter probabilities the tokens were sampled from, processed
            by the same function; ``None`` for a deterministic (point-mass) proposal.
        noise: the rows' public randomness (one seed per row).
        positions_BK: ``[B, K+1]`` integer sequence positions of the tokens the K+1 target rows
            decide (the engine's convention: index of the token in the request's output stream).
        draft_scale: the acceptance hook l (module doc); 1 is exact.
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
        validate_keyed_inputs(noise, positions_BK, target_probs_BKV)
    B, K1, V = target_probs_BKV.shape
    K = K1 - 1
    device = target_probs_BKV.device
    # float64 inputs stay float64 (exact enumeration in specdec.testing); narrower ones run in float32.
    work_dtype = torch.float64 if target_probs_BKV.dtype == torch.float64 else torch.float32
    target_probs_BKV = target_probs_BKV.to(work_dtype)
    draft_tokens_BK = draft_tokens_BK.to(device=device, dtype=torch.long)
    rows_B = torch.arange(B, device=device)

    # --- accept / reject each draft token ---------------------------------------------------------
    target_at_draft_BK = target_probs_BKV[:, :K].gather(-1, draft_tokens_BK.unsqueeze(-1)).squeeze(-1)
    if draft_probs_BKV is None:
        draft_at_draft_BK = torch.ones_like(target_at_draft_BK)
    else:
        draft_probs_BKV = draft_probs_BKV.to(work_dtype)
        draft_at_draft_BK = draft_probs_BKV.gather(-1, draft_tokens_BK.unsqueeze(-1)).squeeze(-1)
    positions_BK = positions_BK.to(dtype=torch.long)
    u_BK = noise.uniform_BK(positions_BK[:, :K], "accept", validate=validate)
    # u < target/(l·draft)  <=>  u·l·draft < target: no division, p == q accepts surely (u < 1),
    # draft == 0 is rejected explicitly.
    accepted_BK = (u_BK * (draft_scale * draft_at_draft_BK) < target_at_draft_BK) & (draft_at_draft_BK > 0)
    # Number of leading accepts: the row stops at its first rejection.
    num_accepted_B = accepted_BK.long().cumprod(dim=-1).sum(dim=-1)

    # --- one recovered (first rejection) or bonus (all accepted) token per row -------------------
    stop_B = num_accepted_B  # position of the recovered/bonus token, in 0..K
    target_at_stop_BV = target_probs_BKV[rows_B, stop_B]
    rejected_B = stop_B < K
    stop_dist_BV = target_at_stop_BV
    if K > 0:
        stop_clamped_B = stop_B.clamp(max=K - 1)
        if draft_probs_BKV is None:
            at_B1 = draft_tokens_BK[rows_B, stop_clamped_B][:, None]
            draft_at_stop_BV = torch.zeros_like(target_at_stop_BV).scatter_(-1, at_B1, 1.0)
        else:
            draft_at_stop_BV = draft_probs_BKV[rows_B, stop_clamped_B]
        residual_BV = (target_at_stop_BV - draft_scale * draft_at_stop_BV).clamp_(min=0.0)
        # A residual with no mass is unreachable under a consistent proposal (see module doc);
        # fall back to the target so the output is still a valid target sample.
        empty_B = residual_BV.sum(dim=-1) <= 0
        residual_BV = torch.where(empty_B.unsqueeze(-1), target_at_stop_BV, residual_BV)
        # Bonus rows (all accepted) draw from the target itself.
        stop_dist_BV = torch.where(rejected_B.unsqueeze(-1), residual_BV, target_at_stop_BV)
    # Every row in one race, each under its own stream's key: no host read of which rows were rejected.
    stop_positions_B = positions_BK[rows_B, stop_B]
    keys_B = torch.where(
        rejected_B,
        noise.keys(stop_positions_B, "residual", validate=False),
        noise.keys(stop_positions_B, "sample", validate=False),
    )
    stop_token_B = sample_with_keys(stop_dist_BV, keys_B)

    # --- assemble [accepted..., recovered/bonus, -1...] -------------------------------------------
    tokens_BK1 = torch.full((B, K + 1), -1, dtype=torch.long, device=device)
    if K > 0:
        keep_BK = torch.arange(K, device=device).unsqueeze(0) < num_accepted_B.unsqueeze(1)
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
