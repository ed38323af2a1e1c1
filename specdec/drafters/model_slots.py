"""``model`` and ``qself`` in the engine: one drafter, one draft-model forward per position for all rows.

Legend: S engine slots, G rows of a call, T block length, K a row's draft depth, V target vocabulary.

:class:`ModelSlotDrafter` is a :class:`~specdec.protocols.SlotDrafter`: the engine holds one for every
request. Its draft model (a separate small LM sharing the target's tokenizer, or for ``qself`` the
target's own int4 copy) has one cache row per engine slot; the drafter keeps, per slot, how many
committed tokens that row holds (``cached``). ``add`` prefills a request's prompt at its row. A step's
``propose`` runs **one** draft forward per draft position over every row still drafting: the first over
each row's committed tokens its row lacks (a block of the longest such run; a row that lacks fewer
recomputes slots it had), the next ones over the tokens just drafted. ``observe`` rolls every row back
to its committed tokens with one call.

What a row drafts depends on that row only where the draft model gives a row the same logits whatever
the other rows and the block's length (the native Llama target does: docs/engine.md); sampled rows draw
from the keyed ``noise`` (stream ``"draft"``, by output position), so a seed fixes their drafts. The
confidence stop (``min_prob``) is per row, as for the EAGLE slot drafter.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from specdec.drafters.confidence import check_min_prob, row_confidence
from specdec.drafters.model import SharedDraftModel, _load_draft, fit_vocab
from specdec.drafters.slot_table import SlotTable, draw_draft
from specdec.protocols import DecodeState, DraftCall, SlotProposal, Target, TargetOutput
from specdec.sampling import SamplingParams
from specdec.verify.noise import PositionNoise

__all__ = ["ModelSlotDrafter", "qself_slots"]


class ModelSlotDrafter(SlotTable):
    """A draft model over ``num_slots`` engine rows (``model`` in the engine; see the module doc).

    Args:
        target: the target (its vocabulary and device; the draft model must share its token ids).
        num_slots: the engine's cache rows.
        model, backend, dtype, device: the draft model, as :class:`~specdec.drafters.model.ModelDrafter`
            (a name or path loaded here, or a ready :class:`~specdec.protocols.Target` with the slot API).
        min_prob: per-row confidence stop (0: draft the depth asked).
        capacity: cache slots per row of the draft model (default: the draft model's context length,
            at most 2048, as the engine's ``max_model_len``).
    """

    def __init__(
        self,
        target: Target,
        *,
        num_slots: int,
        model: str | os.PathLike | Target | None = None,
        backend: str = "auto",
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        min_prob: float = 0.0,
        capacity: int | None = None,
    ) -> None:
        self.min_prob = check_min_prob(min_prob)
        self.vocab_size = int(target.vocab_size)
        super().__init__(num_slots)
        self.draft: Target = _load_draft(target, model, backend, dtype, device)
        self.shared = SharedDraftModel(self.draft, num_slots)  # checks the slot API
        limit = getattr(self.draft, "max_context_length", None) or 2048
        self.capacity = min(limit, 2048) if capacity is None else capacity
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 2:
            raise ValueError(f"capacity must be an int >= 2, got {capacity!r}")
        self.cached = [0] * num_slots  # per slot: committed tokens its draft-cache row holds

    # --- the protocol -------------------------------------------------------------------------------
    def add(self, slot: int, prompt_ids: Sequence[int], prefill_out: TargetOutput) -> None:
        """Prefill the prompt at the draft model's row ``slot`` (the committed first token waits for
        the first ``propose``)."""
        if len(prompt_ids) >= self.capacity:
            raise ValueError(
                f"prompt_ids: {len(prompt_ids)} tokens do not fit the draft cache ({self.capacity})"
            )
        self._take(slot, prompt_ids)
        self.shared.claim(self.capacity)
        device = getattr(self.draft, "device", "cpu")
        prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
        P = prompt.shape[1]
        self.draft.forward(
            prompt,
            torch.zeros(1, dtype=torch.long, device=device),
            logits_index_BN=torch.tensor([[P - 1]], device=device),
            rows_B=torch.tensor([slot]),
        )
        self.cached[slot] = P
        # the row holds the prompt and nothing past it (whatever an earlier request left there)
        self.draft.rollback(torch.tensor([P]), rows_B=torch.tensor([slot]))

    def drop(self, slot: int) -> None:
        self._free(slot)
        self.cached[slot] = 0

    def observe(
        self, slots: Sequence[int], num_accepted: Sequence[int], features: TargetOutput, *, state: DecodeState
    ) -> None:
        """Keep the accepted drafts, drop the rest: a row holds at most its committed tokens but the last."""
        slots = self._check_slots(slots)
        lengths = state.lengths_B.tolist()
        for s, n in zip(slots, lengths, strict=True):
            self.cached[s] = min(self.cached[s], n - 1)
        self.draft.rollback(
            torch.tensor([self.cached[s] for s in slots], dtype=torch.long), rows_B=torch.tensor(slots)
        )

    @torch.inference_mode()
    def propose(self, call: DraftCall) -> SlotProposal:
        """Up to ``depths[i]`` tokens for row ``slots[i]``: one draft forward per position over the rows
        still drafting (see the module doc)."""
        slots = self.check_propose(call)
        depths, state, sampling, noise = call.depths, call.state, call.sampling, call.noise
        G = len(slots)
        drafted: list[list[int]] = [[] for _ in range(G)]
        probs: list[list[torch.Tensor | None]] = [[] for _ in range(G)]
        rows = [i for i in range(G) if depths[i] > 0]
        if rows:
            self._draft(slots, depths, state, sampling, noise, rows, drafted, probs)
        counts = [len(d) for d in drafted]
        tokens_T = torch.tensor([t for d in drafted for t in d], dtype=torch.long)
        probs_TV = None
        if any(not s.greedy for s in sampling) and tokens_T.numel():
            zero_V = torch.zeros(self.vocab_size)
            probs_TV = torch.stack([zero_V if p is None else p for row in probs for p in row])
        return SlotProposal(tokens_T, counts, probs_TV)

    def _draft(
        self,
        slots: list[int],
        depths: Sequence[int],
        state: DecodeState,
        sampling: Sequence[SamplingParams],
        noise: PositionNoise | None,
        rows: list[int],
        drafted: list[list[int]],
        probs: list[list[torch.Tensor | None]],
    ) -> None:
        """The chain loop over ``rows`` (indices into ``slots``), each up to its depth."""
        device = getattr(self.draft, "device", "cpu")
        lengths = state.lengths_B.tolist()
        outputs = (state.lengths_B - state.prompt_lengths_B).tolist()  # output position of each row's draft 1
        # a row holds at most its committed tokens but the last (drafts past them are not verified yet,
        # even where no observe came between two proposals)
        T = max(lengths[i] - min(self.cached[slots[i]], lengths[i] - 1) for i in rows)
        start = [max(0, lengths[i] - T) for i in rows]
        at = torch.tensor(start).unsqueeze(1) + torch.arange(T)
        block_GT = state.tokens_BL[rows].gather(1, at.clamp(max=state.tokens_BL.shape[1] - 1))
        last_GN = torch.tensor([[lengths[i] - 1 - s] for i, s in zip(rows, start, strict=True)])
        start_G = torch.tensor(start)
        running = dict.fromkeys(rows, 1.0)
        fed = dict.fromkeys(rows, 0)
        for k in range(max(depths[i] for i in rows)):
            out = self.draft.forward(
                block_GT.to(device),
                start_G.to(device),
                logits_index_BN=last_GN.to(device),
                rows_B=torch.tensor([slots[i] for i in rows]),
            )
            for i in rows:
                fed[i] += 1
            logits_GV = fit_vocab(out.logits_BTV[:, -1].float().cpu(), self.vocab_size)
            go_on = []
            for j, i in enumerate(rows):
                token, p = draw_draft(logits_GV[j], sampling[i], noise, i, outputs[i] + k)
                keep, stop = self._confident(running, i, sampling[i], logits_GV[j], token, p)
                if keep:
                    drafted[i].append(token)
                    probs[i].append(p)
                if keep and not stop and k + 1 < depths[i]:
                    go_on.append((j, i, token))
            if not go_on:
                break
            rows = [i for _, i, _ in go_on]
            block_GT = torch.tensor([[t] for _, _, t in go_on])
            start_G = torch.tensor([lengths[i] + k for i in rows])
            last_GN = torch.zeros(len(rows), 1, dtype=torch.long)
        # cached now: the committed tokens but the last, and the drafts fed back
        for i, n in fed.items():
            self.cached[slots[i]] = lengths[i] - 1 + n

    def _confident(
        self,
        running: dict[int, float],
        row: int,
        params: SamplingParams,
        logits_V: torch.Tensor,
        token: int,
        probs_V: torch.Tensor | None,
    ) -> tuple[bool, bool]:
        """(keep this draft, stop after it): greedy rows drop the token that takes the running
        probability below ``min_prob``; sampled rows keep it and stop after it (docs/engine.md)."""
        if self.min_prob <= 0.0:
            return True, False
        p = float(torch.softmax(logits_V, dim=-1)[token]) if probs_V is None else float(probs_V[token])
        return row_confidence(running, row, p, greedy=params.greedy, min_prob=self.min_prob)


def qself_slots(
    target: Any, *, num_slots: int, weights: str = "int4", min_prob: float = 0.0
) -> ModelSlotDrafter:
    """``qself`` in the engine: the target's own ``weights`` copy (``int4`` or ``int8``) drafting for every
    row (:func:`specdec.drafters.qself.quantized_copy`)."""
    from specdec.drafters.qself import quantized_copy

    return ModelSlotDrafter(
        target, num_slots=num_slots, model=quantized_copy(target, weights), min_prob=min_prob
    )
