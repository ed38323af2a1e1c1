"""Exact output distributions of speculative decoding over toy models, through the real verifier.

Legend: B rows, K draft length (γ), V vocabulary, M draft sequences.

Leviathan et al. 2023 (arXiv 2211.17192, Algorithm 1); Chen et al. 2023 (arXiv 2302.01318). Every
draft sequence the drafter can propose is enumerated with its probability, and every accept/reject
path of the verifier is read off the verifier itself (:func:`specdec.testing.probe.verifier_step_law`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.logits import LogitsProcessor
from specdec.sampling import SamplingParams
from specdec.testing.probe import ProbeError, StepOutcome, VerifyFn, verifier_step_law
from specdec.testing.processed import processed_next_token_probs
from specdec.testing.toy import NextTokenModel
from specdec.verify import rejection_sample

__all__ = [
    "expected_output_distribution",
    "expected_num_accepted_distribution",
    "target_sequence_distribution",
]

_DRAFT_MODES = ("sample", "point_mass")


def _check_models(target: NextTokenModel, drafter: NextTokenModel, gamma: int, draft: str) -> None:
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma must be an int >= 0, got {gamma!r}")
    if draft not in _DRAFT_MODES:
        raise ValueError(f"draft must be one of {_DRAFT_MODES}, got {draft!r}")
    if target.vocab_size != drafter.vocab_size:
        raise ValueError(f"vocab mismatch: target V={target.vocab_size}, drafter V={drafter.vocab_size}")


def _cut(seq: tuple[int, ...], num_tokens: int | None, eos: frozenset[int]) -> tuple[tuple[int, ...], bool]:
    """Cut at ``num_tokens`` and after the first EOS; return (sequence, finished)."""
    if num_tokens is not None:
        seq = seq[:num_tokens]
    for i, t in enumerate(seq):
        if t in eos:
            return seq[: i + 1], True
    if num_tokens is not None and len(seq) >= num_tokens:
        return seq[:num_tokens], True
    return seq, False


def _step_laws(
    target: NextTokenModel,
    drafter: NextTokenModel,
    contexts: list[tuple[int, ...]],
    gamma: int,
    draft: str,
    sampling: SamplingParams | None,
    verify_fn: VerifyFn,
    processed: dict | None = None,
) -> list[list[tuple[float, StepOutcome]]]:
    """Per context: (draft-sequence probability, verify path) pairs of one speculative step."""
    # Draft sequences: (context index, draft tokens, probability, draft rows).
    items: list[tuple[int, tuple[int, ...], float, list[torch.Tensor]]] = [
        (c, (), 1.0, []) for c in range(len(contexts))
    ]
    for _ in range(gamma):
        q_NV = drafter.next_token_probs([contexts[c] + d for c, d, _, _ in items], sampling)
        grown = []
        for (c, d, pr, rows), q_V in zip(items, q_NV, strict=True):
            if draft == "point_mass":
                grown.append((c, d + (int(q_V.argmax()),), pr, rows + [q_V]))
            else:
                for x in torch.nonzero(q_V > 0).flatten().tolist():
                    grown.append((c, d + (x,), pr * float(q_V[x]), rows + [q_V]))
        items = grown
    M, V = len(items), target.vocab_size
    target_ctx = [contexts[c] + d[:k] for c, d, _, _ in items for k in range(gamma + 1)]
    if processed is None:  # the target unprocessed (one step's law)
        target_probs_MKV = target.next_token_probs(target_ctx, sampling)
    else:
        target_probs_MKV = processed_next_token_probs(target, target_ctx, sampling, **processed)
    target_probs_MKV = target_probs_MKV.reshape(M, gamma + 1, V)
    draft_tokens_MK = torch.tensor([d for _, d, _, _ in items], dtype=torch.long).reshape(M, gamma)
    draft_probs_MKV = None
    if draft == "sample":
        draft_probs_MKV = (
            torch.stack([torch.stack(rows) for _, _, _, rows in items])
            if gamma > 0
            else torch.zeros((M, 0, V), dtype=torch.float64)
        )
    laws = verifier_step_law(target_probs_MKV, draft_tokens_MK, draft_probs_MKV, verify_fn=verify_fn)
    out: list[list[tuple[float, StepOutcome]]] = [[] for _ in contexts]
    for (c, _, pr, _), law in zip(items, laws, strict=True):
        out[c].extend((pr, outcome) for outcome in law)
    return out


def expected_output_distribution(
    target: NextTokenModel,
    drafter: NextTokenModel,
    *,
    gamma: int,
    context: Sequence[int] = (),
    num_tokens: int | None = None,
    draft: str = "sample",
    sampling: SamplingParams | None = None,
    eos_token_ids: Sequence[int] = (),
    verify_fn: VerifyFn = rejection_sample,
    logits_processors: Sequence[LogitsProcessor] = (),
) -> dict[tuple[int, ...], float]:
    """Exact distribution of what speculative decoding emits after ``context``, by enumeration.

    Every draft sequence the drafter can propose is enumerated with its probability, and every
    verify path is evaluated through ``verify_fn`` itself (:func:`verifier_step_law`).

    Args:
        target, drafter: toy models (:class:`~specdec.testing.toy.NextTokenModel`), small vocabulary.
        gamma: draft length γ of every step.
        num_tokens: None: the tokens one speculative step emits (1 .. γ+1 of them). An int m: the
            first m tokens of the stream that repeated steps produce (fewer if an EOS comes first),
            which must equal the target's joint (:func:`target_sequence_distribution`).
        draft: ``"sample"`` (drafts sampled from the drafter, its probabilities passed to the
            verifier) or ``"point_mass"`` (the drafter's argmax, ``draft_probs=None``).
        sampling: temperature / top-k / top-p / min-p, applied to both models' logits; its logits
            processors (penalties, ``logit_bias``, ``min_tokens``) and ``logits_processors`` apply to
            the target's, at every draft position with that position's own output
            (:func:`specdec.testing.processed.processed_next_token_probs`); the drafter drafts from
            its own unprocessed distribution.
        eos_token_ids: a sequence is cut after its first EOS (as :func:`specdec.generate` does).
        verify_fn: the verifier to evaluate (signature of :func:`specdec.verify.rejection_sample`).

    Returns:
        ``{emitted token tuple: probability}``, probabilities summing to 1.
    """
    _check_models(target, drafter, gamma, draft)
    if num_tokens is not None and (
        isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1
    ):
        raise ValueError(f"num_tokens must be None or an int >= 1, got {num_tokens!r}")
    eos = frozenset(int(t) for t in eos_token_ids)
    context = tuple(int(t) for t in context)
    processed = {
        "prompt_len": len(context),
        "logits_processors": logits_processors,
        "eos_token_ids": sorted(eos),
    }
    final: dict[tuple[int, ...], float] = {}
    states: dict[tuple[int, ...], float] = {(): 1.0}
    while states:
        prefixes = list(states)
        contexts = [context + s for s in prefixes]
        laws = _step_laws(target, drafter, contexts, gamma, draft, sampling, verify_fn, processed)
        grown: dict[tuple[int, ...], float] = {}
        for s, law in zip(prefixes, laws, strict=True):
            for draft_prob, outcome in law:
                for emitted, p in outcome.emitted().items():
                    if not emitted:
                        raise ProbeError("verify_fn emitted no token on a reachable path; a loop would stall")
                    seq, finished = _cut(s + emitted, num_tokens, eos)
                    bucket = final if finished or num_tokens is None else grown
                    bucket[seq] = bucket.get(seq, 0.0) + states[s] * draft_prob * p
        states = grown
    return final


def expected_num_accepted_distribution(
    target: NextTokenModel,
    drafter: NextTokenModel,
    *,
    gamma: int,
    context: Sequence[int] = (),
    draft: str = "sample",
    sampling: SamplingParams | None = None,
    verify_fn: VerifyFn = rejection_sample,
) -> list[float]:
    """Exact P(num_accepted = n), n = 0..γ, of one speculative step after ``context`` (as reported
    by ``verify_fn``)."""
    _check_models(target, drafter, gamma, draft)
    law = _step_laws(target, drafter, [tuple(context)], gamma, draft, sampling, verify_fn)[0]
    out = [0.0] * (gamma + 1)
    for draft_prob, outcome in law:
        out[outcome.num_accepted] += draft_prob * outcome.probability
    return out


def target_sequence_distribution(
    target: NextTokenModel,
    *,
    num_tokens: int,
    context: Sequence[int] = (),
    sampling: SamplingParams | None = None,
    eos_token_ids: Sequence[int] = (),
    logits_processors: Sequence[LogitsProcessor] = (),
) -> dict[tuple[int, ...], float]:
    """The target's own joint over its next ``num_tokens`` tokens (chain rule; cut after an EOS),
    processed by ``sampling``'s processors and ``logits_processors`` with each prefix's own output.

    This is the reference a correct speculative decoder must reproduce; it involves no verifier.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
    eos = frozenset(int(t) for t in eos_token_ids)
    context = tuple(int(t) for t in context)
    final: dict[tuple[int, ...], float] = {}
    states: dict[tuple[int, ...], float] = {(): 1.0}
    while states:
        prefixes = list(states)
        probs_NV = processed_next_token_probs(
            target,
            [context + s for s in prefixes],
            sampling,
            prompt_len=len(context),
            logits_processors=logits_processors,
            eos_token_ids=sorted(eos),
        )
        grown: dict[tuple[int, ...], float] = {}
        for s, row in zip(prefixes, probs_NV, strict=True):
            for y in torch.nonzero(row > 0).flatten().tolist():
                seq, finished = _cut(s + (y,), num_tokens, eos)
                bucket = final if finished else grown
                bucket[seq] = bucket.get(seq, 0.0) + states[s] * float(row[y])
        states = grown
    return final
