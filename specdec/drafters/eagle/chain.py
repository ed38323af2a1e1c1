"""The EAGLE chain drafter: γ tokens per row from the draft head's own predicted features.

Legend: B batch, T block length, D hidden size, N draft vocabulary, V target vocabulary, K draft
length (γ), L head-cache slots.

The head (:mod:`specdec.drafters.eagle.model`, run by its packed fast path) keeps a KV cache of
(feature, token) pairs. After each verification the target's true features of the committed
tokens replace the head's own predictions; then the chain continues from the head's prediction for
the next position. The catch-up is lazy (:mod:`specdec.drafters.eagle.queue`): ``observe`` only
queues the features, and ``catch_up`` runs every queued pair in one block when the head next
drafts, so a step at depth 0 (or one where prompt lookup proposes, in
:mod:`specdec.drafters.ngram_eagle`) costs the head nothing. At most ``max_queued`` tokens wait
between calls; past that ``observe`` catches up at once.
Greedy runs propose the head's argmax as a point-mass proposal (``probs_BKV=None``); sampling runs
draw from :func:`draft_distribution` and return it. Draft probabilities are zero outside the draft
vocabulary, which never affects exactness (verification handles any proposal).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from specdec.checks import check_logits
from specdec.drafters.confidence import ConfidenceStop, check_min_prob
from specdec.drafters.eagle.cache import EagleCache
from specdec.drafters.eagle.packed import PackedEagleHead
from specdec.drafters.eagle.queue import FeatureQueue
from specdec.drafters.eagle.weights import load_packed_head
from specdec.protocols import DecodeState, Proposal, TargetOutput
from specdec.sampling import SamplingParams, sample_from_probs, sampling_probs

__all__ = ["EagleDrafter", "draft_distribution", "full_vocabulary", "DEFAULT_MAX_QUEUED", "check_max_queued"]

_NO_FEATURES = "the EAGLE drafter needs target features: the target returned hidden_BTD=None"
DEFAULT_MAX_QUEUED = 512
"""Committed tokens that may wait for the head's catch-up between calls (see the module doc)."""


def check_max_queued(max_queued: int) -> int:
    """``max_queued`` as an int >= 0; ``ValueError`` otherwise."""
    if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 0:
        raise ValueError(f"max_queued must be an int >= 0, got {max_queued!r}")
    return max_queued


def draft_distribution(
    logits_BN: torch.Tensor, draft_vocab_N: torch.Tensor, vocab_size: int, sampling: SamplingParams
) -> torch.Tensor:
    """Full-vocabulary draft probabilities ``[B, V]`` from draft-vocabulary logits.

    Equal to ``logits_to_probs`` over the full vocabulary with −inf outside the draft vocabulary
    (the draft vocabulary is sorted by id, so top-k/top-p tie breaks agree).
    """
    return full_vocabulary(sampling_probs(logits_BN, sampling), draft_vocab_N, vocab_size)


def full_vocabulary(probs_BN: torch.Tensor, draft_vocab_N: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary probabilities ``[B, N]`` as full-vocabulary ones ``[B, V]`` (0 elsewhere)."""
    out = torch.zeros(*probs_BN.shape[:-1], vocab_size, dtype=torch.float32, device=probs_BN.device)
    return out.index_copy_(-1, draft_vocab_N, probs_BN)


class EagleDrafter:
    """EAGLE chain drafter (registered as ``eagle``).

    Args:
        target: a :class:`~specdec.protocols.FeatureTarget` (native Llama or ``HFTarget``).
        weights: a head file (path, or a file name in ``specdec/weights``); default: the shipped
            head for ``smollm2-135m``.
        draft_vocab_size: score only the n most frequent tokens of the stored draft vocabulary
            (faster head, lower acceptance); default: all of it.
        dtype: the head's dtype before packing (float32).
        linear_backend: ``specdec.targets.linear`` backend for the head's matrix products
            (``"auto"``: the packed CPU kernel where it builds; ``"reference"``: plain ``F.linear``).
        min_prob: confidence stop (:mod:`specdec.drafters.confidence`): stop the chain once the
            head's running probability of its own draft is below this in every row (0: always
            draft γ tokens).
        weight_dtype: storage of the packed weights (``"float32"`` or ``"bfloat16"``); default
            bfloat16 where the packed CPU kernel runs (:class:`PackedEagleHead`).
        head: an already loaded :class:`PackedEagleHead` for this target (drafters that share one
            head load and pack it once); then ``weights`` and the loading options are not used. A
            path instead (``--drafter-option eagle.head=DIR``) is read as ``weights``: a head file,
            or a speculators / SGLang EAGLE-3 directory (:mod:`specdec.drafters.eagle.formats`).
        max_queued: committed tokens whose features may wait for the head's lazy catch-up (0: catch
            up at every ``begin`` and ``observe``, eagerly).
    """

    def __init__(
        self,
        target: Any,
        *,
        weights: str | Path | None = None,
        draft_vocab_size: int | None = None,
        dtype: torch.dtype = torch.float32,
        linear_backend: str = "auto",
        min_prob: float = 0.0,
        weight_dtype: torch.dtype | str | None = None,
        head: PackedEagleHead | str | Path | None = None,
        max_queued: int = DEFAULT_MAX_QUEUED,
    ) -> None:
        self.min_prob = check_min_prob(min_prob)
        self.max_queued = check_max_queued(max_queued)
        if isinstance(head, (str, Path)):
            if weights is not None:
                raise ValueError(f"pass either head={head!r} (a path) or weights={weights!r}, not both")
            weights, head = head, None
        self.target = target
        if head is None:
            head, self.metadata = load_packed_head(
                target,
                weights,
                draft_vocab_size=draft_vocab_size,
                dtype=dtype,
                linear_backend=linear_backend,
                weight_dtype=weight_dtype,
            )
        else:
            self.metadata = {}
            if head.config.aux_layers:  # as load_packed_head does for a head it loads
                target.capture_layers(head.config.aux_layers)
        self.head = head
        self.vocab_size = head.config.vocab_size
        self.cache: EagleCache | None = None
        self.cache_len_B: torch.Tensor | None = None  # slots holding pairs with true target features
        self.queue: FeatureQueue | None = None  # true features waiting for the catch-up
        self.catch_up_s = 0.0
        """Seconds spent catching up so far: work owed for the committed tokens before the head drafts
        again, which the engine counts apart from its per-drafted-token cost."""
        self.catch_up_tokens = 0
        """Queued positions caught up so far (the longest row's, per catch-up)."""
        self._next_feat_BD: torch.Tensor | None = None

    # --- protocol -------------------------------------------------------------------------
    def begin(self, state: DecodeState, target_out: TargetOutput) -> None:
        """Queue the prompt's pairs ``(f_i, x_{i+1})``; they run when the head first drafts."""
        B, device = state.batch_size, self.head.device
        D, A = self.head.config.hidden_size, len(self.head.config.aux_layers)
        self.cache = EagleCache(self.head, B, state.tokens_BL.shape[1] + 64)
        self.cache_len_B = torch.zeros(B, dtype=torch.long, device=device)
        self.queue = FeatureQueue(B, (A + 1) * D, device, capacity=self.max_queued + 16)
        self._next_feat_BD = torch.zeros(B, D, device=device)
        self._enqueue(state, target_out)

    def observe(self, state: DecodeState, num_accepted_B: torch.Tensor, target_out: TargetOutput) -> None:
        """Queue the verified block's true features (drafted slots past them become stale); the
        head runs them when it next drafts, or now if more than ``max_queued`` tokens wait."""
        self._enqueue(state, target_out)

    def _enqueue(self, state: DecodeState, target_out: TargetOutput) -> None:
        """Queue each row's newly committed positions of a target block: the block starts at the
        row's first position not yet queued, and positions up to ``lengths - 2`` have features."""
        if self.queue is None or self.cache_len_B is None:
            raise ValueError("observe() called before begin()")
        if target_out.hidden_BTD is None:
            raise ValueError(_NO_FEATURES)
        T = target_out.hidden_BTD.shape[1]
        rows = zip(state.lengths_B.tolist(), self.cache_len_B.tolist(), self.queue.counts, strict=True)
        new_B = [max(0, min(T, n - 1 - cached - queued)) for n, cached, queued in rows]
        if max(new_B) > 0:
            self.queue.push(self._raw_features(target_out, max(new_B)), new_B)
        if self.queue.longest > self.max_queued:
            self.catch_up(state)

    @torch.inference_mode()
    def input_features(self, target_out: TargetOutput) -> torch.Tensor:
        """The head's input features ``[B, T, D]`` for a target block: the last layer's features,
        fused with the aux layers' for an EAGLE-3 head."""
        return self._project(self._raw_features(target_out))

    def _raw_features(self, target_out: TargetOutput, length: int | None = None) -> torch.Tensor:
        """What the queue holds for a target block (its first ``length`` positions): the last
        layer's features ``[B, T, D]``, with an EAGLE-3 head the aux layers' before them
        (``[B, T, (A + 1) · D]``), fused only at the catch-up (:meth:`_project`)."""
        if target_out.hidden_BTD is None:
            raise ValueError(_NO_FEATURES)
        hidden_BTD = target_out.hidden_BTD[:, :length].float()
        layers = self.head.config.aux_layers
        if not layers:
            return hidden_BTD
        aux = target_out.aux_hidden_BTD or {}
        missing = [i for i in layers if i not in aux]
        if missing:
            raise ValueError(
                f"the EAGLE-3 head needs the outputs of target layers {missing} (aux_hidden_BTD); "
                "the target was not asked to capture them (capture_layers)"
            )
        return torch.cat([*(aux[i][:, :length].float() for i in layers), hidden_BTD], dim=-1)

    def _project(self, raw_BTI: torch.Tensor) -> torch.Tensor:
        """The head's input features ``[B, T, D]`` of queued raw features (:meth:`_raw_features`)."""
        A, D = len(self.head.config.aux_layers), self.head.config.hidden_size
        if not A:
            return raw_BTI
        return self.head.project(raw_BTI[..., A * D :], raw_BTI[..., : A * D].unflatten(-1, (A, D)))

    def _check_propose(self, gamma: int) -> None:
        """``ValueError`` for a negative ``gamma`` or a call before :meth:`begin`."""
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        if self.cache is None:
            raise ValueError("propose() called before begin()")

    @torch.inference_mode()
    def propose(self, state: DecodeState, gamma: int, generator: torch.Generator | None = None) -> Proposal:
        """Draft ``gamma`` tokens per row (the head's argmax when greedy, else sampled)."""
        self._check_propose(gamma)
        B = state.batch_size
        if gamma == 0:  # a plain step: the committed tokens stay queued (lazy catch-up)
            return Proposal(torch.zeros(B, 0, dtype=torch.long, device=self.head.device), None)
        feat_BD = self.catch_up(state)
        device = feat_BD.device
        tokens, probs = [], []
        slot_B = self.cache_len_B.clone()
        prev_B = state.last_tokens_B().to(device)  # the token at the first draft pair's feature
        stop = ConfidenceStop(self.min_prob, B, device)
        for k in range(gamma):
            logits_BN = self.logits(feat_BD, k + 1)
            token_B, probs_BV = self.choose(logits_BN, state.sampling, generator)
            if self.min_prob > 0:
                if probs_BV is None:  # greedy: the head's own probability of its argmax (T = 1)
                    kept = stop.keep(logits_BN.argmax(dim=-1), logits_BV=logits_BN)
                else:
                    kept = stop.keep(token_B, probs_BV=probs_BV)
                if not kept:
                    break
            tokens.append(token_B)
            probs.append(probs_BV)
            if k + 1 < gamma:
                feat_BD = self.chain_step(feat_BD, token_B, slot_B, prev_B)
                slot_B, prev_B = slot_B + 1, token_B
        if not tokens:
            return Proposal(torch.zeros(B, 0, dtype=torch.long, device=device), None)
        probs_BKV = None if state.sampling.greedy else torch.stack(probs, dim=1)
        return Proposal(torch.stack(tokens, dim=1), probs_BKV)

    # --- pieces (also used by the tree drafter and by lookup-first drafters) --------------------
    def logits(self, feature_BD: torch.Tensor, position: int) -> torch.Tensor:
        """The head's draft-vocabulary logits of predicted features, checked for NaN / inf."""
        logits_BN = self.head.logits(feature_BD)
        check_logits(logits_BN, step=f"draft position {position}", source="the EAGLE head")
        return logits_BN

    def catch_up(self, state: DecodeState) -> torch.Tensor:
        """Run every queued pair in one block; return each row's next predicted feature [B, D].

        Row b's queued pairs fill slots ``cache_len[b] .. lengths[b]-2``: the feature at slot s
        (from the queue, which starts at ``cache_len[b]``) with committed token s+1. One forward of
        the head over T positions computes what T forwards of one would (the same inputs at the
        same slots and positions), equal up to float rounding: a kernel may sum in another order
        for another number of rows.
        """
        if self.cache is None or self.queue is None:
            raise ValueError("propose() called before begin()")
        if self.queue.longest == 0:
            return self._next_feat_BD
        t0 = time.perf_counter()
        self.catch_up_tokens += self.queue.longest
        try:
            return self._catch_up(state)
        finally:
            self.catch_up_s += time.perf_counter() - t0

    def _catch_up(self, state: DecodeState) -> torch.Tensor:
        """:meth:`catch_up` once the queue holds something."""
        raw_BTI, count_B = self.queue.take()
        feats_BTD = self._project(raw_BTI)  # EAGLE-3: the aux layers fused in one call for the block
        T = feats_BTD.shape[1]
        B, device = state.batch_size, feats_BTD.device
        slots_BT = self.cache_len_B.unsqueeze(1) + torch.arange(T, device=device)
        # Committed tokens at slots s .. s+T: x_s is each pair's previous token, x_{s+1} its token.
        window_BT1 = state.tokens_BL.to(device).gather(
            1,
            (self.cache_len_B.unsqueeze(1) + torch.arange(T + 1, device=device)).clamp(
                max=state.tokens_BL.shape[1] - 1
            ),
        )
        visible_BTL = torch.arange(int(slots_BT.max()) + 1, device=device) <= slots_BT.unsqueeze(-1)
        out_BTD = self.cache.step(
            self.head,
            feats_BTD[:, :T],
            window_BT1[:, 1:],
            slots_BT,
            slots_BT,
            visible_BTL,
            window_BT1[:, :-1],
        )
        last_B = (count_B - 1).clamp(min=0)
        has_B1 = (count_B > 0).unsqueeze(1)
        self._next_feat_BD = torch.where(
            has_B1, out_BTD[torch.arange(B, device=device), last_B], self._next_feat_BD
        )
        self.cache_len_B = self.cache_len_B + count_B
        return self._next_feat_BD

    def chain_step(
        self, feat_BD: torch.Tensor, token_B: torch.Tensor, slot_B: torch.Tensor, prev_B: torch.Tensor
    ) -> torch.Tensor:
        """One autoregressive draft step: pair ``(f̂, token)`` at ``slot_B`` → next ``f̂``
        (``prev_B``: the token at f̂'s position, for a ``prev_token_input`` head)."""
        slots_B1 = slot_B.unsqueeze(1)
        if bool((slot_B == slot_B[0]).all()):
            visible_B1L = None  # every row sees slots 0..slot: no mask needed
        else:
            visible_B1L = torch.arange(int(slot_B.max()) + 1, device=slot_B.device) <= slots_B1.unsqueeze(-1)
        out = self.cache.step(
            self.head,
            feat_BD.unsqueeze(1),
            token_B.unsqueeze(1),
            slots_B1,
            slots_B1,
            visible_B1L,
            prev_B.unsqueeze(1),
        )
        return out[:, 0]

    def choose(
        self, logits_BN: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pick a draft token per row: argmax when greedy, else a sample; returns (token, probs)."""
        if sampling.greedy:
            return self.head.draft_vocab_N[logits_BN.argmax(dim=-1)], None
        probs_BV = draft_distribution(logits_BN, self.head.draft_vocab_N, self.vocab_size, sampling)
        return sample_from_probs(probs_BV, generator), probs_BV
