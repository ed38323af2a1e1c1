"""A lossy verification rule: lenient speculative sampling (Leviathan et al. 2023, Appendix A.5).

Legend: B batch, K draft length (γ), V vocabulary.

With lenience l ∈ (0, 1], the draft probability is multiplied by l before it is compared with the
target's (arXiv 2211.17192, §A.5). At each draft position, in order:

- **accepted token**: draft token x is kept with probability min(1, target(x) / (l · draft(x)))
  (a point-mass proposal has draft(x) = 1);
- **recovered token**: at the first rejection, a token is drawn from
  norm(max(target − l · draft, 0)) (the target itself if that has no mass);
- **bonus token**: after K acceptances, a token is drawn from the target at position K+1.

l = 1 is exact speculative sampling (:func:`specdec.verify.rejection_sample`, which this rule then
calls). For l < 1 the output is no longer the target's distribution, with the guarantee the paper
states: no token is emitted with probability above target(x) / l, so rare tokens stay rare. The
acceptance probability per token becomes Σ_x min(target(x) / l, draft(x)).

**Greedy** (temperature 0): the processed target is one-hot, so the rule above changes nothing.
As in §A.5, lenience then applies *before* standardisation, to the raw target distribution
p = softmax(logits): draft x is accepted when p(x) ≥ l · max p (the paper's text prints the
inequality reversed; accepting only tokens at least l times as likely as the argmax is its
intent, and l = 1 gives plain argmax matching). Recovered and bonus tokens are the target's argmax.
"""

from __future__ import annotations

import math

import torch

from specdec.sampling import SamplingParams, sample_from_probs
from specdec.verify import VerifyResult, rejection_sample, validate_verify_inputs

__all__ = ["LenientVerify", "lenient_sample"]


def lenient_sample(
    target_probs_BKV: torch.Tensor,
    draft_tokens_BK: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None,
    *,
    lenience: float,
    target_logits_BKV: torch.Tensor | None = None,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    validate: bool = True,
) -> VerifyResult:
    """Lenient verification of K draft tokens per row (see the module doc); same I/O as ``rejection_sample``.

    ``greedy=True`` uses the temperature-0 rule on ``target_logits_BKV`` (required then).
    Leviathan et al. 2023 (arXiv 2211.17192), Appendix A.5.
    """
    if not (isinstance(lenience, (int, float)) and not isinstance(lenience, bool) and 0.0 < lenience <= 1.0):
        raise ValueError(f"lenience must be a number in (0, 1], got {lenience!r}")
    if lenience == 1.0:
        return rejection_sample(
            target_probs_BKV, draft_tokens_BK, draft_probs_BKV, generator=generator, validate=validate
        )
    if validate:
        validate_verify_inputs(target_probs_BKV, draft_tokens_BK, draft_probs_BKV)
        if greedy and (target_logits_BKV is None or target_logits_BKV.shape != target_probs_BKV.shape):
            raise ValueError(
                "greedy lenient verification needs target_logits_BKV of the same shape as target_probs_BKV "
                f"{tuple(target_probs_BKV.shape)}, got "
                f"{None if target_logits_BKV is None else tuple(target_logits_BKV.shape)}"
            )
    B, K1, V = target_probs_BKV.shape
    K = K1 - 1
    device = target_probs_BKV.device
    work_dtype = torch.float64 if target_probs_BKV.dtype == torch.float64 else torch.float32
    target_probs_BKV = target_probs_BKV.to(work_dtype)
    draft_tokens_BK = draft_tokens_BK.long()
    rows_B = torch.arange(B, device=device)

    # --- accept / reject each draft token -------------------------------------------------------
    if greedy:
        raw_BKV = torch.softmax(target_logits_BKV[:, :K].to(work_dtype), dim=-1)
        raw_at_draft_BK = raw_BKV.gather(-1, draft_tokens_BK.unsqueeze(-1)).squeeze(-1)
        accepted_BK = raw_at_draft_BK >= lenience * raw_BKV.amax(dim=-1)
    else:
        target_at_draft_BK = target_probs_BKV[:, :K].gather(-1, draft_tokens_BK.unsqueeze(-1)).squeeze(-1)
        if draft_probs_BKV is None:
            draft_at_draft_BK = torch.ones_like(target_at_draft_BK)
        else:
            draft_probs_BKV = draft_probs_BKV.to(work_dtype)
            draft_at_draft_BK = draft_probs_BKV.gather(-1, draft_tokens_BK.unsqueeze(-1)).squeeze(-1)
        u_BK = torch.rand((B, K), generator=generator, device=device, dtype=work_dtype)
        # u < target / (l·draft)  <=>  u·l·draft < target; draft == 0 is rejected.
        accepted_BK = (u_BK * lenience * draft_at_draft_BK < target_at_draft_BK) & (draft_at_draft_BK > 0)
    num_accepted_B = accepted_BK.long().cumprod(dim=-1).sum(dim=-1)

    # --- one recovered (first rejection) or bonus (all accepted) token per row ----------------------
    stop_B = num_accepted_B
    target_at_stop_BV = target_probs_BKV[rows_B, stop_B]
    rejected_B = stop_B < K
    if greedy or K == 0 or not bool(rejected_B.any()):
        # Greedy: the recovered token is the target's argmax too (its one-hot minus l·draft, normalised).
        stop_dist_BV = target_at_stop_BV
    else:
        stop_clamped_B = stop_B.clamp(max=K - 1)
        if draft_probs_BKV is None:
            draft_at_stop_BV = torch.zeros_like(target_at_stop_BV)
            draft_at_stop_BV[rows_B, draft_tokens_BK[rows_B, stop_clamped_B]] = 1.0
        else:
            draft_at_stop_BV = draft_probs_BKV[rows_B, stop_clamped_B]
        residual_BV = (target_at_stop_BV - lenience * draft_at_stop_BV).clamp_(min=0.0)
        empty_B = residual_BV.sum(dim=-1) <= 0
        residual_BV = torch.where(empty_B.unsqueeze(-1), target_at_stop_BV, residual_BV)
        stop_dist_BV = torch.where(rejected_B.unsqueeze(-1), residual_BV, target_at_stop_BV)
    stop_token_B = sample_from_probs(stop_dist_BV, generator)

    # --- assemble [accepted..., recovered/bonus, -1...] ---------------------------------------------
    tokens_BK1 = torch.full((B, K + 1), -1, dtype=torch.long, device=device)
    if K > 0:
        keep_BK = torch.arange(K, device=device).unsqueeze(0) < num_accepted_B.unsqueeze(1)
        tokens_BK1[:, :K] = torch.where(keep_BK, draft_tokens_BK, tokens_BK1[:, :K])
    tokens_BK1[rows_B, stop_B] = stop_token_B
    return VerifyResult(tokens_BK1, num_accepted_B)


class LenientVerify:
    """The ``lenient`` verification rule (a :class:`specdec.verify_rules.VerifyRule`).

    Option: ``lenience`` l ∈ (0, 1] (default 0.5); l = 1 is exact. Lossy for l < 1.
    """

    def __init__(self, *, lenience: float = 0.5) -> None:
        if isinstance(lenience, bool) or not isinstance(lenience, (int, float)) or math.isnan(lenience):
            raise ValueError(f"lenience must be a number in (0, 1], got {lenience!r}")
        if not 0.0 < lenience <= 1.0:
            raise ValueError(f"lenience must be a number in (0, 1], got {lenience!r}")
        self.lenience = float(lenience)
        self.lossless = self.lenience == 1.0

    def __call__(
        self,
        target_probs_BKV: torch.Tensor,
        draft_tokens_BK: torch.Tensor,
        draft_probs_BKV: torch.Tensor | None,
        *,
        target_logits_BKV: torch.Tensor,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
        validate: bool = True,
    ) -> VerifyResult:
        return lenient_sample(
            target_probs_BKV,
            draft_tokens_BK,
            draft_probs_BKV,
            lenience=self.lenience,
            target_logits_BKV=target_logits_BKV,
            greedy=sampling.greedy,
            generator=generator,
            validate=validate,
        )

    def __repr__(self) -> str:
        return f"LenientVerify(lenience={self.lenience:g})"
