"""The EAGLE drafter: one instance per engine, state per engine cache row (slot), rows drafted at once.

Legend: S engine slots, G rows of a call, T block length, D hidden size, H query heads, Gk key/value
heads, d head dim, L head-cache slots, N draft vocabulary, V target vocabulary, K draft length (γ).

:class:`EagleDrafter` is a :class:`~specdec.protocols.SlotDrafter` (``eagle``, ``eagle-tree``, and the
head of ``ngram-eagle*`` and ``default``): the continuous-batching engine (:mod:`specdec.engine`) holds
one for all its requests, and a single request is a batch of one. It keeps, per engine slot, the
head's KV cache row, the head cache's length (pairs holding true target features) and the queue of
committed tokens' features waiting for the lazy catch-up (:mod:`specdec.drafters.eagle.queue`). A
step's ``propose`` runs **one** catch-up forward over every drafting row's queued features and then
**one** head forward per draft position for all rows still drafting: the head's weights stream from
memory once per position, not once per request.

Trees (``trees``): ``"never"`` drafts chains; ``"always"`` (``eagle-tree``) drafts each drafting row's
token tree on its own slot of the head cache (:mod:`specdec.drafters.eagle.tree`; each tree is
verified by a forward of its own); ``"auto"`` drafts the tree only for the one greedy row of a call
whose ``DraftCall.tree_ok`` says a tree pays, chains otherwise.

Batch invariance (a seed fixes the output whatever the neighbours): a row's drafts and draft
probabilities are bitwise those it gets proposed alone. The head's matrix products run on the packed
CPU kernel (:mod:`specdec.targets.linear`), which adds every row's terms in one order whatever the
number of rows; the other ops are per row or elementwise; attention, whose kernel may block its work
by shape, runs row by row over the row's own queries and visible slots, the same call as alone
(attention is a small part of a head step). With the ``reference`` / ``transposed`` linear backends
(BLAS), a row's floats may change with the number of rows beside it (docs/engine.md).

Randomness: a sampled row draws its draft token at output position p (the draft's index in the output
stream) from the keyed ``noise`` it is given (:class:`specdec.verify.noise.PositionNoise`, stream
``"draft"``; one keyed uniform per row and position, all of a call's in one hash, inverting the
draft vocabulary's cumulative probabilities: :func:`~specdec.sampling.inverse_cdf`), so its drafts
depend on its seed and position only.
Greedy rows propose the head's argmax as a point mass. Draft probabilities are zero outside the draft
vocabulary, which never affects exactness (verification handles any proposal).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdec.checks import check_logits
from specdec.drafters.confidence import check_min_prob, row_confidence
from specdec.drafters.eagle.cache import EagleCache
from specdec.drafters.eagle.packed import PackedEagleHead
from specdec.drafters.eagle.queue import FeatureQueue
from specdec.drafters.eagle.tree import EagleTrees
from specdec.drafters.eagle.weights import load_packed_head
from specdec.drafters.slot_table import SlotTable, ragged_proposal
from specdec.protocols import DecodeState, DraftCall, Proposal, SlotProposal, TargetOutput, TreeTarget
from specdec.sampling import SamplingParams, inverse_cdf, sampling_probs

__all__ = [
    "EagleDrafter",
    "eagle_tree",
    "DEFAULT_MAX_QUEUED",
    "TREE_MODES",
    "check_max_queued",
    "draft_distribution",
]

_CAPACITY = 256  # head-cache slots per row to start with (grown by doubling)
_NO_FEATURES = "the EAGLE drafter needs target features: the target returned hidden_BTD=None"
DEFAULT_MAX_QUEUED = 512
"""Committed tokens that may wait for the head's catch-up between calls (see the module doc)."""
TREE_MODES = ("never", "auto", "always")


def check_max_queued(max_queued: int) -> int:
    """``max_queued`` as an int >= 0; ``ValueError`` otherwise."""
    if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 0:
        raise ValueError(f"max_queued must be an int >= 0, got {max_queued!r}")
    return max_queued


def draft_distribution(
    logits_BN: torch.Tensor, draft_vocab_N: torch.Tensor, vocab_size: int, sampling: SamplingParams
) -> torch.Tensor:
    """Full-vocabulary draft probabilities ``[B, V]`` from draft-vocabulary logits: equal to
    ``sampling_probs`` over the full vocabulary with −inf outside the draft vocabulary (the draft
    vocabulary is sorted by id, so top-k/top-p tie breaks agree)."""
    return full_vocabulary(sampling_probs(logits_BN, sampling), draft_vocab_N, vocab_size)


def full_vocabulary(probs_BN: torch.Tensor, draft_vocab_N: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary probabilities ``[B, N]`` as full-vocabulary ones ``[B, V]`` (0 elsewhere)."""
    out = torch.zeros(*probs_BN.shape[:-1], vocab_size, dtype=torch.float32, device=probs_BN.device)
    return out.index_copy_(-1, draft_vocab_N, probs_BN)


class EagleDrafter(SlotTable):
    """The EAGLE drafter over ``num_slots`` engine rows (``eagle``; ``eagle-tree`` with
    ``trees="always"``; see the module doc).

    Args:
        target: a :class:`~specdec.protocols.FeatureTarget` (native Llama or ``HFTarget``; a
            :class:`~specdec.protocols.TreeTarget` for trees).
        num_slots: the engine's cache rows (``max_num_seqs``; the engine sets it).
        weights: a head file (path, or a file name in ``specdec/weights``); default: the shipped
            head for ``smollm2-135m``.
        draft_vocab_size: score only the n most frequent tokens of the stored draft vocabulary
            (faster head, lower acceptance); default: all of it.
        dtype: the head's dtype before packing (float32).
        linear_backend: ``specdec.targets.linear`` backend for the head's matrix products
            (``"auto"``: the packed CPU kernel where it builds; ``"reference"``: plain ``F.linear``).
        min_prob: per-row confidence stop (:mod:`specdec.drafters.confidence`): a row stops once the
            head's running probability of its own draft is below this (0: draft the depth asked).
        weight_dtype: storage of the packed weights (``"float32"`` or ``"bfloat16"``); default
            bfloat16 where the packed CPU kernel runs (:class:`PackedEagleHead`).
        head: an already loaded :class:`PackedEagleHead` for this target (then ``weights`` and the
            loading options are not used). A path instead (``--drafter-option head=DIR``) is read as
            ``weights``: a head file, or a speculators / SGLang EAGLE-3 directory
            (:mod:`specdec.drafters.eagle.formats`).
        max_queued: committed tokens whose features may wait for the lazy catch-up per row (0: catch
            up at every ``observe``).
        trees: ``"never"``, ``"auto"`` or ``"always"`` (module doc).
        tree, tree_nodes, tree_width, tree_min_prob: the trees' shape (:class:`EagleTrees`).
    """

    def __init__(
        self,
        target: Any,
        *,
        num_slots: int = 1,
        weights: str | Path | None = None,
        draft_vocab_size: int | None = None,
        dtype: torch.dtype = torch.float32,
        linear_backend: str = "auto",
        min_prob: float = 0.0,
        weight_dtype: torch.dtype | str | None = None,
        head: PackedEagleHead | str | Path | None = None,
        max_queued: int = DEFAULT_MAX_QUEUED,
        trees: str = "never",
        tree: Any = "dynamic",
        tree_nodes: int = 11,
        tree_width: int = 4,
        tree_min_prob: float = 0.0,
    ) -> None:
        super().__init__(num_slots)
        self.min_prob = check_min_prob(min_prob)
        self.max_queued = check_max_queued(max_queued)
        if trees not in TREE_MODES:
            raise ValueError(f"trees must be one of {TREE_MODES}, got {trees!r}")
        if trees == "always" and not isinstance(target, TreeTarget):
            raise ValueError(
                f"eagle-tree needs a target with tree attention and copy_slots (the native Llama target, "
                f"backend 'llama'); got {type(target).__name__}. Use the chain drafter 'eagle' instead."
            )
        self.trees = EagleTrees(tree, tree_nodes, tree_width, tree_min_prob)
        if trees == "auto" and not isinstance(target, TreeTarget):
            trees = "never"  # the target cannot verify a tree: chains only
        self.tree_mode = trees
        if isinstance(head, (str, Path)):
            if weights is not None:
                raise ValueError(f"pass either head={head!r} (a path) or weights={weights!r}, not both")
            weights, head = head, None
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
        self.head: PackedEagleHead = head
        self.vocab_size = head.config.vocab_size
        c, device = head.config, head.device
        self.cache = EagleCache(head, num_slots, _CAPACITY)
        self.cache_len = [0] * num_slots  # per slot: head-cache slots holding true-feature pairs
        self.queue = FeatureQueue(num_slots, (len(c.aux_layers) + 1) * c.hidden_size, device, capacity=64)
        self.next_feat_SD = torch.zeros(num_slots, c.hidden_size, device=device)
        self.counts = {"chain": 0, "tree": 0}
        """Rows drafted as chains and as trees."""

    # --- the protocol ---------------------------------------------------------------------------
    def add(self, slot: int, prompt_ids: Sequence[int], prefill_out: TargetOutput) -> None:
        """Queue the prompt's pairs ``(f_i, x_{i+1})`` at ``slot`` (they run when the row first drafts)."""
        self._take(slot, prompt_ids)
        self.cache_len[slot] = 0
        self.queue.counts[slot] = 0
        self.next_feat_SD[slot] = 0
        raw_1TI = self.raw_features(prefill_out)
        self.queue.push_rows([slot], raw_1TI, [min(raw_1TI.shape[1], len(prompt_ids))])

    def drop(self, slot: int) -> None:
        """Forget ``slot``'s request (its cache row is overwritten by the next one)."""
        self._free(slot)
        self.queue.counts[slot] = 0
        self.cache_len[slot] = 0

    def observe(
        self, slots: Sequence[int], num_accepted: Sequence[int], features: TargetOutput, *, state: DecodeState
    ) -> None:
        """Queue each row's newly committed positions of the verified block (positions up to
        ``lengths - 2`` have features); rows past ``max_queued`` catch up now."""
        slots = self._check_slots(slots)
        if features.hidden_BTD is None:
            raise ValueError(_NO_FEATURES)
        T = features.hidden_BTD.shape[1]
        lengths = state.lengths_B.tolist()
        new_G = [
            max(0, min(T, n - 1 - self.cache_len[s] - self.queue.counts[s]))
            for s, n in zip(slots, lengths, strict=True)
        ]
        if max(new_G, default=0) > 0:
            self.queue.push_rows(slots, self.raw_features(features, max(new_G)), new_G)
        over = [i for i, s in enumerate(slots) if self.queue.counts[s] > self.max_queued]
        if over:
            self.catch_up(slots, state, over)

    @torch.inference_mode()
    def propose(self, call: DraftCall) -> SlotProposal:
        """Up to ``depths[i]`` tokens for row ``slots[i]``: one catch-up forward over the drafting rows'
        queued features, then one head forward per draft position over the rows still drafting
        chains; a token tree instead for the rows that draft trees (``trees``, module doc)."""
        slots = self.check_propose(call)
        depths, state, sampling, noise = call.depths, call.state, call.sampling, call.noise
        G = len(slots)
        device = self.head.device
        drafting = [i for i in range(G) if depths[i] > 0]
        tree_rows = [i for i in drafting if self._drafts_tree(i, call)]
        chain_rows = [i for i in drafting if i not in tree_rows]
        drafted: list[list[torch.Tensor]] = [[] for _ in range(G)]  # per row: [token] per position
        probs: list[list[torch.Tensor | None]] = [[] for _ in range(G)]
        caught_s, caught = self.catch_up(slots, state, drafting) if drafting else (0.0, 0)
        if chain_rows:
            self._draft(call, chain_rows, drafted, probs)
        trees: list[tuple[list[int], Proposal]] = []
        for i in tree_rows:
            row_noise = None if noise is None else noise.select([i])
            tree = self.trees.draft(self, slots[i], depths[i], state.row(i), sampling[i], row_noise)
            K = tree.tokens_BK.shape[1]
            drafted[i] = list(tree.tokens_BK[0])
            probs[i] = [None] * K if tree.probs_BKV is None else list(tree.probs_BKV[0])
            if tree.tree is not None:
                trees.append(([i], tree))
        self.counts["chain"] += len(chain_rows)
        self.counts["tree"] += len(tree_rows)
        proposal = ragged_proposal(drafted, probs, sampling, self.vocab_size, device)
        proposal.catch_up_s, proposal.catch_up_tokens = caught_s, caught
        if G == 1 and trees:
            proposal.tree = trees[0][1]
        else:
            proposal.trees = trees
        return proposal

    def _drafts_tree(self, i: int, call: DraftCall) -> bool:
        """Whether row i of the call drafts a token tree (``trees``, module doc)."""
        if self.tree_mode == "always":
            return True
        return self.tree_mode == "auto" and call.size == 1 and call.tree_ok and call.sampling[i].greedy

    # --- the head's inputs ----------------------------------------------------------------------
    def logits(self, feature_GD: torch.Tensor, position: int) -> torch.Tensor:
        """The head's draft-vocabulary logits ``[G, N]`` of predicted features, checked for NaN / inf."""
        logits_GN = self.head.logits(feature_GD)
        check_logits(logits_GN, step=f"draft position {position}", source="the EAGLE head")
        return logits_GN

    @torch.inference_mode()
    def input_features(self, target_out: TargetOutput) -> torch.Tensor:
        """The head's input features ``[B, T, D]`` for a target block: the last layer's features,
        fused with the aux layers' for an EAGLE-3 head."""
        return self.project(self.raw_features(target_out))

    def raw_features(self, target_out: TargetOutput, length: int | None = None) -> torch.Tensor:
        """What the queue holds for a target block (its first ``length`` positions): the last
        layer's features ``[B, T, D]``, with an EAGLE-3 head the aux layers' before them
        (``[B, T, (A + 1) · D]``), fused only at the catch-up (:meth:`project`)."""
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

    def project(self, raw_BTI: torch.Tensor) -> torch.Tensor:
        """The head's input features ``[B, T, D]`` of queued raw features (:meth:`raw_features`)."""
        A, D = len(self.head.config.aux_layers), self.head.config.hidden_size
        if not A:
            return raw_BTI
        return self.head.project(raw_BTI[..., A * D :], raw_BTI[..., : A * D].unflatten(-1, (A, D)))

    # --- the pieces -----------------------------------------------------------------------------
    def _draft(
        self,
        call: DraftCall,
        rows: list[int],
        drafted: list[list[torch.Tensor]],
        probs: list[list[torch.Tensor | None]],
    ) -> None:
        """The chain loop over ``rows`` (indices into the call), each up to its depth."""
        slots, depths, state, sampling, noise = call.slots, call.depths, call.state, call.sampling, call.noise
        device = self.head.device
        index = torch.tensor(rows, dtype=torch.long)
        feat_GD = self.next_feat_SD[[slots[i] for i in rows]]
        prev_G = state.last_tokens_B()[index].to(device)  # the token at the first draft pair's feature
        position_G = (state.lengths_B - state.prompt_lengths_B)[index]  # output position of draft 1
        start = {i: self.cache_len[slots[i]] for i in rows}  # where row i's draft pairs go
        running = dict.fromkeys(rows, 1.0)  # confidence stop: the head's probability of its own draft
        K_max = max(depths[i] for i in rows)
        # the sampled rows' keyed uniforms for every draft position, in one hash (row i's at uniform_IK[i])
        sampled_J = [j for j, i in enumerate(rows) if not sampling[i].greedy]
        uniform_IK: dict[int, torch.Tensor] = {}
        if sampled_J:
            positions_JK = (position_G[sampled_J].unsqueeze(1) + torch.arange(K_max)).to(noise.device)
            sub = noise.select([rows[j] for j in sampled_J])
            u_JK = sub.uniform_BK(positions_JK, "draft", validate=False)
            uniform_IK = {rows[j]: u_JK[n] for n, j in enumerate(sampled_J)}
        for k in range(K_max):
            logits_GN = self.logits(feat_GD, k + 1)
            barred = self._process(call, rows, drafted, logits_GN)
            token_G = torch.empty(len(rows), dtype=torch.long, device=device)
            probs_G: list[torch.Tensor | None] = [None] * len(rows)
            groups: dict[SamplingParams, list[int]] = {}
            for j, i in enumerate(rows):
                groups.setdefault(sampling[i], []).append(j)
            for params, js in groups.items():
                at = torch.tensor(js, dtype=torch.long, device=device)
                if params.greedy:
                    token_G[at] = self.head.draft_vocab_N[logits_GN[at].argmax(dim=-1)]
                    continue
                # drawn over the draft vocabulary (one keyed uniform per row), reported over the full one;
                # the head's logits are checked (``logits``)
                probs_JN = sampling_probs(logits_GN[at], params, validate=False)
                u_J = torch.stack([uniform_IK[rows[j]][k] for j in js])
                drawn_J = inverse_cdf(probs_JN, u_J)
                token_G[at] = self.head.draft_vocab_N[drawn_J]
                probs_JV = full_vocabulary(probs_JN, self.head.draft_vocab_N, self.vocab_size)
                for n, j in enumerate(js):
                    probs_G[j] = probs_JV[n]
            decided = self._confident(rows, sampling, running, logits_GN, token_G, probs_G)
            for j in barred:  # the row's processors allow none of the head's tokens: it stops here
                decided[j] = (False, True)
            go_on = []
            for j, i in enumerate(rows):
                keep, stop = decided[j]
                if not keep:
                    continue
                drafted[i].append(token_G[j])
                probs[i].append(probs_G[j])
                if k + 1 < depths[i] and not stop:
                    go_on.append(j)
            if not go_on:
                return
            at = torch.tensor(go_on, dtype=torch.long, device=device)
            rows = [rows[j] for j in go_on]
            out_G1D = self._head_block(
                [slots[i] for i in rows],
                feat_GD[at].unsqueeze(1),
                token_G[at].unsqueeze(1),
                [start[i] + k for i in rows],
                [1] * len(rows),
                prev_G[at].unsqueeze(1),
            )
            feat_GD, prev_G, position_G = out_G1D[:, 0], token_G[at], position_G[go_on]

    def _process(
        self,
        call: DraftCall,
        rows: list[int],
        drafted: list[list[torch.Tensor]],
        logits_GN: torch.Tensor,
    ) -> list[int]:
        """Each row's logits processors on its logits at this draft position, in place, with its drafts
        so far as the path (``DraftCall.processors``); the rows (indices into ``rows``) whose
        processors allow none of the draft vocabulary (their logits are set to 0: drawn, not kept)."""
        if call.processors is None:
            return []
        barred = []
        for j, i in enumerate(rows):
            processors = call.processors[i]
            if processors is None:
                continue
            path = [int(t) for t in drafted[i]]
            processed_N = processors.process_draft(logits_GN[j], path, self.head.draft_vocab_N)
            if processed_N is None:
                barred.append(j)
                logits_GN[j] = 0.0
            else:
                logits_GN[j] = processed_N.to(logits_GN.dtype)
        return barred

    def _confident(
        self,
        rows: list[int],
        sampling: Sequence[SamplingParams],
        running: dict[int, float],
        logits_GN: torch.Tensor,
        token_G: torch.Tensor,
        probs_G: list[torch.Tensor | None],
    ) -> list[tuple[bool, bool]]:
        """Per row, (keep this draft, stop after it): the confidence stop row by row
        (:func:`~specdec.drafters.confidence.row_confidence`; a greedy row's probability is its
        softmax's largest, a sampled row's that of its drawn token)."""
        if self.min_prob <= 0.0:
            return [(True, False)] * len(rows)
        decided = []
        for j, i in enumerate(rows):
            if sampling[i].greedy:
                p = float(torch.softmax(logits_GN[j].float(), dim=-1).max())
            else:
                p = float(probs_G[j][token_G[j]])
            decided.append(row_confidence(running, i, p, greedy=sampling[i].greedy, min_prob=self.min_prob))
        return decided

    def catch_up(self, slots: list[int], state: DecodeState, rows: list[int]) -> tuple[float, int]:
        """Run rows ``rows``' (indices into ``slots`` and ``state``) queued pairs in one head forward;
        returns its seconds and positions (the longest row's).

        Row b's queued pairs fill head-cache slots ``cache_len .. lengths - 2``: the feature at slot s
        (from the queue, which starts at ``cache_len``) with committed token s + 1."""
        rows = [i for i in rows if self.queue.counts[slots[i]] > 0]
        if not rows:
            return 0.0, 0
        t0 = time.perf_counter()
        rows_G = [slots[i] for i in rows]
        raw_GTI, counts_G = self.queue.take_rows(rows_G)
        feats_GTD = self.project(raw_GTI)  # EAGLE-3: the aux layers fused for the block
        T, device = feats_GTD.shape[1], feats_GTD.device
        start_G = [self.cache_len[s] for s in rows_G]
        # committed tokens at slots s .. s + T: x_s each pair's previous token, x_{s+1} its token
        tokens_GL = state.tokens_BL[rows]
        at_GT1 = (torch.tensor(start_G).unsqueeze(1) + torch.arange(T + 1)).clamp(max=tokens_GL.shape[1] - 1)
        window_GT1 = tokens_GL.gather(1, at_GT1).to(device)
        out_GTD = self._head_block(
            rows_G, feats_GTD, window_GT1[:, 1:], start_G, counts_G, window_GT1[:, :-1]
        )
        last_G = torch.tensor(counts_G, device=device) - 1
        self.next_feat_SD[rows_G] = out_GTD[torch.arange(len(rows_G), device=device), last_G]
        for s, n in zip(rows_G, counts_G, strict=True):
            self.cache_len[s] += n
        return time.perf_counter() - t0, max(counts_G)

    def _head_block(
        self,
        rows_G: list[int],
        feature_GTD: torch.Tensor,
        tokens_GT: torch.Tensor,
        start_G: list[int],
        counts_G: list[int],
        prev_GT: torch.Tensor,
    ) -> torch.Tensor:
        """The head layer on a block of pairs: row i's ``counts_G[i]`` pairs at head-cache row
        ``rows_G[i]``, slots (and RoPE positions) ``start_G[i] + t``; returns the predicted features
        ``[G, T, D]`` (past a row's count: padding, and its keys/values land on slots never visible).

        The products run over all G·T positions at once; attention row by row, each row's query
        block against its own visible slots, so a row's numbers do not depend on the others."""
        head, cache, c = self.head, self.cache, self.head.config
        G, T = tokens_GT.shape
        device = tokens_GT.device
        slots_GT = torch.tensor(start_G, device=device).unsqueeze(1) + torch.arange(T, device=device)
        cache.ensure(int(slots_GT.max()) + 1)
        h_GTD = head.fuse(feature_GTD, tokens_GT, prev_GT)
        q, k, v = head.qkv(h_GTD, slots_GT)
        rows_GT = torch.tensor(rows_G, device=device).unsqueeze(1).expand(G, T)
        cache.k_BGLd[rows_GT, :, slots_GT] = k.transpose(1, 2)
        cache.v_BGLd[rows_GT, :, slots_GT] = v.transpose(1, 2)
        H, Gk, d = c.num_heads, c.num_kv_heads, c.head_dim
        attn_GHTd = q.new_zeros(G, H, T, d)
        for i, (r, s, n) in enumerate(zip(rows_G, start_G, counts_G, strict=True)):
            L = s + n
            mask = None
            if n > 1:  # query t (slot s + t) sees slots 0 .. s + t; grouped heads stacked as rows
                visible_nL = torch.arange(L, device=device) <= (s + torch.arange(n, device=device)).unsqueeze(
                    1
                )
                mask = visible_nL.repeat(H // Gk, 1)[None, None]
            attn = F.scaled_dot_product_attention(
                q[i : i + 1, :, :n].reshape(1, Gk, (H // Gk) * n, d),
                cache.k_BGLd[r : r + 1, :, :L],
                cache.v_BGLd[r : r + 1, :, :L],
                attn_mask=mask,
            )
            attn_GHTd[i, :, :n] = attn.reshape(H, n, d)
        return head.feature(head.finish(h_GTD, attn_GHTd))


def eagle_tree(target: Any, *, num_slots: int = 1, **options: Any) -> EagleDrafter:
    """``eagle-tree``: the EAGLE drafter drafting every row's token tree (EAGLE's fixed drafts)."""
    return EagleDrafter(target, num_slots=num_slots, trees="always", **options)
