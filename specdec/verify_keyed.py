"""Exact speculative sampling with position-keyed public randomness (chain drafts).

Legend: B batch, K draft length (γ), V vocabulary.

The same rule as :func:`specdec.verify.rejection_sample` (Leviathan et al. 2023, arXiv 2211.17192,
Algorithm 1; Chen et al. 2023, arXiv 2302.01318, Algorithm 2), with every random draw taken from a
:class:`specdec.noise.PositionNoise` at the sequence position it decides instead of a generator
consumed in call order:

- **accepted token** at position p: draft x_p is kept iff ``u < target(x_p) / draft(x_p)`` with
  ``u = noise.uniform_BK(p, "accept")``;
- **recovered token** at the first rejection p: Gumbel-max sample
  (:func:`specdec.noise.sample_keyed`) from ``max(target_p − draft_p, 0)`` with stream ``"residual"``;
- **bonus token** after K acceptances, at position p_K: Gumbel-max sample from ``target`` with
  stream ``"sample"``.

Why it stays exact: the token committed at position p is a function of the prefix, the draft at p
and the noise at p only (acceptance never looks ahead), and the noise at p is independent of the
noise at every other position, of the other streams and of the other rows. So each committed token
is distributed exactly as rejection sampling's, given everything before it. A draft drawn with the
``"draft"`` stream or with :func:`specdec.noise.draft_keyed` (stream ``"sample"``, coupled with the
bonus and ``gumbel`` samples) keeps this; a drafter must never read the ``"accept"`` or
``"residual"`` streams, and must not choose its depth from draws at positions it then drops.

What it buys: a request's output is a function of its seed and the drafter's proposals, whatever
rows share its batch and however the engine splits its steps (the same proposals at the same
positions give the same tokens). It still depends on the proposals; ``gumbel``
(:mod:`specdec.verify_gumbel`) removes that too, at a lower acceptance rate.
"""

from __future__ import annotations

import torch

from specdec.noise import PositionNoise, sample_with_keys
from specdec.verify import VerifyResult, validate_verify_inputs

__all__ = ["rejection_sample_keyed", "validate_keyed_inputs"]


def validate_keyed_inputs(
    noise: PositionNoise, positions_BK: torch.Tensor, target_probs_BKV: torch.Tensor
) -> None:
    """Raise ``ValueError`` unless ``noise`` serves the B rows of ``target_probs_BKV [B, K1, V]`` on its
    device and ``positions_BK`` is an integer ``[B, K1]`` tensor of positions >= 0 on that device."""
    B, K1 = target_probs_BKV.shape[:2]
    if not isinstance(noise, PositionNoise):
        raise ValueError(f"noise must be a specdec.noise.PositionNoise, got {type(noise).__name__}")
    if noise.num_rows != B:
        raise ValueError(f"noise has {noise.num_rows} rows (seeds), the batch has B={B}")
    if not isinstance(positions_BK, torch.Tensor) or tuple(positions_BK.shape) != (B, K1):
        raise ValueError(
            f"positions_BK must be a tensor [B={B}, {K1}]: the sequence position of the token each target "
            f"row decides, got {tuple(getattr(positions_BK, 'shape', ())) or type(positions_BK).__name__}"
        )
    if positions_BK.device != noise.device or noise.device != target_probs_BKV.device:
        raise ValueError(
            f"noise ({noise.device}), positions_BK ({positions_BK.device}) and the probabilities "
            f"({target_probs_BKV.device}) must be on one device"
        )
    noise.check_positions(positions_BK)


def rejection_sample_keyed(
    target_probs_BKV: torch.Tensor,
    draft_tokens_BK: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None = None,
    *,
    noise: PositionNoise,
    positions_BK: torch.Tensor,
    validate: bool = True,
) -> VerifyResult:
    """:func:`specdec.verify.rejection_sample` with the randomness of each position keyed by it.

    Args:
        target_probs_BKV: ``[B, K+1, V]`` processed target probabilities at the K draft positions and
            the bonus position.
        draft_tokens_BK: ``[B, K]`` proposed token ids.
        draft_probs_BKV: ``[B, K, V]`` drafter probabilities, or ``None`` for point-mass proposals.
        noise: the rows' public randomness (one seed per row).
        positions_BK: ``[B, K+1]`` integer sequence positions of the tokens the K+1 target rows decide
            (the engine's convention: index of the token in the request's stream).
        validate: check shapes and values.

    Returns:
        ``VerifyResult(tokens [B, K+1], num_accepted [B])`` exactly as ``rejection_sample``.

    Leviathan et al. 2023 (arXiv 2211.17192), Algorithm 1; the draws are described in the module doc.
    """
    if validate:
        validate_verify_inputs(target_probs_BKV, draft_tokens_BK, draft_probs_BKV)
        validate_keyed_inputs(noise, positions_BK, target_probs_BKV)
    B, K1, V = target_probs_BKV.shape
    K = K1 - 1
    device = target_probs_BKV.device
    work_dtype = torch.float64 if target_probs_BKV.dtype == torch.float64 else torch.float32
    target_probs_BKV = target_probs_BKV.to(work_dtype)
    draft_tokens_BK = draft_tokens_BK.to(device=device, dtype=torch.long)
    positions_BK = positions_BK.to(dtype=torch.long)
    rows_B = torch.arange(B, device=device)

    # --- accept / reject each draft token: u at each draft position, stream "accept" -------------
    target_at_draft_BK = target_probs_BKV[:, :K].gather(-1, draft_tokens_BK.unsqueeze(-1)).squeeze(-1)
    if draft_probs_BKV is None:
        draft_at_draft_BK = torch.ones_like(target_at_draft_BK)
    else:
        draft_probs_BKV = draft_probs_BKV.to(work_dtype)
        draft_at_draft_BK = draft_probs_BKV.gather(-1, draft_tokens_BK.unsqueeze(-1)).squeeze(-1)
    u_BK = noise.uniform_BK(positions_BK[:, :K], "accept", validate=validate)
    # u < target/draft  <=>  u·draft < target (float64 u); draft == 0 is rejected.
    accepted_BK = (u_BK * draft_at_draft_BK < target_at_draft_BK) & (draft_at_draft_BK > 0)
    num_accepted_B = accepted_BK.long().cumprod(dim=-1).sum(dim=-1)

    # --- one recovered (stream "residual") or bonus (stream "sample") token per row ---------------
    # Every row in one race, each under its own stream's key (the same token as racing the rejected
    # and the bonus rows apart: a row's race reads only its weights and its key), with no host read
    # of which rows were rejected.
    stop_B = num_accepted_B
    stop_positions_B = positions_BK[rows_B, stop_B]
    target_at_stop_BV = target_probs_BKV[rows_B, stop_B]
    rejected_B = stop_B < K
    stop_dist_BV = target_at_stop_BV
    if K > 0:
        draft_tokens_B = draft_tokens_BK[rows_B, stop_B.clamp(max=K - 1)]
        if draft_probs_BKV is None:
            draft_at_stop_BV = torch.zeros_like(target_at_stop_BV).scatter_(-1, draft_tokens_B[:, None], 1.0)
        else:
            draft_at_stop_BV = draft_probs_BKV[rows_B, stop_B.clamp(max=K - 1)]
        residual_BV = (target_at_stop_BV - draft_at_stop_BV).clamp_(min=0.0)
        # Zero residual mass is unreachable under a consistent proposal (specdec.verify's module doc).
        empty_B = residual_BV.sum(dim=-1) <= 0
        residual_BV = torch.where(empty_B.unsqueeze(-1), target_at_stop_BV, residual_BV)
        stop_dist_BV = torch.where(rejected_B.unsqueeze(-1), residual_BV, target_at_stop_BV)
    keys_B = torch.where(
        rejected_B,
        noise.keys(stop_positions_B, "residual", validate=False),
        noise.keys(stop_positions_B, "sample", validate=False),
    )
    stop_token_B = sample_with_keys(stop_dist_BV, keys_B)

    # --- assemble [accepted..., recovered/bonus, -1...] ----------------------------------------
    tokens_BK1 = torch.full((B, K + 1), -1, dtype=torch.long, device=device)
    if K > 0:
        keep_BK = torch.arange(K, device=device).unsqueeze(0) < num_accepted_B.unsqueeze(1)
        tokens_BK1[:, :K] = torch.where(keep_BK, draft_tokens_BK, tokens_BK1[:, :K])
    tokens_BK1[rows_B, stop_B] = stop_token_B
    return VerifyResult(tokens_BK1, num_accepted_B)
