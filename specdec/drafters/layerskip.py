"""The ``layerskip`` drafter: self-speculation with the target's own first N layers (early exit).

Legend: B batch, K draft length (γ), V vocabulary.

Elhoushi et al. 2024, "LayerSkip: Enabling Early Exit Inference and Self-Speculative Decoding"
(arXiv 2404.16710); Zhang et al. 2023, "Draft & Verify" (arXiv 2309.08168). The draft model is the
target truncated after layer N, followed by the target's own final norm and LM head, so there is
no second model to load and no tokenizer to match.

Cache sharing (LayerSkip's "cache reuse"): the first N layers of the target compute exactly the
keys and values the truncated model would for the same tokens, so the drafter has no cache of its
own. It writes its draft tokens' layer-< N keys/values into the target's cache at the slots the
verify block is about to overwrite anyway; the target's ``rollback`` keeps both in step, and the
drafter needs no prefill and no rollback of its own. In the engine ``layerskip`` by name is one
:class:`~specdec.drafters.layerskip_slots.LayerSkipSlotDrafter` for every row; a ``LayerSkipDrafter``
given as an object gives each request an instance at its cache row (``slot``: ``rows_B=[slot]``), which
writes that row only, past the row's length, where the row's verify block then overwrites those slots.

Draft tokens are sampled from ``sampling_probs(early-exit logits, state.sampling)`` and those
probabilities (full vocabulary, float32) are returned, so verification stays exact.

Without early-exit training (SmolLM2 has none) the exit layer's predictions are weak for small N,
and each draft token still pays the full LM head (on SmolLM2 the head alone is ~1/5 of a target
step), so N must be deep: see ``docs/targets.md`` for the exit layers' agreement with the target.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from specdec.protocols import DecodeState, Proposal, Target, TargetOutput
from specdec.sampling import sample_from_probs, sampling_probs

__all__ = ["LayerSkipDrafter", "DEFAULT_EXIT_FRACTION"]

# Default exit depth as a fraction of the target's layers (SmolLM2-135M: 24 of 30), chosen from the
# α / cost sweep in docs/targets.md.
DEFAULT_EXIT_FRACTION = 0.8


class LayerSkipDrafter:
    """A :class:`specdec.protocols.Drafter` that drafts with the target's first ``num_layers`` layers.

    The target must offer ``forward_layers(tokens_BT, start_B, *, num_layers)`` (the native
    :class:`specdec.targets.llama.LlamaTarget` does; load targets with ``backend="llama"``).
    ``num_layers`` defaults to ``round(DEFAULT_EXIT_FRACTION · depth)``. ``slot``: the cache row of
    the one request this drafter serves in the engine (``forward_layers`` over ``rows_B``); without
    it the drafter runs every cache row in order.
    """

    def __init__(self, target: Target, *, num_layers: int | None = None, slot: int | None = None) -> None:
        if not callable(getattr(target, "forward_layers", None)) or not hasattr(target, "config"):
            raise ValueError(
                f"drafter 'layerskip' needs a target with forward_layers(...) and a config (the native "
                f"Llama-family target, backend 'llama'); got {type(target).__name__}. The generic 'hf' "
                "backend keeps a per-row transformers cache that cannot be shared layer by layer"
            )
        depth = int(target.config.num_layers)
        if num_layers is None:
            num_layers = max(1, min(depth - 1, round(DEFAULT_EXIT_FRACTION * depth)))
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < depth:
            raise ValueError(
                f"num_layers must be an int in [1, {depth - 1}] (the target has {depth}), got {num_layers!r}"
            )
        if slot is not None:
            if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
                raise ValueError(f"slot must be an int >= 0, got {slot!r}")
            if "rows_B" not in inspect.signature(target.forward_layers).parameters:
                raise ValueError(
                    f"slot needs a target whose forward_layers takes rows_B; {type(target).__name__}'s "
                    "does not"
                )
        self.target = target
        self.num_layers = num_layers
        self.slot = slot
        self._rows = {} if slot is None else {"rows_B": torch.tensor([slot])}

    def slot_factory(self, num_slots: int) -> Callable[[int], LayerSkipDrafter]:
        """Instances of this drafter for the requests of one engine given it as an object, each at
        its request's cache row (``num_slots``: the engine's rows; nothing to share but the target)."""
        return lambda slot: LayerSkipDrafter(self.target, num_layers=self.num_layers, slot=slot)

    def begin(self, state: DecodeState, target_out: TargetOutput) -> None:
        """Nothing to prefill: the target's prefill already wrote layers < N of every prompt token."""

    def propose(self, state: DecodeState, gamma: int, generator: torch.Generator | None = None) -> Proposal:
        """Draft ``gamma`` tokens per row, one early-exit forward each, at slots ``lengths_B - 1 + k``."""
        B = state.batch_size
        V = int(self.target.vocab_size)
        if gamma <= 0:
            empty = state.tokens_BL.new_empty((B, 0))
            return Proposal(tokens_BK=empty, probs_BKV=torch.empty(B, 0, V, device=empty.device))
        sampling = state.sampling
        start_B = state.lengths_B - 1
        token_B1 = state.last_tokens_B()[:, None]
        tokens, probs = [], []
        for k in range(gamma):
            out = self.target.forward_layers(token_B1, start_B + k, num_layers=self.num_layers, **self._rows)
            probs_BV = sampling_probs(out.logits_BTV[:, -1], sampling)
            if sampling.greedy:
                token_B = probs_BV.argmax(-1)
            else:
                token_B = sample_from_probs(probs_BV, generator)
            token_B1 = token_B[:, None].to(state.tokens_BL)
            tokens.append(token_B1)
            probs.append(probs_BV)
        return Proposal(tokens_BK=torch.cat(tokens, dim=1), probs_BKV=torch.stack(probs, dim=1))

    def observe(self, state: DecodeState, num_accepted_B: torch.Tensor, target_out: TargetOutput) -> None:
        """Nothing to roll back: the verify block overwrote every slot this drafter wrote."""
