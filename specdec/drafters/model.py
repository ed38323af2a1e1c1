"""The ``model`` drafter: an independent small causal LM that shares the target's tokenizer.

Legend: S engine slots, G rows of a call, T block length, K a row's draft depth, V target vocabulary.

Leviathan et al. 2023 (arXiv 2211.17192) and Chen et al. 2023 (arXiv 2302.01318): the draft model
samples its tokens autoregressively from its own distribution, processed by
:func:`specdec.sampling.sampling_probs` with the row's sampling parameters, and returns those
``draft_probs`` so verification stays exact. The draft model is itself a
:class:`specdec.protocols.Target` (loaded with :func:`specdec.targets.load_target`), with its own KV
cache and the slot API (``forward`` / ``rollback`` over ``rows_B``).

:class:`ModelDrafter` is a :class:`~specdec.protocols.SlotDrafter`: the engine holds one for every
request (``qself`` too, over the target's own int4 copy: :mod:`specdec.drafters.qself`). Its draft model
has one cache row per engine slot; the drafter keeps, per slot, how many committed tokens that row
holds (``cached``). ``add`` prefills a request's prompt at its row. A step's ``propose`` runs **one**
draft forward per draft position over every row still drafting: the first over each row's committed
tokens its row lacks (a block of the longest such run; a row that lacks fewer recomputes slots it
had), the next ones over the tokens just drafted. ``observe`` rolls every row back to its committed
tokens with one call.

What a row drafts depends on that row only where the draft model gives a row the same logits whatever
the other rows and the block's length (the native Llama target does: docs/engine.md); sampled rows draw
from the keyed ``noise`` (stream ``"draft"``, by output position), so a seed fixes their drafts. The
confidence stop (``min_prob``) is per row, as for the EAGLE drafter.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Any

import torch

from specdec.drafters.confidence import check_min_prob, row_confidence
from specdec.drafters.slot_table import SlotTable, draw_draft, ragged_proposal
from specdec.protocols import DecodeState, DraftCall, SlotProposal, Target, TargetOutput
from specdec.sampling import SamplingParams

__all__ = ["ModelDrafter", "check_same_vocab", "fit_vocab"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _vocab_of(tokenizer: Any) -> dict[str, int] | None:
    return tokenizer.get_vocab() if tokenizer is not None and hasattr(tokenizer, "get_vocab") else None


def check_same_vocab(target: Target, draft: Target) -> None:
    """Raise ``ValueError`` unless the draft model's token ids mean what the target's mean.

    With tokenizers on both sides their vocabularies (token → id) must be equal; the models' logit
    widths may still differ by padding rows. Without tokenizers the logit widths must be equal.
    """
    target_vocab = _vocab_of(getattr(target, "tokenizer", None))
    draft_vocab = _vocab_of(getattr(draft, "tokenizer", None))
    if target_vocab is not None and draft_vocab is not None:
        if target_vocab != draft_vocab:
            only_t = len(target_vocab.keys() - draft_vocab.keys())
            only_d = len(draft_vocab.keys() - target_vocab.keys())
            raise ValueError(
                "drafter model's tokenizer differs from the target's (vocab sizes "
                f"{len(draft_vocab)} vs {len(target_vocab)}, {only_d} / {only_t} tokens only on one side, or "
                "different ids); the 'model' drafter needs a model that shares the target's tokenizer"
            )
        if max(target_vocab.values(), default=-1) >= draft.vocab_size:
            raise ValueError(
                f"drafter model has {draft.vocab_size} logits, fewer than its tokenizer's ids "
                f"(max id {max(target_vocab.values())})"
            )
        return
    if int(draft.vocab_size) != int(target.vocab_size):
        raise ValueError(
            f"vocab mismatch: drafter model has vocab_size={draft.vocab_size}, target has "
            f"vocab_size={target.vocab_size} (and no tokenizers to compare)"
        )


def fit_vocab(logits_BV: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits over the target's ``vocab_size`` ids (padding rows cut off or filled with −inf)."""
    V_d = logits_BV.shape[-1]
    if V_d == vocab_size:
        return logits_BV
    if V_d > vocab_size:
        return logits_BV[..., :vocab_size]
    pad = logits_BV.new_full((*logits_BV.shape[:-1], vocab_size - V_d), float("-inf"))
    return torch.cat([logits_BV, pad], dim=-1)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when one of them names no index."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _load_draft(
    target: Target,
    model: str | os.PathLike | Target | None,
    backend: str,
    dtype: str | torch.dtype | None,
    device: str | torch.device | None = None,
) -> Target:
    """The draft model named by the ``model`` option, checked to share the target's token ids, loaded
    on ``device`` (default: the target's) in ``dtype`` (default: the target's compute dtype, when it
    has one); a ready draft model must already be on that device (``ValueError`` naming both)."""
    if model is None:
        raise ValueError(
            "drafter 'model' needs the option model=NAME_OR_PATH (a small causal LM that shares the "
            "target's tokenizer)"
        )
    if device is None:
        device = getattr(target, "device", "cpu")
    device = torch.device(device)
    if isinstance(model, (str, os.PathLike)):
        from specdec.targets import check_device, load_target

        options: dict[str, Any] = {"device": check_device(str(device))}
        if dtype is None and isinstance(getattr(target, "dtype", None), torch.dtype):
            dtype = target.dtype  # the draft model follows the target's dtype
        if dtype is not None:
            if isinstance(dtype, str):
                if dtype not in _DTYPES:
                    raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
                dtype = _DTYPES[dtype]
            options["dtype"] = dtype
        model = load_target(model, backend=backend, **options)
    elif not isinstance(model, Target):
        raise ValueError(f"model must be a name, a path or a Target, got {type(model).__name__}")
    else:
        have = torch.device(getattr(model, "device", "cpu"))
        if not _same_device(have, device):
            raise ValueError(
                f"the draft model is on {have}, the drafter runs on {device} (the target's device unless "
                "device= says otherwise): load it there"
            )
    check_same_vocab(target, model)
    return model


def _has_slot_api(model: Target) -> bool:
    """Do the model's ``forward`` and ``rollback`` take ``rows_B``?"""
    return all("rows_B" in inspect.signature(f).parameters for f in (model.forward, model.rollback))


class ModelDrafter(SlotTable):
    """A draft model over ``num_slots`` engine rows (``model`` in the engine; see the module doc).

    Args:
        target: the target (its vocabulary and device; the draft model must share its token ids).
        num_slots: the engine's cache rows (the engine sets it).
        model: the draft model (required): a built-in name or a local checkpoint directory, loaded
            here, or a ready :class:`~specdec.protocols.Target` with the slot API.
        backend: ``"auto"``, ``"hf"``, ``"llama"`` (:func:`specdec.targets.load_target`).
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` (default: the target's compute dtype).
        device: where the draft model is loaded (default: the target's).
        min_prob: per-row confidence stop (0: draft the depth asked).
        capacity: cache slots per row of the draft model (default: the draft model's context length,
            at most 2048, as the engine's ``max_model_len``).
    """

    def __init__(
        self,
        target: Target,
        *,
        num_slots: int = 1,
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
        if not _has_slot_api(self.draft):
            raise ValueError(
                f"the draft model {type(self.draft).__name__} has no slot API (forward/rollback over "
                "rows_B): each request drafts at its own cache row (load it with backend 'llama' or 'hf')"
            )
        self._reset_for: int | None = None  # the cache's slots per row, once reset
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
        if self._reset_for != self.capacity:  # the draft cache: num_slots rows of capacity slots
            self.draft.reset(self.num_slots, self.capacity)
            self._reset_for = self.capacity
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
        self.check_propose(call)
        drafted: list[list[int]] = [[] for _ in call.slots]
        probs: list[list[torch.Tensor | None]] = [[] for _ in call.slots]
        rows = [i for i, k in enumerate(call.depths) if k > 0]
        if rows:
            self._draft(call, rows, drafted, probs)
        return ragged_proposal(drafted, probs, call.sampling, self.vocab_size)

    def _draft(
        self,
        call: DraftCall,
        rows: list[int],
        drafted: list[list[int]],
        probs: list[list[torch.Tensor | None]],
    ) -> None:
        """The chain loop over ``rows`` (indices into the call), each up to its depth."""
        slots, depths, state, sampling, noise = call.slots, call.depths, call.state, call.sampling, call.noise
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
                processors = None if call.processors is None else call.processors[i]
                if processors is not None:  # drafted as the processed target would keep it
                    processed_V = processors.process_draft(logits_GV[j], drafted[i])
                    if processed_V is None:
                        continue  # its processors allow no token: the row stops here
                    logits_GV[j] = processed_V
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
