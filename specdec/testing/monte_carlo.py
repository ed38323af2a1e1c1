"""Monte-Carlo estimates of what speculative decoding emits, through the real code.

Legend: R sample rows, K draft length (γ), V vocabulary, L emitted-token capacity.

Two paths, both drawing every token with the engine's own functions:

- ``via="verify"``: a minimal speculative loop around ``verify_fn`` (default: the real
  :func:`specdec.verify.rejection_sample`; pass your own verifier with the same signature). Drafts are
  sampled from the drafter's processed rows with :func:`specdec.sampling.sample_from_probs`; each of
  the R rows is one independent sample, so one verify call serves the whole batch.
- ``via="generate"``: the real :func:`specdec.generate` (the engine), with the toy models behind the
  ``Target`` / ``Drafter`` protocols; every prompt row is one sample.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from specdec.protocols import Drafter, Target
from specdec.sampling import SamplingParams, sample_from_probs
from specdec.testing.enumeration import _DRAFT_MODES
from specdec.testing.keyed import with_generator
from specdec.testing.probe import VerifyFn, _emitted_length
from specdec.testing.toy import NextTokenModel
from specdec.verify import rejection_sample

__all__ = ["sample_output_distribution"]


def _row_keys(tokens_RL: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """Encode each ``-1``-padded row as one int64 (digits tok+1 in base V+1), or None if too long."""
    base = max(int(tokens_RL.max()) + 2, 2) if tokens_RL.numel() else 2
    L = tokens_RL.shape[1]
    if L * math.log2(base) >= 62:
        return None
    weights_L = base ** torch.arange(L - 1, -1, -1, dtype=torch.long)
    return ((tokens_RL + 1) * weights_L).sum(dim=1), base


def _unique_rows(tokens_RL: torch.Tensor) -> tuple[list[tuple[int, ...]], torch.Tensor, torch.Tensor]:
    """Distinct ``-1``-padded rows as tuples (padding stripped), inverse index ``[R]``, counts."""
    encoded = _row_keys(tokens_RL)
    if encoded is None:
        uniq, inverse, counts = torch.unique(tokens_RL, dim=0, return_inverse=True, return_counts=True)
        rows = [tuple(t for t in row if t >= 0) for row in uniq.tolist()]
        return rows, inverse, counts
    keys_R, base = encoded
    max_key = int(keys_R.max()) if keys_R.numel() else 0
    if max_key < 1 << 24:  # small key space: a bincount is much faster than torch.unique's sort
        counts_all = torch.bincount(keys_R, minlength=max_key + 1)
        uniq = counts_all.nonzero().flatten()
        slot = torch.zeros(max_key + 1, dtype=torch.long)
        slot[uniq] = torch.arange(uniq.numel())
        inverse, counts = slot[keys_R], counts_all[uniq]
    else:
        uniq, inverse, counts = torch.unique(keys_R, return_inverse=True, return_counts=True)
    rows = []
    for key in uniq.tolist():
        digits = []
        for _ in range(tokens_RL.shape[1]):
            key, d = divmod(key, base)
            digits.append(d)
        rows.append(tuple(d - 1 for d in reversed(digits) if d > 0))
    return rows, inverse, counts


def _probs_after(
    model: NextTokenModel,
    context: tuple[int, ...],
    seq_RL: torch.Tensor,
    len_R: torch.Tensor,
    sampling: SamplingParams | None,
) -> torch.Tensor:
    """float64 ``[R, V]``: the row after ``context + seq[r, :len[r]]``; one call per distinct context."""
    masked_RL = torch.where(torch.arange(seq_RL.shape[1]) < len_R.unsqueeze(1), seq_RL, -1)
    rows, inverse, _ = _unique_rows(masked_RL)
    return model.next_token_probs([context + r for r in rows], sampling)[inverse]


def _cut_rows(
    emitted_RL: torch.Tensor, n_R: torch.Tensor, num_tokens: int | None, eos: torch.Tensor
) -> torch.Tensor:
    """Cut rows after their first EOS and at num_tokens (in place); return which rows are finished."""
    L = emitted_RL.shape[1]
    positions_L = torch.arange(L)
    is_eos_RL = torch.isin(emitted_RL, eos) & (positions_L < n_R.unsqueeze(1))
    has_eos_R = is_eos_RL.any(dim=1)
    n_R.copy_(torch.where(has_eos_R, is_eos_RL.float().argmax(dim=1) + 1, n_R))
    if num_tokens is not None:
        n_R.clamp_(max=num_tokens)
    emitted_RL.masked_fill_(positions_L >= n_R.unsqueeze(1), -1)
    if num_tokens is None:  # one speculative step: every row is done
        return torch.ones_like(has_eos_R)
    return has_eos_R | (n_R >= num_tokens)


def _sample_via_verify(
    target: NextTokenModel,
    drafter: NextTokenModel,
    R: int,
    gamma: int,
    context: tuple[int, ...],
    num_tokens: int | None,
    draft: str,
    sampling: SamplingParams | None,
    eos: torch.Tensor,
    verify_fn: VerifyFn,
    generator: torch.Generator,
    dtype: torch.dtype,
) -> Counter:
    K, V = gamma, target.vocab_size
    L = (num_tokens or 0) + K + 1
    emitted_RL = torch.full((R, L), -1, dtype=torch.long)
    n_R = torch.zeros(R, dtype=torch.long)
    done_R = torch.zeros(R, dtype=torch.bool)
    while not bool(done_R.all()):
        act = (~done_R).nonzero().flatten()
        A = act.numel()
        work_AL = torch.cat([emitted_RL[act], torch.full((A, K), -1, dtype=torch.long)], dim=1)
        n_A = n_R[act]
        rows_A = torch.arange(A)
        draft_probs = []
        for k in range(K):
            q_AV = _probs_after(drafter, context, work_AL, n_A + k, sampling)
            x_A = (
                q_AV.argmax(dim=-1) if draft == "point_mass" else sample_from_probs(q_AV.to(dtype), generator)
            )
            work_AL[rows_A, n_A + k] = x_A
            draft_probs.append(q_AV)
        draft_tokens_AK = work_AL[rows_A.unsqueeze(1), n_A.unsqueeze(1) + torch.arange(K)]
        target_probs_AKV = torch.stack(
            [_probs_after(target, context, work_AL, n_A + k, sampling) for k in range(K + 1)], dim=1
        )
        draft_probs_AKV = None
        if draft == "sample":
            draft_probs_AKV = (
                torch.stack(draft_probs, dim=1) if K else torch.zeros((A, 0, V), dtype=torch.float64)
            )
            draft_probs_AKV = draft_probs_AKV.to(dtype)
        tokens_AK1, _ = verify_fn(
            target_probs_AKV.to(dtype), draft_tokens_AK, draft_probs_AKV, generator=generator
        )
        tokens_AK1 = tokens_AK1.long().cpu()
        step_len_A = _emitted_length(tokens_AK1)
        if bool((step_len_A == 0).any()):
            raise ValueError("verify_fn emitted no token for a row (a decode loop would stall)")
        pos_AK1 = n_A.unsqueeze(1) + torch.arange(K + 1)
        keep_AK1 = torch.arange(K + 1) < step_len_A.unsqueeze(1)
        emitted_RL[act.unsqueeze(1).expand_as(pos_AK1)[keep_AK1], pos_AK1[keep_AK1]] = tokens_AK1[keep_AK1]
        n_R[act] = n_A + step_len_A
        done_R = _cut_rows(emitted_RL, n_R, num_tokens, eos)
    rows, _, counts = _unique_rows(emitted_RL)
    return Counter(dict(zip(rows, counts.tolist(), strict=True)))


def _sample_via_generate(
    target: NextTokenModel | Target,
    drafter: NextTokenModel | Drafter | str,
    R: int,
    gamma: Any,
    context: tuple[int, ...],
    num_tokens: int,
    draft: str,
    sampling: SamplingParams,
    eos_token_ids: Sequence[int],
    seed: int,
    logits_processors: Sequence[Any] = (),
) -> Counter:
    from specdec.loop import generate  # the engine is imported only when asked for

    engine_target = target if isinstance(target, Target) else target.as_target()  # type: ignore[union-attr]
    if isinstance(drafter, (str, Drafter)):
        engine_drafter = drafter
    else:
        engine_drafter = drafter.as_drafter(point_mass=draft == "point_mass")  # type: ignore[union-attr]
    out = generate(
        engine_target,
        [list(context)] * R,
        drafter=engine_drafter,
        max_new_tokens=num_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        min_p=sampling.min_p,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        logit_bias=dict(sampling.logit_bias),
        min_tokens=sampling.min_tokens,
        logits_processors=logits_processors,
        gamma=gamma,
        seed=seed,
        eos_token_ids=list(eos_token_ids) or None,
        ignore_eos=not eos_token_ids,
    )
    return Counter(tuple(row) for row in out.token_ids)


def sample_output_distribution(
    target: NextTokenModel | Target,
    drafter: NextTokenModel | Drafter | str,
    *,
    num_samples: int,
    gamma: Any,
    context: Sequence[int] = (),
    num_tokens: int | None = None,
    draft: str = "sample",
    sampling: SamplingParams | None = None,
    eos_token_ids: Sequence[int] = (),
    verify_fn: VerifyFn = rejection_sample,
    via: str = "verify",
    seed: int = 0,
    batch_size: int = 1 << 17,
    dtype: torch.dtype = torch.float32,
    logits_processors: Sequence[Any] = (),
) -> Counter:
    """Count what speculative decoding emits in ``num_samples`` independent runs of the real code.

    Same meaning of ``gamma`` (with ``via="generate"`` also a policy name or
    :class:`specdec.engine.depth.DepthPolicy`), ``context``, ``num_tokens``, ``draft``, ``sampling`` and
    ``eos_token_ids`` as :func:`specdec.testing.expected_output_distribution`, so the two results
    can be compared directly with :func:`specdec.testing.assert_same_distribution`.

    Args:
        verify_fn: the verifier under test (``via="verify"`` only), called as
            ``verify_fn(target_probs_BKV, draft_tokens_BK, draft_probs_BKV_or_None, generator=g)`` (a
            keyed one, with ``noise=``, through :func:`specdec.testing.keyed.with_generator`) and
            returning ``(tokens [B, K+1], num_accepted [B])``; a row emits its tokens before the first -1.
        via: ``"verify"`` (a minimal loop around ``verify_fn``) or ``"generate"`` (the real
            :func:`specdec.generate`; needs ``num_tokens``, and toy models with ``as_target`` /
            ``as_drafter`` or real Target / Drafter objects).
        seed: seeds one ``torch.Generator`` for drafts and verification (per batch: seed + batch index).
        batch_size: rows per verify (or generate) call.
        dtype: dtype of the probabilities handed to the verifier (float32 like the engine).
        logits_processors: a request's own processors (:data:`specdec.logits.LogitsProcessor`), with
            ``sampling``'s penalties, ``logit_bias`` and ``min_tokens``: ``via="generate"`` only (the
            engine applies them at every verify position), compared with the processed references
            of :mod:`specdec.testing.enumeration`.

    Returns:
        ``Counter`` of emitted token tuples, totalling ``num_samples``.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    if via == "verify" and (isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0):
        raise ValueError(f"gamma must be an int >= 0 (via='verify'), got {gamma!r}")
    if draft not in _DRAFT_MODES:
        raise ValueError(f"draft must be one of {_DRAFT_MODES}, got {draft!r}")
    if num_tokens is not None and (
        isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1
    ):
        raise ValueError(f"num_tokens must be None or an int >= 1, got {num_tokens!r}")
    if via not in ("verify", "generate"):
        raise ValueError(f"via must be 'verify' or 'generate', got {via!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    context = tuple(int(t) for t in context)
    counts: Counter = Counter()
    for i, start in enumerate(range(0, num_samples, batch_size)):
        R = min(batch_size, num_samples - start)
        if via == "generate":
            if verify_fn is not rejection_sample:
                raise ValueError(
                    "via='generate' runs specdec.generate, which always verifies with its exact rule "
                    "(keyed rejection sampling)"
                )
            if num_tokens is None:
                raise ValueError("via='generate' needs num_tokens (the max_new_tokens of each run)")
            counts += _sample_via_generate(
                target,
                drafter,
                R,
                gamma,
                context,
                num_tokens,
                draft,
                sampling or SamplingParams(),
                eos_token_ids,
                seed + i,
                logits_processors,
            )
        else:
            if (sampling is not None and sampling.processes) or logits_processors:
                raise ValueError(
                    "logits processors run in the engine: sample with via='generate' (via='verify' "
                    "calls the rule alone, on unprocessed probabilities)"
                )
            if not isinstance(target, NextTokenModel) or not isinstance(drafter, NextTokenModel):
                raise ValueError("via='verify' needs toy models with next_token_probs (specdec.testing.toy)")
            if target.vocab_size != drafter.vocab_size:
                raise ValueError(
                    f"vocab mismatch: target V={target.vocab_size}, drafter V={drafter.vocab_size}"
                )
            generator = torch.Generator().manual_seed(seed + i)
            eos = torch.tensor(sorted({int(t) for t in eos_token_ids}), dtype=torch.long)
            counts += _sample_via_verify(
                target,
                drafter,
                R,
                gamma,
                context,
                num_tokens,
                draft,
                sampling,
                eos,
                with_generator(verify_fn),
                generator,
                dtype,
            )
    return counts
