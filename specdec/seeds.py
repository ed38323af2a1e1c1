"""Seeds: the one check every seed passes where it enters the library.

A seed is any integer in [0, 2**64): a Python ``int`` or a numpy integer (converted to ``int``).
``torch.Generator.manual_seed`` takes [-2**63, 2**64) and folds negative values onto the top of the
range (``-1`` seeds like ``2**64 - 1``), so the library maps our range onto it directly and refuses
negative seeds instead of aliasing them. This module imports nothing heavy: the command line checks
``--seed`` with it before torch is loaded.
"""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["SEED_LIMIT", "check_seed"]

SEED_LIMIT = 2**64
"""Seeds are ints in ``[0, SEED_LIMIT)``: the range of ``torch.Generator.manual_seed`` without aliases."""


def check_seed(seed: Any, name: str = "seed") -> int:
    """``seed`` as an ``int`` in [0, 2**64), or ``ValueError`` naming ``name``.

    Accepts ``int`` and numpy integer types (any ``numbers.Integral`` but ``bool``); refuses
    ``bool``, floats (even integral ones), strings, negative numbers and numbers >= 2**64.
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"{name} must be an int in [0, 2**64), got {seed!r} ({type(seed).__name__})")
    value = int(seed)
    if not 0 <= value < SEED_LIMIT:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {value}")
    return value
