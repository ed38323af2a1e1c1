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
drafter needs no prefill and no rollback of its own.

:class:`LayerSkipDrafter` is a :class:`~specdec.protocols.SlotDrafter`: it keeps nothing per slot but
whether the slot holds a request, and each draft position is **one** ``forward_layers`` call over every
row still drafting, each at its own row of the target's cache (``rows_B``), past the row's length,
where that row's verify block then overwrites the layer-< N keys and values it wrote. A row's drafts
depend on that row only (the native target gives a row the same logits whatever the other rows);
sampled rows draw from the keyed ``noise`` (stream ``"draft"``, by output position), from
``sampling_probs(early-exit logits, the row's settings)``, and those probabilities (full vocabulary,
float32) are returned, so verification stays exact.

Legend: G rows of a call, K a row's draft depth, V vocabulary.

Without early-exit training (SmolLM2 has none) the exit layer's predictions are weak for small N,
and each draft token still pays the full LM head (on SmolLM2 the head alone is ~1/5 of a target
step), so N must be deep: see ``docs/targets.md`` for the exit layers' agreement with the target.
"""

from __future__ import annotations

import inspect

import torch

from specdec.drafters.slot_table import StatelessSlots, draw_draft, ragged_proposal
from specdec.protocols import DraftCall, SlotProposal, Target

__all__ = ["LayerSkipDrafter", "DEFAULT_EXIT_FRACTION"]

# Default exit depth as a fraction of the target's layers (SmolLM2-135M: 24 of 30), chosen from the
# α / cost sweep in docs/targets.md.
DEFAULT_EXIT_FRACTION = 0.8


class LayerSkipDrafter(StatelessSlots):
    """The target's first ``num_layers`` layers drafting for ``num_slots`` engine rows (see the module
    doc).

    The target must offer ``forward_layers(tokens_BT, start_B, *, num_layers, rows_B)`` (the native
    :class:`specdec.targets.llama.LlamaTarget` does; load targets with ``backend="llama"``).
    ``num_layers`` defaults to ``round(DEFAULT_EXIT_FRACTION · depth)``.
    """

    def __init__(self, target: Target, *, num_slots: int = 1, num_layers: int | None = None) -> None:
        super().__init__(num_slots)
        if not callable(getattr(target, "forward_layers", None)) or not hasattr(target, "config"):
            raise ValueError(
                f"drafter 'layerskip' needs a target with forward_layers(...) and a config (the native "
                f"Llama-family target, backend 'llama'); got {type(target).__name__}. The generic 'hf' "
                "backend keeps a per-row transformers cache that cannot be shared layer by layer"
            )
        if "rows_B" not in inspect.signature(target.forward_layers).parameters:
            raise ValueError(
                f"drafter 'layerskip' needs a target whose forward_layers takes rows_B (a cache row per "
                f"engine slot); {type(target).__name__}'s does not"
            )
        depth = int(target.config.num_layers)
        if num_layers is None:
            num_layers = max(1, min(depth - 1, round(DEFAULT_EXIT_FRACTION * depth)))
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < depth:
            raise ValueError(
                f"num_layers must be an int in [1, {depth - 1}] (the target has {depth}), got {num_layers!r}"
            )
        self.target, self.num_layers = target, num_layers
        self.vocab_size = int(target.vocab_size)

    @torch.inference_mode()
    def propose(self, call: DraftCall) -> SlotProposal:
        """``depths[i]`` tokens for row ``slots[i]``: one early-exit forward per position over the rows
        still drafting, at cache slots ``lengths - 1 + k``."""
        slots = self.check_propose(call)
        depths, state, sampling, noise = call.depths, call.state, call.sampling, call.noise
        G = len(slots)
        drafted: list[list[int]] = [[] for _ in range(G)]
        probs: list[list[torch.Tensor | None]] = [[] for _ in range(G)]
        rows = [i for i in range(G) if depths[i] > 0]
        lengths = state.lengths_B.tolist()
        outputs = (state.lengths_B - state.prompt_lengths_B).tolist()
        last = state.last_tokens_B().tolist()
        tokens = {i: last[i] for i in rows}
        for k in range(max((depths[i] for i in rows), default=0)):
            rows = [i for i in rows if depths[i] > k]
            out = self.target.forward_layers(
                torch.tensor([[tokens[i]] for i in rows], dtype=torch.long),
                torch.tensor([lengths[i] - 1 + k for i in rows], dtype=torch.long),
                num_layers=self.num_layers,
                rows_B=torch.tensor([slots[i] for i in rows]),
            )
            logits_GV = out.logits_BTV[:, -1].float().cpu()
            for j, i in enumerate(rows):
                tokens[i], p = draw_draft(logits_GV[j], sampling[i], noise, i, outputs[i] + k)
                drafted[i].append(tokens[i])
                probs[i].append(p)
        return ragged_proposal(drafted, probs, sampling, self.vocab_size)
