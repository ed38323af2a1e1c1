"""Keyed randomness for the test helpers, and the adapter for verifiers that draw from a generator.

Legend: B rows, K draft length (γ), V vocabulary.

The product's rules take public randomness keyed by seed and position (``noise=``,
``positions_BK=``; :mod:`specdec.verify.noise`). The helpers here let one ``torch.Generator`` drive
them: :func:`keyed_randomness` draws each row's seed from it, so every call's draws are fresh and
independent, and :func:`with_generator` gives a keyed verifier the generator signature
``verify(target_probs_BKV, draft_tokens_BK, draft_probs_BKV=None, *, generator=None, validate=True)``
that :func:`specdec.testing.sample_output_distribution` calls. A third party's verifier written with
that signature (drawing from the generator it is given) is taken as it is, by the Monte-Carlo helper
and by the exact probe (:func:`specdec.testing.verifier_step_law`), so it still tests.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from specdec.verify.contract import validate_verify_inputs
from specdec.verify.noise import PositionNoise

__all__ = ["keyed_randomness", "is_keyed", "with_generator"]

_SEED_BOUND = 2**63 - 1


def keyed_randomness(generator: torch.Generator | None, positions_BK: torch.Tensor) -> dict[str, Any]:
    """``noise`` (each of the B rows' seeds drawn from ``generator``; the global one when None) and
    ``positions_BK`` (``[B, ...]``, as given), on the positions' device, as keyword arguments:
    ``rule(..., **keyed_randomness(g, positions_BK))``."""
    B = positions_BK.shape[0]
    seeds_B = torch.randint(0, _SEED_BOUND, (B,), generator=generator, dtype=torch.int64)
    return {"noise": PositionNoise(seeds_B, device=positions_BK.device), "positions_BK": positions_BK}


def is_keyed(verify_fn: Callable[..., Any]) -> bool:
    """Does ``verify_fn`` take keyed randomness (a ``noise`` argument)?"""
    try:
        return "noise" in inspect.signature(verify_fn).parameters
    except (TypeError, ValueError):
        return False


def with_generator(verify_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``verify_fn`` with the generator signature: a keyed verifier gets the rows' seeds drawn from the
    generator and positions 0..K (:func:`keyed_randomness`); any other is returned unchanged."""
    if not is_keyed(verify_fn):
        return verify_fn

    def verify(
        target_probs_BKV: torch.Tensor,
        draft_tokens_BK: torch.Tensor,
        draft_probs_BKV: torch.Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        validate: bool = True,
    ) -> Any:
        if validate:
            validate_verify_inputs(target_probs_BKV, draft_tokens_BK, draft_probs_BKV)
        B, K1 = target_probs_BKV.shape[:2]
        positions_BK = torch.arange(K1, device=target_probs_BKV.device).expand(B, K1)
        randomness = keyed_randomness(generator, positions_BK)
        return verify_fn(target_probs_BKV, draft_tokens_BK, draft_probs_BKV, validate=validate, **randomness)

    return verify
