"""Confidence stop for chain drafts: draft while the drafter still believes in its draft.

Legend: B batch, V vocabulary.

A chain drafter asked for γ tokens drafts them one at a time. Each drafted token costs drafter time
and a verify slot whether the target accepts it or not, and a token after a rejected one is never
used. The confidence stop ends the draft early: after each token the drafter multiplies in its own
probability of that token, the running product being its estimate that the target accepts the whole
draft so far. This is the stop rule of transformers' assisted generation
(``assistant_confidence_threshold``) and the hand-set form of SpecDec++'s learned one (Huang et al.
2024, arXiv 2405.19715).

- **Greedy** runs (the drafter's softmax at temperature 1, the probability it gives its argmax): once
  the product is below ``min_prob`` in every row, that token is dropped and drafting stops.
- **Sampled** runs (the probability of the drawn token under the draft distribution that is
  verified): a token is kept when some row's product *before* it was still at least ``min_prob``, so
  the token that takes the product below is kept and drafting stops after it.

Exactness: in a sampled run, whether token k is proposed depends only on the tokens before it, never
on token k itself, so a proposed token is distributed as the draft distribution the verifier is told
(dropping the token that crossed the floor, as greedy runs do, would propose only likely tokens and
bias the output; the statistical suite checks sampled drafts row by row through the engine). Where
the draft stops never depends on the target's randomness; only speed changes.
"""

from __future__ import annotations

import torch

__all__ = ["ConfidenceStop", "check_min_prob", "row_confidence"]


def check_min_prob(min_prob: float, name: str = "min_prob") -> float:
    """``min_prob`` as a float in [0, 1); ``ValueError`` naming ``name`` otherwise."""
    if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float)) or not 0.0 <= min_prob < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {min_prob!r}")
    return float(min_prob)


def row_confidence(
    running: dict[int, float], row: int, p: float, *, greedy: bool, min_prob: float
) -> tuple[bool, bool]:
    """One row's stop (the slot drafters stop row by row): multiply ``p``, the drafter's probability
    of the row's new draft, into ``running[row]``; returns (keep this draft, stop after it). Greedy
    rows drop the token that takes the product below ``min_prob``; sampled rows keep it and stop
    after it (module doc: exactness)."""
    running[row] *= p
    below = running[row] < min_prob
    return (not below, below) if greedy else (True, below)


class ConfidenceStop:
    """Running product of the drafter's probabilities of its own drafted tokens, per row."""

    def __init__(self, min_prob: float, batch_size: int, device: torch.device | str) -> None:
        self.min_prob = check_min_prob(min_prob)
        self.running_B = torch.ones(batch_size, device=device, dtype=torch.float64)

    def keep(
        self,
        token_B: torch.Tensor,
        *,
        probs_BV: torch.Tensor | None = None,
        logits_BV: torch.Tensor | None = None,
    ) -> bool:
        """Multiply in each row's probability of ``token_B`` (a column index into ``probs_BV`` or
        ``logits_BV``); False means drop this token and stop. Greedy (``logits_BV``): False when every
        row's product is now below ``min_prob``. Sampled (``probs_BV``): False when every row's product
        was already below it before this token (module doc: exactness). With ``min_prob`` 0 it is
        always True and computes nothing."""
        if self.min_prob <= 0.0:
            return True
        sampled = probs_BV is not None
        if sampled and not bool((self.running_B >= self.min_prob).any()):
            return False
        if probs_BV is None:
            if logits_BV is None:
                raise ValueError("keep() needs probs_BV or logits_BV")
            probs_BV = torch.softmax(logits_BV.float(), dim=-1)
        p_B = probs_BV.gather(-1, token_B.unsqueeze(-1)).squeeze(-1).to(torch.float64)
        self.running_B = self.running_B * p_B
        return sampled or bool((self.running_B >= self.min_prob).any())
