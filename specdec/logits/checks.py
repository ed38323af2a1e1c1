"""Validation of the logits processors' settings (:class:`specdec.sampling.SamplingParams`), at the
boundary: ``ValueError`` naming the field and what was expected."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

__all__ = ["BAN", "check_bias", "check_processor_params"]

BAN = -100.0
"""A ``logit_bias`` of −100 (or below: refused) bans the token: its logit becomes −inf (OpenAI: "−100
should result in a ban")."""


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted ``(token id, bias)`` pairs: a mapping (JSON's string keys too) or
    pairs; ids ints >= 0 (checked against the vocabulary where the request is made), biases in
    [−100, 100]."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [tuple(item) for item in items]
    except TypeError:
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {value!r:.80}") from None
    out: dict[int, float] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"logit_bias must be a mapping of token id to bias, got {value!r:.80}")
        key, bias = pair
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, numbers.Integral) or key < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {key!r:.40}")
        if not _number(bias) or not -100.0 <= float(bias) <= 100.0:
            raise ValueError(f"logit_bias[{key}] must be a number in [-100, 100], got {bias!r:.40}")
        out[int(key)] = float(bias)
    return tuple(sorted(out.items()))


def check_processor_params(s: Any) -> None:
    """The penalties and ``min_tokens`` of a :class:`~specdec.sampling.SamplingParams`."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not _number(value) or not -2.0 <= value <= 2.0:
            raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
    r = s.repetition_penalty
    if not _number(r) or not r > 0:
        raise ValueError(f"repetition_penalty must be a number > 0 (1: none), got {r!r}")
    m = s.min_tokens
    if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 0:
        raise ValueError(f"min_tokens must be an int >= 0, got {m!r}")
