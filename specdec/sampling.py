"""Logits → probabilities (temperature, top-k, top-p, min-p) and sampling from them.

Legend: N any number of leading rows, V vocabulary.

The same function must process draft and target logits: rejection sampling keeps the *processed*
target distribution exactly, so any difference in how the two sides are warped is a bias.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "MIN_TEMPERATURE",
    "SamplingParams",
    "inverse_cdf",
    "logits_to_probs",
    "sample_from_probs",
    "sampling_probs",
    "validate_sampling",
]

MIN_TEMPERATURE = 2.0**-149
"""The smallest usable positive temperature: the smallest positive float32 (≈ 1.4e-45). Logits are
divided by the temperature in float32, where anything smaller rounds to 0 (0 / 0 = NaN)."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How logits become a distribution: the logits processors of :mod:`specdec.logits` (logit bias,
    min_tokens, penalties: functions of the tokens before each position), then temperature, top-k,
    top-p and min-p (the order of transformers' warpers).

    ``temperature`` is 0 (greedy: the argmax of the processed logits) or a finite number that is not 0
    in float32 (from about :data:`MIN_TEMPERATURE` ≈ 1.4e-45, the smallest positive float32); one that
    rounds to 0 is refused (``ValueError`` naming the smallest usable value), not rounded to greedy:
    near 0 a positive temperature gives the uniform distribution over tied maximal logits, greedy the
    lowest id.

    The processors (:class:`specdec.logits.Processors` applies them, at every verify position with
    that position's own prefix):

    - ``presence_penalty``, ``frequency_penalty`` in [−2, 2] (OpenAI's): subtracted from the logit of
      every token generated so far, once / once per occurrence;
    - ``repetition_penalty`` > 0 (CTRL, arXiv 1909.05858, as transformers): the logit of every token
      in the prompt or generated so far is divided by it where positive, multiplied where negative;
    - ``logit_bias``: token id → bias in [−100, 100] added to its logit; −100 bans the token (its
      logit becomes −inf). Given as a mapping or pairs, kept as sorted pairs (hashable);
    - ``min_tokens``: the request's end-of-sequence tokens are banned until this many are generated.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0

    def __post_init__(self) -> None:
        validate_sampling(self.temperature, self.top_k, self.top_p, self.min_p)
        from specdec.logits.checks import check_bias, check_processor_params

        object.__setattr__(self, "logit_bias", check_bias(self.logit_bias))
        check_processor_params(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes(self) -> bool:
        """Whether any logits processor is set (else the logits go to the rule as they are)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )


def validate_sampling(
    temperature: float, top_k: int | None, top_p: float | None, min_p: float | None = None
) -> None:
    """Raise ``ValueError`` naming the argument when a sampling parameter is out of range.

    ``temperature``: 0 (greedy) or a finite positive number that is not 0 in float32 (the smallest
    positive float32 is :data:`MIN_TEMPERATURE`, ≈ 1.4e-45; a value that rounds to 0 there would give
    NaN probabilities in the float32 division, so it is refused). ``top_k``: None or an int >= 1.
    ``top_p``: None or (0, 1], not 0 in float32 (at least :data:`MIN_TEMPERATURE`). ``min_p``: None or
    [0, 1].
    """
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or math.isnan(temperature)
        or temperature < 0
    ):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if math.isinf(temperature):
        raise ValueError(f"temperature must be finite, got {temperature!r}")
    if 0 < temperature < MIN_TEMPERATURE and float(torch.tensor(temperature, dtype=torch.float32)) == 0:
        raise ValueError(
            f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE!r} (the smallest positive "
            f"float32; logits are divided by it in float32, where {temperature!r} is 0)"
        )
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (
        isinstance(top_p, bool)
        or not isinstance(top_p, (int, float))
        or math.isnan(top_p)
        or not 0.0 < top_p <= 1.0
    ):
        raise ValueError(f"top_p must be None or a float in (0, 1], got {top_p!r}")
    if top_p is not None and top_p < MIN_TEMPERATURE and float(torch.tensor(top_p, dtype=torch.float32)) == 0:
        raise ValueError(
            f"top_p must be at least {MIN_TEMPERATURE!r} (the smallest positive float32; the top-p mass "
            f"is compared in float32, where {top_p!r} is 0), got {top_p!r}"
        )
    if min_p is not None and (
        isinstance(min_p, bool)
        or not isinstance(min_p, (int, float))
        or math.isnan(min_p)
        or not 0.0 <= min_p <= 1.0
    ):
        raise ValueError(f"min_p must be None or a float in [0, 1], got {min_p!r}")


def logits_to_probs(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    *,
    min_p: float | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Turn ``logits [..., V]`` into float32 probabilities ``[..., V]``.

    Order: temperature, then top-k, then top-p, then min-p.

    - ``temperature == 0`` returns the one-hot argmax (ties go to the lowest id).
    - top-k keeps the k largest logits; ties at the k-th place go to the lower ids, so exactly
      ``min(k, V)`` tokens survive.
    - top-p keeps the smallest prefix of the sorted (top-k) distribution whose mass reaches p: the
      token that crosses p is kept.
    - min-p (Nguyen et al. 2024, arXiv 2407.01082) keeps the tokens whose probability is at least
      ``min_p`` times the most likely one's (after top-k and top-p), so the most likely stays.

    ``validate=False`` skips the check that every row is finite (a host read of the logits: the
    engine checks its logits once per step, in its one transfer).
    """
    validate_sampling(temperature, top_k, top_p, min_p)
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got dtype {logits.dtype}")
    logits = logits.float()
    V = logits.shape[-1]
    # amax propagates NaN: one reduction finds NaN, +inf and rows with no finite logit at all.
    row_max = logits.amax(dim=-1, keepdim=True)
    if validate and not bool(torch.isfinite(row_max).all()):
        raise ValueError(f"logits must be finite (-inf allowed, not in a whole row): {_first_bad(row_max)}")

    if temperature == 0.0:
        # torch.argmax returns the first maximal index: ties go to the lowest id.
        idx = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros_like(logits).scatter_(-1, idx, 1.0)

    # Shift before dividing: (logits - max) / T is <= 0 and never NaN, so a tiny temperature gives
    # the limit distribution (uniform over the maximal logits) instead of overflowing to inf / inf.
    logits = (logits - row_max) / temperature
    use_k = top_k is not None and top_k < V
    use_p = top_p is not None and top_p < 1.0
    if not use_k and not use_p:
        return _min_p(torch.softmax(logits, dim=-1), min_p)

    # One stable sort serves both filters: equal logits keep ascending-id order, so the tie
    # break is deterministic and identical for draft and target.
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    keep_sorted = torch.ones_like(sorted_logits, dtype=torch.bool)
    if use_k:
        keep_sorted[..., top_k:] = False
    sorted_probs = torch.softmax(sorted_logits.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    if use_p:
        # Mass strictly before each token; a token is kept while that mass is still below p,
        # which keeps the token that crosses p and always keeps the first one.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep_sorted &= mass_before < top_p
        keep_sorted[..., 0] = True  # the most likely token always stays: a mask never empties a row
        sorted_probs = sorted_probs.masked_fill(~keep_sorted, 0.0)
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return _min_p(torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs), min_p)


def _min_p(probs: torch.Tensor, min_p: float | None) -> torch.Tensor:
    """Keep the tokens with at least ``min_p`` × the largest probability of their row, renormalised
    (the largest always stays: a mask never empties a row)."""
    if not min_p:
        return probs
    keep = probs >= min_p * probs.amax(dim=-1, keepdim=True)
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sampling_probs(logits: torch.Tensor, sampling: SamplingParams, *, validate: bool = True) -> torch.Tensor:
    """:func:`logits_to_probs` with every warper of ``sampling`` (temperature, top-k, top-p, min-p):
    the one call both sides of verification make, so draft and target are warped alike."""
    return logits_to_probs(
        logits, sampling.temperature, sampling.top_k, sampling.top_p, min_p=sampling.min_p, validate=validate
    )


def _first_bad(row_stat_N1: torch.Tensor) -> str:
    """Where the first non-finite entry of a keep-dim per-row statistic is, as text."""
    index = tuple((~torch.isfinite(row_stat_N1)).nonzero()[0].tolist()[:-1])
    return f"the first bad row is at index {index}" if index else "the row is bad"


def sample_from_probs(
    probs_NV: torch.Tensor, generator: torch.Generator | None = None, *, validate: bool = True
) -> torch.Tensor:
    """Draw one token id per row of ``probs [..., V]``; returns ``[...]`` long.

    Rows need not be normalised (they are treated as weights), but must be finite, non-negative
    and have positive mass (``ValueError`` otherwise: a NaN row would otherwise draw id V).
    Inverse-CDF sampling on a float64 cumulative sum: one uniform per row, and a token with zero
    weight owns an empty interval, so it is never drawn. (About 3x faster than ``torch.multinomial``
    over a 50k vocabulary on CPU.) ``validate=False`` skips the check of the rows (a host read), for
    callers whose rows are valid by construction.
    """
    lead = probs_NV.shape[:-1]
    flat = probs_NV.reshape(-1, probs_NV.shape[-1])
    if flat.shape[0] == 0:
        return torch.empty(lead, dtype=torch.long, device=probs_NV.device)
    cdf_NV = flat.double().cumsum(dim=-1)
    total_N1 = cdf_NV[:, -1:].contiguous()
    if validate:
        ok_N = (flat.amin(dim=-1) >= 0) & (total_N1.squeeze(-1) > 0) & torch.isfinite(total_N1.squeeze(-1))
        if not bool(ok_N.all()):
            row = int((~ok_N).nonzero()[0, 0])
            raise ValueError(
                f"probs must be finite and non-negative with positive mass in every row; row {row} is "
                f"not (sum {float(total_N1[row, 0]):.4g}, min {float(flat[row].min()):.4g})"
            )
    # the uniforms come from the generator's device (a CPU generator draws the same numbers for
    # probabilities on any device), then move to the probabilities'
    drawn_on = generator.device if generator is not None else flat.device
    u_N1 = torch.rand(flat.shape[0], 1, dtype=torch.float64, generator=generator, device=drawn_on)
    return _invert(cdf_NV, u_N1.to(flat.device)).reshape(lead)


def inverse_cdf(probs_NV: torch.Tensor, u_N: torch.Tensor) -> torch.Tensor:
    """Row n's index whose float64 cumulative interval holds ``u_N[n] · Σ probs_NV[n]`` (``u`` in
    (0, 1); rows non-negative with positive mass, checked by the caller); long ``[N]``. A
    zero-probability index owns an empty interval and is never drawn. :func:`sample_from_probs` with
    the uniforms given (keyed ones: :func:`specdec.verify.noise.sample_keyed_inverse`)."""
    if probs_NV.shape[0] == 0:
        return torch.empty(0, dtype=torch.long, device=probs_NV.device)
    u_N1 = u_N.to(device=probs_NV.device, dtype=torch.float64).reshape(-1, 1)
    return _invert(probs_NV.double().cumsum(dim=-1), u_N1)


def _invert(cdf_NV: torch.Tensor, u_N1: torch.Tensor) -> torch.Tensor:
    """The index of each row of a float64 cumulative sum ``[N, V]`` that ``u · total`` falls in; ``[N]``."""
    total_N1 = cdf_NV[:, -1:].contiguous()
    # Token i owns [cdf[i-1], cdf[i]); u * total < total, so the draw is always a valid index.
    out = torch.searchsorted(cdf_NV, u_N1 * total_N1, right=True).squeeze(-1)
    # Guard against the last weighted token being followed by zero-weight ones after rounding.
    last_N = torch.searchsorted(cdf_NV, total_N1, right=False).squeeze(-1)
    return torch.minimum(out, last_N)
