"""The ``default`` drafter: the best drafter shipped for the target at hand.

``specdec generate --drafter default`` (and ``drafter="default"``) builds ``ngram-eagle-auto`` when
a trained EAGLE head ships for this target (``specdec/weights/``; today ``smollm2-135m``): prompt
lookup where the text repeats itself, the trained head everywhere else
(:mod:`specdec.drafters.fallback`), drafting a token tree for greedy single-row runs and a chain
otherwise (:mod:`specdec.drafters.by_mode`), the fastest exact drafters we measured on this target
for each kind of run. For any other target it falls back to prompt lookup (``ngram``), which needs
no weights, and says so once on stderr. Either way the output distribution is the target's: the
drafter only changes speed.

Options are passed to the chosen drafter. Asking for options of a specific drafter is asking for
that drafter: name it (``ngram-eagle-auto``, ``ngram-eagle``, ``eagle``, ``ngram``) instead of
``default``.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["default_drafter", "default_drafter_name"]

_FALLBACK = "ngram"


def _eagle_unavailable(target: Any) -> str | None:
    """Why the shipped EAGLE head cannot serve ``target`` (None when it can); reads only metadata."""
    from safetensors import safe_open

    from specdec.drafters.eagle import DEFAULT_WEIGHTS, resolve_weights, target_mismatch, target_parts

    try:
        path = resolve_weights(DEFAULT_WEIGHTS)
        parts = target_parts(target)
    except ValueError as err:
        return str(err)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return target_mismatch(meta, parts.embed_VD, path)


_WITH_HEAD = "ngram-eagle-auto"


def default_drafter_name(target: Any) -> str:
    """The registered drafter that ``default`` builds for ``target``: ``ngram-eagle-auto`` or ``ngram``."""
    return _WITH_HEAD if _eagle_unavailable(target) is None else _FALLBACK


def default_drafter(target: Any, **options: Any) -> Any:
    """Build ``ngram-eagle-auto`` for a target with a shipped head, else ``ngram`` (with a note on
    stderr).

    The returned drafter carries ``registry_name``, the name it was built under.
    """
    from specdec.registry import create_drafter

    reason = _eagle_unavailable(target)
    name = _WITH_HEAD if reason is None else _FALLBACK
    if reason is not None:
        print(f"[specdec] drafter 'default' -> '{_FALLBACK}': {reason}", file=sys.stderr)
    drafter = create_drafter(name, target, **options)
    drafter.registry_name = name
    return drafter
