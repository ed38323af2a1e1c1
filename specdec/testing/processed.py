"""The processed target distribution of a toy model: the reference that speculative decoding with
logits processors (:mod:`specdec.logits`) must reproduce.

Legend: N contexts, V vocabulary.

A context is the prompt (its first ``prompt_len`` tokens) followed by the output so far; the target's
logits after it are processed as the engine processes a verify position (:class:`specdec.logits.
Processors`: penalties, ``logit_bias``, ``min_tokens``, a plugin's processors), then warped by
temperature, top-k, top-p and min-p. The definitions themselves are checked against transformers'
and OpenAI's in ``tests/test_logits_processors.py``; what these references test is speculation: that
every verify position sees the processors with its own prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.logits import LogitsProcessor, Processors
from specdec.sampling import SamplingParams, sampling_probs

__all__ = ["processed_next_token_probs"]


def processed_next_token_probs(
    model: object,
    contexts: Sequence[Sequence[int]],
    sampling: SamplingParams | None,
    *,
    prompt_len: int,
    logits_processors: Sequence[LogitsProcessor] = (),
    eos_token_ids: Sequence[int] = (),
) -> torch.Tensor:
    """float64 ``[N, V]``: ``model``'s next-token distribution after each context, processed with the
    output after ``prompt_len`` tokens (``eos_token_ids``: the tokens ``min_tokens`` bans). Without
    processors, ``model.next_token_probs`` itself."""
    s = sampling or SamplingParams()
    if not s.processes and not logits_processors:
        return model.next_token_probs(contexts, s)  # type: ignore[attr-defined]
    if not hasattr(model, "logits_for"):
        raise ValueError(
            f"logits processors need a model with logits (a MarkovModel), got {type(model).__name__}"
        )
    V = model.vocab_size  # type: ignore[attr-defined]
    logits_NV = model.logits_for(model.context_index(contexts))  # type: ignore[attr-defined]
    rows = []
    for ctx, row_V in zip(contexts, logits_NV, strict=True):
        ctx = [int(t) for t in ctx]
        processors = Processors(
            s, ctx[:prompt_len], vocab_size=V, stop_ids=eos_token_ids, custom=logits_processors
        )
        processors.commit(ctx[prompt_len:])
        rows.append(processors.process(row_V[None], [[]])[0])
    probs_NV = sampling_probs(torch.stack(rows), s).double()
    return probs_NV / probs_NV.sum(dim=-1, keepdim=True)
