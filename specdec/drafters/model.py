"""The ``model`` drafter: an independent small causal LM that shares the target's tokenizer.

Legend: B batch, T block length, K draft length (γ), V vocabulary.

Leviathan et al. 2023 (arXiv 2211.17192) and Chen et al. 2023 (arXiv 2302.01318): the draft model
samples γ tokens autoregressively from its own distribution, processed by the same
:func:`specdec.sampling.logits_to_probs` with the run's sampling parameters, and returns those
``draft_probs`` so verification stays exact. The draft model is itself a
:class:`specdec.protocols.Target` (loaded with :func:`specdec.targets.load_target`), so it has its own
KV cache, which is rolled back to the committed tokens in :meth:`ModelDrafter.observe`.

Draft cache bookkeeping: ``cached_B`` counts the committed tokens held in the draft cache. After a
step where every draft was accepted, the last draft and the bonus token are both missing (and after
γ = 0 steps, every token committed meanwhile); the next :meth:`~ModelDrafter.propose` feeds every
row its last ``T = max(lengths - cached)`` committed tokens in one block (a row that needs fewer
simply recomputes slots it already had).

In the continuous-batching engine (:mod:`specdec.engine`) ``model`` by name is one
:class:`~specdec.drafters.model_slots.ModelSlotDrafter` for every request (one draft forward per
position for all rows). A ``ModelDrafter`` given to the engine as an object gives every request an
instance of its own (``slot=``, ``num_slots=``, :meth:`ModelDrafter.slot_factory`): the instances share
one draft model (:class:`SharedDraftModel`) whose cache holds one row per engine slot, and each runs its
request at its own row (``rows_B=[slot]``, the target's slot API).
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

from specdec.drafters.confidence import ConfidenceStop, check_min_prob
from specdec.protocols import DecodeState, Proposal, Target, TargetOutput
from specdec.sampling import sample_from_probs, sampling_probs

__all__ = ["ModelDrafter", "SharedDraftModel", "check_same_vocab", "fit_vocab"]

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


class SharedDraftModel:
    """One draft model shared by the per-request :class:`ModelDrafter` instances of one engine.

    Its cache holds ``num_slots`` rows, one per engine slot; the first instance to begin resets it
    to that request's capacity (the engine's ``max_model_len``, the same for every request), later
    ones find it ready. A row's old contents never matter: an instance prefills its row from slot 0.
    The draft model must have the slot API (``forward`` / ``rollback`` over ``rows_B``).
    """

    def __init__(self, draft: Target, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        if not _has_slot_api(draft):
            raise ValueError(
                f"the draft model {type(draft).__name__} has no slot API (forward/rollback over rows_B): "
                "the engine runs each request's draft at its own cache row (load it with backend 'llama' "
                "or 'hf')"
            )
        self.draft = draft
        self.num_slots = num_slots
        self.capacity: int | None = None  # the cache's slots per row, once reset

    def claim(self, capacity: int) -> None:
        """Make the cache ``num_slots`` rows × ``capacity`` slots (a reset only the first time)."""
        if self.capacity != capacity:
            self.draft.reset(self.num_slots, capacity)
            self.capacity = capacity


class ModelDrafter:
    """A :class:`specdec.protocols.Drafter` backed by a small causal LM.

    Options: ``model`` (required: a built-in name, a local checkpoint directory, or a ready
    :class:`specdec.protocols.Target`), ``backend`` (``"auto"``, ``"hf"``, ``"llama"``: see
    :func:`specdec.targets.load_target`), ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``;
    default: the target's compute dtype), ``device`` (default: the target's: the draft model is
    loaded there, so ``--device cuda`` puts it on the GPU beside the target),
    ``min_prob`` (confidence stop, :mod:`specdec.drafters.confidence`: stop the chain once the draft
    model's running probability of its own draft is below this in every row; 0 = always γ tokens).

    One request of the engine (set by its drafter pool): ``slot`` (this request's cache row),
    ``num_slots`` (the engine's rows) and ``shared`` (the :class:`SharedDraftModel` an earlier
    instance built; ``model``, ``backend``, ``dtype`` and ``device`` are then not read). Without ``slot`` the
    drafter owns the draft model's whole cache, a batch of B rows.
    """

    def __init__(
        self,
        target: Target,
        *,
        model: str | os.PathLike | Target | None = None,
        backend: str = "auto",
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        min_prob: float = 0.0,
        slot: int | None = None,
        num_slots: int | None = None,
        shared: SharedDraftModel | None = None,
    ) -> None:
        self.min_prob = check_min_prob(min_prob)
        self.vocab_size = int(target.vocab_size)
        self.cached_B: torch.Tensor | None = None
        if slot is not None and (isinstance(slot, bool) or not isinstance(slot, int) or slot < 0):
            raise ValueError(f"slot must be an int >= 0, got {slot!r}")
        if slot is None and (num_slots is not None or shared is not None):
            raise ValueError("num_slots and shared need slot (the request's cache row)")
        if shared is None:
            draft = _load_draft(target, model, backend, dtype, device)
            if slot is not None:
                if num_slots is None:
                    raise ValueError("slot needs num_slots (the engine's cache rows)")
                shared = SharedDraftModel(draft, num_slots)
        elif not isinstance(shared, SharedDraftModel):
            raise ValueError(f"shared must be a SharedDraftModel, got {type(shared).__name__}")
        elif num_slots is not None and num_slots != shared.num_slots:
            raise ValueError(f"num_slots={num_slots} differs from the shared model's {shared.num_slots}")
        if shared is not None:
            if slot >= shared.num_slots:
                raise ValueError(f"slot must be in [0, {shared.num_slots}), got {slot}")
            draft = shared.draft
        self.draft: Target = draft
        self.shared = shared
        self.slot = slot
        self.rows_B = None if slot is None else torch.tensor([slot])

    def slot_factory(self, num_slots: int) -> Callable[[int], ModelDrafter] | None:
        """Instances of this drafter for the requests of one engine given it as an object: each at
        its own row (``slot``) of this drafter's draft model, whose cache gets ``num_slots`` rows.
        None when the draft model has no slot API (the engine's pool then copies the drafter)."""
        if not _has_slot_api(self.draft):
            return None
        shared = SharedDraftModel(self.draft, num_slots)

        def at(slot: int) -> ModelDrafter:
            twin = copy.copy(self)
            twin.shared, twin.slot, twin.rows_B, twin.cached_B = shared, slot, torch.tensor([slot]), None
            return twin

        return at

    def _rows(self) -> dict[str, torch.Tensor]:
        """The ``rows_B`` keyword of this request's draft forwards and rollbacks (none alone)."""
        return {} if self.rows_B is None else {"rows_B": self.rows_B}

    def begin(self, state: DecodeState, target_out: TargetOutput) -> None:
        B, capacity = state.tokens_BL.shape
        if self.shared is None:
            self.draft.reset(B, capacity)
        elif B != 1:
            raise ValueError(f"a drafter at one cache row (slot {self.slot}) drafts one row, got B={B}")
        else:
            self.shared.claim(capacity)
        prompt_B = state.prompt_lengths_B
        self.draft.forward(
            state.tokens_BL[:, : int(prompt_B.max())],
            torch.zeros_like(prompt_B),
            logits_index_BN=(prompt_B - 1).unsqueeze(1),
            **self._rows(),
        )
        # Every committed token but the last is cached, as in the target.
        self.cached_B = torch.minimum(prompt_B, state.lengths_B - 1)
        self.draft.rollback(self.cached_B, **self._rows())

    def propose(self, state: DecodeState, gamma: int, generator: torch.Generator | None = None) -> Proposal:
        B = state.batch_size
        if gamma <= 0:
            return Proposal(tokens_BK=state.tokens_BL.new_empty((B, 0)))
        s = state.sampling
        lengths_B = state.lengths_B
        # Catch up on every committed token the draft cache lacks (one or two after a normal step,
        # more after γ = 0 steps): one block of T for all rows, ending at each row's last token
        # (a row shorter than T starts at slot 0 and fills its tail with undefined slots).
        T = int((lengths_B - self.cached_B).max())
        start_B = (lengths_B - T).clamp(min=0)
        block_BT = state.tokens_BL.gather(1, start_B.unsqueeze(1) + torch.arange(T, device=start_B.device))
        last_index_BN = (lengths_B - 1 - start_B).unsqueeze(1)
        tokens, probs = [], []
        stop = ConfidenceStop(self.min_prob, B, lengths_B.device)
        fed = 0  # blocks fed to the draft model
        for k in range(gamma):
            out = self.draft.forward(block_BT, start_B, logits_index_BN=last_index_BN, **self._rows())
            fed += 1
            # decided where the state lives (the host in the engine), whatever the draft model's device
            logits_BV = fit_vocab(out.logits_BTV[:, -1], self.vocab_size).to(lengths_B.device)
            draft_probs_BV = sampling_probs(logits_BV, s)
            token_B = sample_from_probs(draft_probs_BV, generator)
            # Greedy: the draft model's own softmax at T = 1; sampled: the verified draft distribution.
            if not stop.keep(token_B, probs_BV=None if s.greedy else draft_probs_BV, logits_BV=logits_BV):
                break
            tokens.append(token_B)
            probs.append(draft_probs_BV)
            start_B = lengths_B + k
            block_BT = token_B.unsqueeze(1)
            last_index_BN = torch.zeros_like(last_index_BN)
        # Cached now: the committed tokens and the drafts fed back (d_1 .. d_{γ-1} after a full
        # draft; d_1 .. d_K after a confidence stop at K tokens, which fed d_K before dropping d_{K+1}).
        self.cached_B = lengths_B - 1 + fed
        if not tokens:
            return Proposal(tokens_BK=state.tokens_BL.new_empty((B, 0)))
        return Proposal(tokens_BK=torch.stack(tokens, dim=1), probs_BKV=torch.stack(probs, dim=1))

    def observe(self, state: DecodeState, num_accepted_B: torch.Tensor, target_out: TargetOutput) -> None:
        # Keep the accepted drafts, drop the rest: at most lengths - 1 committed tokens are cached.
        self.cached_B = torch.minimum(self.cached_B, state.lengths_B - 1)
        self.draft.rollback(self.cached_B, **self._rows())
