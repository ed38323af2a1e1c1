"""The sizing and the printed G-test that the statistical suite's Monte-Carlo checks share.

Every check runs at false-alarm rate ALPHA; a mutation test misses a planted bias of total variation
≥ the design TV with probability ≤ BETA, at N = :meth:`Design.sample_size` samples
(tests/statistical/test_verify_distribution.py does the suite's arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.testing import (
    GoodnessOfFit,
    assert_same_distribution,
    goodness_of_fit,
    required_sample_size,
    total_variation,
)

ALPHA = 1e-6  # per-check false-alarm rate
BETA = 1e-6  # per-mutant miss rate at the design TV


@dataclass(frozen=True)
class Design:
    """Checks sized to catch any bias of total variation ≥ ``tv``."""

    tv: float

    def sample_size(self, expected: dict) -> int:
        return required_sample_size(self.tv, num_cells=max(len(expected), 2), alpha=ALPHA, beta=BETA)

    def check(self, counts, expected, label: str) -> GoodnessOfFit:
        """The G-test of ``counts`` against ``expected`` at ALPHA, printed with its total variation."""
        result = goodness_of_fit(counts, expected, alpha=ALPHA, label=label)
        print(result)
        print(f"  TV(empirical, expected) = {total_variation(counts, expected):.4f} (design TV {self.tv})")
        return result


def assert_tokens_follow(tokens_N: torch.Tensor, law_V: torch.Tensor, label: str) -> None:
    """``AssertionError`` unless the G-test at ALPHA accepts ``tokens_N`` as draws from ``law_V``."""
    V = law_V.shape[-1]
    counts_V = torch.bincount(tokens_N, minlength=V)
    counts = {x: int(counts_V[x]) for x in range(V)}
    assert_same_distribution(counts, {x: float(law_V[x]) for x in range(V)}, alpha=ALPHA, label=label)
