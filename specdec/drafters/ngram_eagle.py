"""Prompt lookup first, the trained EAGLE head otherwise: ``ngram-eagle``, ``-tree``, ``-auto``, ``default``.

Legend: S engine slots, G rows of a call, K a row's draft depth, V target vocabulary.

:class:`NGramEagleDrafter` is a :class:`~specdec.protocols.SlotDrafter`: one instance per engine, a
single request being a batch of one. Per row and step: prompt lookup (:mod:`specdec.drafters.ngram`,
only n-grams of at least ``min_ngram`` tokens) over the row's own tokens; where it finds at least
``min_tokens`` tokens, they are the row's draft (a point mass), which costs nothing and is accepted
often when the text repeats itself. The other drafting rows go to **one**
:class:`~specdec.drafters.eagle.EagleDrafter` call (one head forward per draft position for all of
them). So a row's proposal depends on that row only, and a step of 8 rows costs the head ``K``
forwards, not ``8 K``. The head's catch-up on the committed tokens is lazy
(:mod:`specdec.drafters.eagle.queue`): after a lookup step or a plain step (depth 0) their features
wait, and the head runs them all in one block when it next drafts.

Modes (the head's ``trees``): ``chain`` never drafts trees; ``tree`` drafts every head row's token tree;
``auto`` (``default``) drafts the tree for the one greedy row of a call where the engine says a tree
pays (``DraftCall.tree_ok``: the row is verified alone and a tree-sized block costs at most 1.6× one
token here), the chain otherwise.

How deep to draft is not this drafter's choice: it drafts the depth it is asked for (the engine's
depth controller, :mod:`specdec.engine.depth`). Every proposal is verified as usual, so the output
distribution stays the target's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from specdec.drafters.eagle import EagleDrafter, resolve_weights
from specdec.drafters.eagle.drafter import DEFAULT_MAX_QUEUED
from specdec.drafters.eagle.weights import DEFAULT_WEIGHTS, read_head_file, target_mismatch
from specdec.drafters.ngram import NGramDrafter
from specdec.protocols import DecodeState, DraftCall, FeatureTarget, SlotProposal, TargetOutput, TreeTarget
from specdec.sampling import SamplingParams

__all__ = [
    "NGramEagleDrafter",
    "ngram_eagle",
    "ngram_eagle_tree",
    "ngram_eagle_auto",
    "default_drafter",
    "default_name",
]

_MODES = {"chain": "never", "tree": "always", "auto": "auto"}  # mode -> the head's trees

# Tuned on the 2-core CPU (specdec bench, greedy, held-out HumanEval + MT-Bench prompts, γ = 4 and 6):
# the confidence stop at 0.1–0.2 gained 3–4 % over none, the tree floor at 0.05–0.15 gained 5–11 %.
# ``eagle`` and ``eagle-tree`` keep EAGLE's fixed drafts (0) for comparison.
DEFAULT_MIN_PROB = 0.2
DEFAULT_TREE_MIN_PROB = 0.05


class NGramEagleDrafter:
    """Prompt lookup first, else the EAGLE head, over ``num_slots`` engine rows (see the module doc).

    Args:
        target: a :class:`~specdec.protocols.FeatureTarget` (and a ``TreeTarget`` for trees).
        num_slots: the engine's cache rows (the engine sets it).
        mode: ``"chain"``, ``"tree"`` or ``"auto"``.
        min_ngram, max_ngram: the lookup's n-gram sizes; min_tokens: the fewest tokens the lookup must
            find in a row to be used there.
        min_prob: the chain's confidence stop; tree_min_prob, tree, tree_nodes, tree_width: the
            tree's options; max_queued and the head's options (``weights``, ``draft_vocab_size``,
            ``dtype``, ``linear_backend``, ``weight_dtype``, or ``head``, an already loaded head): as
            :class:`~specdec.drafters.eagle.EagleDrafter`.

    ``counts`` counts the rows drafted by ``"lookup"``, by the ``"head"`` (chains) and by ``"tree"``.
    """

    def __init__(
        self,
        target: Any,
        *,
        num_slots: int = 1,
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
            raise ValueError(f"mode must be one of {tuple(_MODES)}, got {mode!r}")
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
            raise ValueError(f"min_tokens must be an int >= 1, got {min_tokens!r}")
        if mode == "tree" and not isinstance(target, TreeTarget):
            raise ValueError(
                f"mode 'tree' needs a target with tree attention and copy_slots (the native Llama target); "
                f"got {type(target).__name__}"
            )
        self.lookup = NGramDrafter(target, max_ngram=max_ngram, min_ngram=min_ngram)
        self.min_tokens = min_tokens
        self.eagle = EagleDrafter(
            target,
            num_slots=num_slots,
            min_prob=min_prob,
            max_queued=max_queued,
            trees=_MODES[mode],
            tree=tree,
            tree_nodes=tree_nodes,
            tree_width=tree_width,
            tree_min_prob=tree_min_prob,
            **head_options,
        )
        self.head, self.num_slots, self.mode = self.eagle.head, num_slots, mode
        self.vocab_size = self.eagle.vocab_size
        self.counts = {"lookup": 0, "head": 0, "tree": 0}

    @property
    def active(self) -> list[bool]:
        """Per slot: whether it holds a request (the head's slots)."""
        return self.eagle.active

    def add(self, slot: int, prompt_ids: Sequence[int], prefill_out: TargetOutput) -> None:
        self.eagle.add(slot, prompt_ids, prefill_out)

    def drop(self, slot: int) -> None:
        self.eagle.drop(slot)

    def observe(
        self, slots: Sequence[int], num_accepted: Sequence[int], features: TargetOutput, *, state: DecodeState
    ) -> None:
        self.eagle.observe(slots, num_accepted, features, state=state)

    def propose(self, call: DraftCall) -> SlotProposal:
        """Per row: the lookup's tokens where it finds ``min_tokens``, else the head's chain or tree (all
        such rows in one call)."""
        self.eagle.check_propose(call)
        depths, sampling = call.depths, call.sampling
        found = self.lookup.lookups(call.state, max(depths, default=0))
        looked = [d > 0 and len(f[:d]) >= self.min_tokens for f, d in zip(found, depths, strict=True)]
        head_depths = [0 if hit else d for hit, d in zip(looked, depths, strict=True)]
        self.counts["lookup"] += sum(looked)
        chains, trees = self.eagle.counts["chain"], self.eagle.counts["tree"]
        drafted = self.eagle.propose(call.with_depths(head_depths))
        self.counts["head"] += self.eagle.counts["chain"] - chains
        self.counts["tree"] += self.eagle.counts["tree"] - trees
        if not any(looked):
            return drafted
        return self._merge(drafted, found, looked, depths, sampling)

    def _merge(
        self,
        chains: SlotProposal,
        found: list[torch.Tensor],
        looked: list[bool],
        depths: Sequence[int],
        sampling: Sequence[SamplingParams],
    ) -> SlotProposal:
        """The head's chains (and trees) with the lookup rows' tokens in their places (point masses
        where sampled)."""
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
        return SlotProposal(
            torch.cat(tokens),
            counts,
            probs_TV,
            tree=chains.tree,
            trees=chains.trees,
            catch_up_s=chains.catch_up_s,
            catch_up_tokens=chains.catch_up_tokens,
        )


def ngram_eagle(target: Any, *, num_slots: int = 1, **options: Any) -> NGramEagleDrafter:
    """``ngram-eagle``: lookup first, else the head's chain."""
    return NGramEagleDrafter(target, num_slots=num_slots, mode="chain", **options)


def ngram_eagle_tree(target: Any, *, num_slots: int = 1, **options: Any) -> NGramEagleDrafter:
    """``ngram-eagle-tree``: lookup first, else the head's token tree."""
    return NGramEagleDrafter(target, num_slots=num_slots, mode="tree", **options)


def ngram_eagle_auto(target: Any, *, num_slots: int = 1, **options: Any) -> NGramEagleDrafter:
    """``ngram-eagle-auto`` (``default``): lookup first, else the head's chain, or its tree where the
    engine says a tree pays."""
    return NGramEagleDrafter(target, num_slots=num_slots, mode="auto", **options)


def _shipped_head_unavailable(target: Any) -> str | None:
    """Why the shipped head cannot serve ``target`` (None when it can); reads only metadata."""
    if not isinstance(target, FeatureTarget):
        return (
            f"the target {type(target).__name__} exposes no features for a draft head (not a FeatureTarget)"
        )
    path = resolve_weights(DEFAULT_WEIGHTS)
    _, meta = read_head_file(path, tensors=False)
    return target_mismatch(meta, target.parts().embed_VD, path)


def default_name(target: Any) -> str:
    """What ``default`` is for ``target``: ``ngram-eagle-auto`` where the shipped head serves it, else
    ``ngram`` (with a note on stderr saying why). The engine builds that name."""
    reason = _shipped_head_unavailable(target)
    if reason is None:
        return "ngram-eagle-auto"
    print(f"[specdec] drafter 'default' -> 'ngram': {reason}", file=sys.stderr)
    return "ngram"


def default_drafter(target: Any, *, num_slots: int = 1, **options: Any) -> Any:
    """``default``: ``ngram-eagle-auto`` for a target with a shipped head (today ``smollm2-135m``), else
    prompt lookup (``ngram``, with a note on stderr); options go to the drafter built."""
    from specdec.registry import DRAFTERS

    return DRAFTERS.get(default_name(target))(target, num_slots=num_slots, **options)
