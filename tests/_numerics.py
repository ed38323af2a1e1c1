"""Numeric comparison helpers shared by the kernel tests."""

from __future__ import annotations

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64 (absolute error when expected is all zeros);
    asserts that ``actual`` is finite."""
    assert torch.isfinite(actual).all()
    denom = expected.double().norm().item()
    return (actual.double() - expected.double()).norm().item() / (denom if denom > 0 else 1.0)
