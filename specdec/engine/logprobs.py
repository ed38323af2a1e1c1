"""Per-token log-probabilities under the target, for the requests that ask for them.

Legend: N positions, V vocabulary, k alternatives per position.

A token's log-probability is the target's own distribution at the position that decided it:
``torch.log_softmax(logits.float(), dim=-1)`` of the target's raw logits, before temperature, top-k
and top-p (vLLM's default "raw" logprobs; ``specdec perplexity`` scores text with the same formula).
The logits are the ones the engine's verification read for that committed token: the prefill's last
position for the first token, block position j of a verified chain (the path's node for a tree) for
the j-th token committed in a step. So speculative and plain decoding report the same values
wherever the target gives a token the same logits whatever its block (the native target does).

Prompt log-probabilities (vLLM's ``prompt_logprobs``) come from the prefill forwards: position j
of a prompt scores prompt token j + 1; the first prompt token has no log-probability (None).
Only a request that asks pays: other requests' prefill computes the LM head at one position only.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from specdec.protocols import TargetOutput

__all__ = ["TokenLogprob", "token_logprobs", "check_num_logprobs", "prefill_logits_index", "last_logits_only"]


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the ``k`` most likely tokens at its position (``top``:
    ``(token_id, logprob)`` pairs, most likely first; empty when no alternatives were asked for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_num_logprobs(value: Any, name: str, vocab_size: int) -> int | None:
    """``value`` as the number of alternatives to report (None: no log-probabilities at all; 0: the
    chosen token's only), or ``ValueError`` naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= vocab_size:
        raise ValueError(f"{name} must be None or an int in [0, {vocab_size}], got {value!r}")
    return int(value)


def token_logprobs(logits_NV: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """The log-probability of ``token_ids[n]`` under ``logits_NV[n]`` and the ``num_top`` most likely
    tokens there (one host transfer for all N)."""
    logprobs_NV = torch.log_softmax(logits_NV.float(), dim=-1)
    ids_N1 = torch.tensor(token_ids, dtype=torch.long, device=logprobs_NV.device).unsqueeze(1)
    chosen = logprobs_NV.gather(1, ids_N1).squeeze(1)
    if num_top == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(token_ids, chosen.tolist(), strict=True)]
    top_values_Nk, top_ids_Nk = logprobs_NV.topk(num_top, dim=-1)
    host = torch.cat([chosen.unsqueeze(1), top_values_Nk], dim=1).tolist()
    top_ids = top_ids_Nk.tolist()
    return [
        TokenLogprob(t, row[0], tuple(zip(ids, row[1:], strict=True)))
        for t, row, ids in zip(token_ids, host, top_ids, strict=True)
    ]


def prefill_logits_index(rows: list[Any], n: int) -> torch.Tensor:
    """``logits_index_BN`` of a prefill chunk of ``n`` tokens: every position where a row asks for
    prompt log-probabilities, else the last position only."""
    if any(r.params.prompt_logprobs is not None for r in rows):
        return torch.arange(n).expand(len(rows), n)
    return torch.full((len(rows), 1), n - 1)


def last_logits_only(out: TargetOutput) -> TargetOutput:
    """A prefill row's output with its last position's logits only: what drafters ``begin`` on, whether
    or not the chunk computed the logits of every position for prompt log-probabilities. Copies, not
    views: a row's view would keep the whole chunk's ``[G, n, V]`` logits (and every row's features)
    alive until its prompt is done (gigabytes for long ``echo`` prompts at several slots)."""
    copy = lambda t: None if t is None else t.clone()  # noqa: E731
    aux = None if not out.aux_hidden_BTD else {k: copy(h) for k, h in out.aux_hidden_BTD.items()}
    logits_B1V = copy(out.logits_BTV[:, -1:])
    return dataclasses.replace(
        out, logits_BTV=logits_B1V, hidden_BTD=copy(out.hidden_BTD), aux_hidden_BTD=aux
    )
