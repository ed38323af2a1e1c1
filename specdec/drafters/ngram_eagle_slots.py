"""Prompt lookup first, else the EAGLE head, one instance per engine: ``ngram-eagle`` and ``ngram-eagle-auto``
(``default``) in the continuous-batching engine.

Legend: S engine slots, G rows of a call, K a row's draft depth, N tree nodes, V target vocabulary.

:class:`NGramEagleSlotDrafter` is a :class:`~specdec.protocols.SlotDrafter`: it does what
:class:`~specdec.drafters.ngram_eagle.NGramEagleDrafter` does for one request, for every slot of an
engine at once. Per row and step: prompt lookup (:mod:`specdec.drafters.ngram`) over the row's own
tokens; where it finds at least ``min_tokens`` tokens, they are the row's draft (a point mass); the
other drafting rows go to **one** :class:`~specdec.drafters.eagle.slots.EagleSlotDrafter` call (one
head forward per draft position for all of them). So a row's proposal depends on that row only, and
a step of 8 rows costs the head ``K`` forwards, not ``8 K``.

Trees (``auto``): where the engine says a tree pays (``DecodeState.tree_ok``: one row in the step,
a tree-sized block cheap on this target), a greedy row the lookup misses drafts EAGLE-2's dynamic tree
(:class:`~specdec.drafters.eagle.EagleTreeDrafter`) on its own slot of the shared head cache; its
committed features go through the same queue whatever it drafted. ``chain`` mode never drafts trees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specdec.drafters.eagle.chain import DEFAULT_MAX_QUEUED
from specdec.drafters.eagle.queue import FeatureQueue
from specdec.drafters.eagle.slots import EagleSlotDrafter
from specdec.drafters.eagle.tree import EagleTreeDrafter
from specdec.drafters.ngram import NGramDrafter
from specdec.drafters.ngram_eagle import DEFAULT_MIN_PROB, DEFAULT_TREE_MIN_PROB
from specdec.protocols import DecodeState, Proposal, SlotProposal, TargetOutput, TreeTarget
from specdec.sampling import SamplingParams
from specdec.verify.noise import PositionNoise

__all__ = ["NGramEagleSlotDrafter", "ngram_eagle_slots", "ngram_eagle_auto_slots"]

_MODES = ("chain", "auto")


class NGramEagleSlotDrafter:
    """Prompt lookup first, else the EAGLE head, over ``num_slots`` engine rows (see the module doc).

    Args:
        target: a :class:`~specdec.protocols.FeatureTarget` (and a ``TreeTarget`` for trees).
        num_slots: the engine's cache rows.
        mode: ``"auto"`` (trees where ``tree_ok`` for greedy rows) or ``"chain"``.
        min_ngram, max_ngram, min_tokens, min_prob, tree_min_prob, tree, tree_nodes, tree_width,
            max_queued, head options: as :class:`~specdec.drafters.ngram_eagle.NGramEagleDrafter`.

    ``counts`` counts the rows drafted by ``"lookup"``, by the ``"head"`` (chains) and by ``"tree"``.
    """

    def __init__(
        self,
        target: Any,
        *,
        num_slots: int,
        mode: str = "auto",
        min_ngram: int = 2,
        max_ngram: int = 3,
        min_tokens: int = 1,
        min_prob: float = DEFAULT_MIN_PROB,
        tree_min_prob: float = DEFAULT_TREE_MIN_PROB,
        tree: Any = "dynamic",
        tree_nodes: int = 11,
        tree_width: int = 4,
        max_queued: int = DEFAULT_MAX_QUEUED,
        **head_options: Any,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
            raise ValueError(f"min_tokens must be an int >= 1, got {min_tokens!r}")
        self.lookup = NGramDrafter(target, max_ngram=max_ngram, min_ngram=min_ngram)
        self.min_tokens = min_tokens
        self.eagle = EagleSlotDrafter(
            target, num_slots=num_slots, min_prob=min_prob, max_queued=max_queued, **head_options
        )
        self.head, self.num_slots, self.mode = self.eagle.head, num_slots, mode
        self.vocab_size = self.eagle.eagle.vocab_size
        self.trees: EagleTreeDrafter | None = None  # drafts a tree on one slot of the shared cache
        if mode == "auto" and isinstance(target, TreeTarget):
            self.trees = EagleTreeDrafter(
                target,
                head=self.head,
                tree=tree,
                tree_nodes=tree_nodes,
                tree_width=tree_width,
                tree_min_prob=tree_min_prob,
                max_queued=max_queued,
            )
            c = self.head.config
            self.trees.queue = FeatureQueue(1, (len(c.aux_layers) + 1) * c.hidden_size, self.head.device)
        self.counts = {"lookup": 0, "head": 0, "tree": 0}

    @property
    def catch_up_s(self) -> float:
        return self.eagle.catch_up_s

    @property
    def catch_up_tokens(self) -> int:
        return self.eagle.catch_up_tokens

    def add(self, slot: int, prompt_ids: Sequence[int], prefill_out: TargetOutput) -> None:
        self.eagle.add(slot, prompt_ids, prefill_out)

    def drop(self, slot: int) -> None:
        self.eagle.drop(slot)

    def observe(
        self, slots: Sequence[int], num_accepted: Sequence[int], features: TargetOutput, *, state: DecodeState
    ) -> None:
        self.eagle.observe(slots, num_accepted, features, state=state)

    def propose(
        self,
        slots: Sequence[int],
        depths: Sequence[int],
        *,
        state: DecodeState,
        sampling: Sequence[SamplingParams],
        noise: PositionNoise | None = None,
    ) -> SlotProposal:
        """Per row: the lookup's tokens where it finds ``min_tokens``, else the head's chain (all such rows
        in one call), or, for the only row of a ``tree_ok`` greedy step, the head's tree."""
        G = len(self.eagle.check_propose(slots, depths, sampling, state, noise))
        found = self.lookup.lookups(state, max(depths, default=0))
        looked = [d > 0 and len(f[:d]) >= self.min_tokens for f, d in zip(found, depths, strict=True)]
        head_depths = [0 if hit else d for hit, d in zip(looked, depths, strict=True)]
        self.counts["lookup"] += sum(looked)
        if self.trees is not None and G == 1 and state.tree_ok and sampling[0].greedy and head_depths[0] > 0:
            self.counts["tree"] += 1
            return self._tree(slots[0], head_depths[0], state)
        self.counts["head"] += sum(d > 0 for d in head_depths)
        chains = self.eagle.propose(slots, head_depths, state=state, sampling=sampling, noise=noise)
        if not any(looked):
            return chains
        return self._merge(chains, found, looked, depths, sampling)

    def _merge(
        self,
        chains: SlotProposal,
        found: list[torch.Tensor],
        looked: list[bool],
        depths: Sequence[int],
        sampling: Sequence[SamplingParams],
    ) -> SlotProposal:
        """The head's chains with the lookup rows' tokens in their places (point masses where sampled)."""
        device = chains.tokens_T.device
        tokens, probs, counts, at = [], [], [], 0
        sampled = any(not s.greedy for s in sampling)
        for i, hit in enumerate(looked):
            n = chains.counts_B[i]
            if hit:
                row = found[i][: depths[i]].to(device)
                tokens.append(row)
                counts.append(len(row))
                if sampled:
                    probs.append(torch.nn.functional.one_hot(row, self.vocab_size).float())
            else:
                tokens.append(chains.tokens_T[at : at + n])
                counts.append(n)
                if sampled:
                    part = chains.probs_TV
                    probs.append(
                        part[at : at + n]
                        if part is not None
                        else torch.zeros(n, self.vocab_size, device=device)
                    )
            at += n
        probs_TV = torch.cat(probs) if sampled and probs else None
        return SlotProposal(torch.cat(tokens), counts, probs_TV)

    def _tree(self, slot: int, depth: int, state: DecodeState) -> SlotProposal:
        """The dynamic tree for one greedy row, drafted on ``slot``'s row of the shared head cache
        (after that row's catch-up; the tree's nodes land past the row's length: stale slots)."""
        eagle, trees = self.eagle, self.trees
        eagle.catch_up([slot], state, [0])
        base = eagle.cache_len[slot]
        eagle.cache.ensure(base + depth * trees.tree_width + max(trees.tree_nodes, trees.tree.num_nodes) + 2)
        trees.cache = eagle.cache.row(slot)  # the slot's row of the shared cache, written in place
        trees.cache_len_B = torch.tensor([base], dtype=torch.long, device=self.head.device)
        trees._next_feat_BD = eagle.next_feat_SD[slot : slot + 1]
        proposal: Proposal = trees.propose(state, depth)
        K = proposal.tokens_BK.shape[1]
        return SlotProposal(proposal.tokens_BK[0], [K], None, tree=proposal if proposal.tree else None)


def ngram_eagle_slots(target: Any, **options: Any) -> NGramEagleSlotDrafter:
    """``ngram-eagle`` in the engine: lookup first, else the head's chain."""
    return NGramEagleSlotDrafter(target, mode="chain", **options)


def ngram_eagle_auto_slots(target: Any, **options: Any) -> NGramEagleSlotDrafter:
    """``ngram-eagle-auto`` (``default``) in the engine: lookup first, else the head's chain, or its
    tree where the engine says a tree pays."""
    return NGramEagleSlotDrafter(target, mode="auto", **options)
