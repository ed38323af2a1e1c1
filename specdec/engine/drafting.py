"""Drafters per request: each request gets its own drafter instance, added when it starts decoding
and dropped when it leaves (STYLE principle 14: a drafter adds and drops rows).

Legend: B = 1 (a drafter instance sees its request as a batch of one), L sequence capacity.

Instances share what is heavy: the first instance of an EAGLE-family drafter loads and packs the
head once, later ones get it as ``head=`` (:data:`SHARES_HEAD`). A drafter that runs a model of its own
through a cache shaped for one batch, or the target itself (``model``, ``qself``, ``layerskip``),
cannot run beside other requests yet and is refused by name (:data:`UNSUPPORTED`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from specdec.protocols import DecodeState, Drafter, TargetOutput
from specdec.registry import DRAFTERS, create_drafter
from specdec.sampling import SamplingParams

__all__ = ["DrafterPool", "UNSUPPORTED", "SHARES_HEAD", "row_state"]

UNSUPPORTED = {
    "model": "it runs its own draft model through a cache for one batch",
    "qself": "it runs its own int4 copy of the target through a cache for one batch",
    "layerskip": "it runs the target's own layers on the target's cache",
}
SHARES_HEAD = ("eagle", "eagle-tree", "ngram-eagle", "ngram-eagle-tree", "ngram-eagle-auto")


def resolve_default(target: Any) -> str:
    """What ``default`` means in the engine: ``ngram-eagle-auto`` for a target with a shipped EAGLE head
    (trees for greedy requests on a tree target, chains otherwise; the engine's depth controller,
    not the drafter's, decides how deep), else ``ngram``."""
    from specdec.drafters.ngram_eagle import _shipped_head_unavailable

    reason = _shipped_head_unavailable(target)
    if reason is None:
        return "ngram-eagle-auto"
    print(f"[specdec] drafter 'default' -> 'ngram': {reason}", file=sys.stderr)
    return "ngram"


class DrafterPool:
    """Builds a drafter instance for each request (``fresh``), sharing loaded heads."""

    def __init__(self, target: Any, drafter: str, options: Mapping[str, Any] | None) -> None:
        if not isinstance(drafter, str):
            raise ValueError(
                "drafter must be a registered name (the engine builds one instance per request), "
                f"got {drafter!r}"
            )
        DRAFTERS.get(drafter)  # an unknown name fails now, listing the known ones
        name = resolve_default(target) if drafter == "default" else drafter
        if name in UNSUPPORTED:
            raise ValueError(
                f"drafter {drafter!r} is not supported by the engine: {UNSUPPORTED[name]}; "
                "run it with specdec.generate"
            )
        self.target, self.name, self.options = target, name, dict(options or {})
        self._shared: dict[str, Any] = {}
        self.fresh()  # bad options fail at construction, not at the first request

    def fresh(self) -> Drafter:
        """A new drafter instance for one request."""
        drafter = create_drafter(self.name, self.target, **{**self.options, **self._shared})
        if self.name in SHARES_HEAD and "head" not in self._shared and "head" not in self.options:
            head = getattr(drafter, "head", None)
            if head is not None:
                self._shared["head"] = head
        if not isinstance(drafter, Drafter):
            raise ValueError(f"drafter {self.name!r} built {type(drafter).__name__}, not a Drafter")
        return drafter


def row_state(prompt_ids: list[int], capacity: int, sampling: SamplingParams) -> DecodeState:
    """A request's tokens as the one-row :class:`DecodeState` its drafter reads."""
    tokens_BL = torch.zeros((1, capacity), dtype=torch.long)
    tokens_BL[0, : len(prompt_ids)] = torch.tensor(prompt_ids, dtype=torch.long)
    n = torch.tensor([len(prompt_ids)], dtype=torch.long)
    return DecodeState(
        tokens_BL=tokens_BL,
        prompt_lengths_B=n,
        lengths_B=n.clone(),
        finished_B=torch.zeros(1, dtype=torch.bool),
        sampling=sampling,
    )


def join_outputs(parts: list[TargetOutput]) -> TargetOutput:
    """The prefill chunks' outputs as one (features concatenated along T; the last chunk's logits)."""
    last = parts[-1]
    hidden = None
    if all(p.hidden_BTD is not None for p in parts):
        hidden = torch.cat([p.hidden_BTD for p in parts], dim=1)
    aux = None
    if last.aux_hidden_BTD:
        aux = {i: torch.cat([p.aux_hidden_BTD[i] for p in parts], dim=1) for i in last.aux_hidden_BTD}
    return TargetOutput(logits_BTV=last.logits_BTV, hidden_BTD=hidden, aux_hidden_BTD=aux)
