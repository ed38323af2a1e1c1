"""The confidence stop of chain drafters (specdec.drafters.confidence)."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.drafters.confidence import ConfidenceStop, check_min_prob


def test_running_product_stops_when_every_row_is_below():
    """Sampled drafts: the token that takes every row below the floor is kept, the next one dropped
    (whether a token is proposed never depends on that token: exact)."""
    stop = ConfidenceStop(0.3, 2, "cpu")
    probs_BV = torch.tensor([[0.9, 0.1], [0.5, 0.5]])
    assert stop.keep(torch.tensor([0, 1]), probs_BV=probs_BV)  # 0.9, 0.5
    assert stop.keep(torch.tensor([0, 0]), probs_BV=probs_BV)  # 0.81, 0.25: row 0 still sure
    torch.testing.assert_close(stop.running_B, torch.tensor([0.81, 0.25], dtype=torch.float64))
    assert stop.keep(torch.tensor([1, 0]), probs_BV=probs_BV)  # kept (row 0 was at 0.81): 0.081, 0.125
    assert not stop.keep(torch.tensor([0, 0]), probs_BV=probs_BV)  # both were below: dropped
    # whatever the token: the decision was made before it
    again = ConfidenceStop(0.3, 1, "cpu")
    assert again.keep(torch.tensor([1]), probs_BV=probs_BV[:1])  # 0.1: below now, but kept
    assert not again.keep(torch.tensor([0]), probs_BV=probs_BV[:1])


def test_sampled_proposals_follow_the_draft_distribution():
    """The law of a kept first-and-second token is q x q: a stop that looked at the token itself
    would keep likely tokens only (the bias the engine's row-by-row Monte-Carlo check found)."""
    q = torch.tensor([[0.6, 0.4]])
    counts = torch.zeros(2, 2)
    for t0 in (0, 1):
        for t1 in (0, 1):
            stop = ConfidenceStop(0.5, 1, "cpu")
            kept0 = stop.keep(torch.tensor([t0]), probs_BV=q)
            kept1 = stop.keep(torch.tensor([t1]), probs_BV=q)
            counts[t0, t1] = float(kept0) * float(kept1)
    # the second token is kept after token 0 (0.6 >= 0.5) whatever it is, never after token 1
    assert counts.tolist() == [[1.0, 1.0], [0.0, 0.0]]


def test_logits_are_read_at_temperature_one():
    stop = ConfidenceStop(0.5, 1, "cpu")
    logits = torch.tensor([[math.log(3.0), 0.0]])  # softmax = 0.75, 0.25
    assert stop.keep(torch.tensor([0]), logits_BV=logits)  # 0.75
    assert stop.keep(torch.tensor([0]), logits_BV=logits)  # 0.5625
    assert stop.running_B.item() == pytest.approx(0.5625)
    assert not stop.keep(torch.tensor([0]), logits_BV=logits)  # 0.42


def test_zero_never_stops_and_bad_values_raise():
    stop = ConfidenceStop(0.0, 3, "cpu")
    assert stop.keep(torch.zeros(3, dtype=torch.long), probs_BV=torch.zeros(3, 4))
    for bad in (-0.1, 1.0, 2, "0.5", None, True):
        with pytest.raises(ValueError, match="min_prob"):
            check_min_prob(bad)
    with pytest.raises(ValueError, match="probs_BV or logits_BV"):
        ConfidenceStop(0.5, 1, "cpu").keep(torch.tensor([0]))
