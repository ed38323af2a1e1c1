"""Prompt lookup first, the trained EAGLE head otherwise: ``ngram-eagle``, ``-tree``, ``-auto``, ``default``.

Legend: B batch, K draft length.

Prompt lookup (:mod:`specdec.drafters.ngram`, only n-grams of at least ``min_ngram`` tokens)
proposes when the text repeats itself, which costs nothing and is accepted often; otherwise the
EAGLE head drafts, a chain (:class:`~specdec.drafters.eagle.EagleDrafter`) or a token tree
(:class:`~specdec.drafters.eagle.EagleTreeDrafter`). The head is loaded and packed once; the EAGLE
drafter for a generation's mode is built when that mode is first needed, and it sees every
``begin`` and ``observe``. Its catch-up on the committed tokens is lazy
(:mod:`specdec.drafters.eagle.queue`): after a lookup step or a plain step (depth 0) their features
wait, and the head runs them all in one block when it next drafts, so steps where the head does not
draft cost it nothing.

Modes: ``chain``, ``tree``, or ``auto``: the tree for greedy single-row runs on a target with tree
attention, the chain otherwise (the dynamic tree is a greedy, single-row construction anyway); in
``auto`` mode the tree only at steps where ``DecodeState.tree_ok`` (the engine sets it: the row is
verified alone and a tree-sized block costs at most 1.6x one token here), the chain at the others.

How deep to draft is not this drafter's choice: it drafts the γ it is asked for (the engine's depth
controller, :mod:`specdec.engine.depth`, asks per request and step; γ = 0 is a plain step, whose
committed tokens wait for the head's lazy catch-up).

The choice is made per step for the whole batch: the lookup is used when every unfinished row has at
least ``min_tokens`` tokens from it. Either way the proposal is verified as usual, so the output
distribution stays the target's.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import torch

from specdec.drafters.eagle import EagleDrafter, EagleTreeDrafter, load_packed_head, resolve_weights
from specdec.drafters.eagle.chain import DEFAULT_MAX_QUEUED, check_max_queued
from specdec.drafters.eagle.weights import DEFAULT_WEIGHTS, read_head_file, target_mismatch
from specdec.drafters.ngram import NGramDrafter
from specdec.protocols import DecodeState, FeatureTarget, Proposal, TargetOutput, TreeTarget

__all__ = [
    "NGramEagleDrafter",
    "ngram_eagle",
    "ngram_eagle_tree",
    "ngram_eagle_auto",
    "default_drafter",
    "default_name",
]

_MODES = ("chain", "tree", "auto")

# Tuned on the 2-core CPU (specdec bench, greedy, held-out HumanEval + MT-Bench prompts, γ = 4 and 6):
# the confidence stop at 0.1–0.2 gained 3–4 % over none, the tree floor at 0.05–0.15 gained 5–11 %.
# ``eagle`` and ``eagle-tree`` keep EAGLE's fixed drafts (0) for comparison.
DEFAULT_MIN_PROB = 0.2
DEFAULT_TREE_MIN_PROB = 0.05


class NGramEagleDrafter:
    """Prompt lookup first, else an EAGLE chain or tree (see the module doc).

    Args:
        target: a :class:`~specdec.protocols.FeatureTarget` (and a ``TreeTarget`` for trees).
        mode: ``"chain"``, ``"tree"`` or ``"auto"``.
        min_ngram, max_ngram: the lookup's n-gram sizes; min_tokens: the fewest tokens the lookup
            must find in every running row to be used.
        min_prob: the chain's confidence stop; tree_min_prob, tree, tree_nodes, tree_width: the
            tree's options (:class:`~specdec.drafters.eagle.EagleTreeDrafter`).
        max_queued: committed tokens that may wait for the head's lazy catch-up
            (:class:`~specdec.drafters.eagle.EagleDrafter`).
        head_options: ``weights``, ``draft_vocab_size``, ``dtype``, ``linear_backend``,
            ``weight_dtype`` (:class:`~specdec.drafters.eagle.EagleDrafter`), or ``head``, an
            already loaded head.

    ``last_choice`` is ``"lookup"`` or ``"head"`` after each ``propose``; ``counts`` counts both;
    ``last_mode`` is the current generation's ``"chain"`` or ``"tree"``.
    """

    def __init__(
        self,
        target: Any,
        *,
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
        if mode == "tree" and not isinstance(target, TreeTarget):
            raise ValueError(
                f"mode 'tree' needs a target with tree attention and copy_slots (the native Llama target); "
                f"got {type(target).__name__}"
            )
        self.target, self.mode, self.min_tokens = target, mode, min_tokens
        self.lookup = NGramDrafter(target, max_ngram=max_ngram, min_ngram=min_ngram)
        head = head_options.pop("head", None)
        if isinstance(head, (str, Path)):  # a head directory or file given as ``head=`` (CLI)
            head_options.setdefault("weights", head)
            head = None
        if head is None:
            head, _ = load_packed_head(target, head_options.pop("weights", None), **head_options)
        elif head_options:
            raise ValueError(
                f"pass either head or the head's loading options, got head and {sorted(head_options)}"
            )
        self.head = head
        max_queued = check_max_queued(max_queued)
        self._options = {
            "chain": {"min_prob": min_prob, "max_queued": max_queued},
            "tree": {
                "tree_min_prob": tree_min_prob,
                "tree": tree,
                "tree_nodes": tree_nodes,
                "tree_width": tree_width,
                "max_queued": max_queued,
            },
        }
        for kind in ("chain", "tree") if mode == "auto" else (mode,):  # bad options fail now
            self._check_options(kind)
        self._drafters: dict[str, EagleDrafter] = {}
        self.last_mode: str | None = None
        self.last_choice: str | None = None
        self.counts = {"lookup": 0, "head": 0}

    def _check_options(self, kind: str) -> None:
        from specdec.drafters.confidence import check_min_prob

        if kind == "chain":
            check_min_prob(self._options["chain"]["min_prob"])
        else:
            check_min_prob(self._options["tree"]["tree_min_prob"], "tree_min_prob")

    def mode_for(self, state: DecodeState) -> str:
        """``"chain"`` or ``"tree"`` for a generation (``auto``: tree for greedy single rows; then
        each step drafts the tree only where ``state.tree_ok``, else the chain)."""
        if self.mode != "auto":
            return self.mode
        tree_run = state.sampling.greedy and state.batch_size == 1 and isinstance(self.target, TreeTarget)
        return "tree" if tree_run else "chain"

    def _eagle(self, kind: str) -> EagleDrafter:
        if kind not in self._drafters:
            cls = EagleTreeDrafter if kind == "tree" else EagleDrafter
            drafter = cls(self.target, head=self.head, **self._options[kind])
            if kind == "tree":  # its chain steps (auto mode) stop where the chain drafter's would
                drafter.min_prob = self._options["chain"]["min_prob"]
            self._drafters[kind] = drafter
        return self._drafters[kind]

    @property
    def eagle(self) -> EagleDrafter:
        """The EAGLE drafter of the current generation (in ``auto`` mode with trees, the tree's)."""
        if self.last_mode is None:
            raise ValueError("propose() or observe() called before begin()")
        return self._eagle(self.last_mode)

    @property
    def catch_up_s(self) -> float:
        """Seconds its EAGLE drafters spent catching up (:attr:`EagleDrafter.catch_up_s`)."""
        return sum(d.catch_up_s for d in self._drafters.values())

    @property
    def catch_up_tokens(self) -> int:
        """Positions its EAGLE drafters caught up (:attr:`EagleDrafter.catch_up_tokens`)."""
        return sum(d.catch_up_tokens for d in self._drafters.values())

    def _live(self) -> list[EagleDrafter]:
        """The EAGLE drafter that follows the generation: the one of its mode. In ``auto`` mode with
        trees, the tree drafter drafts chains too (its chain steps are the chain drafter's
        ``propose`` on the same head cache and feature queue: what the head holds of the committed
        tokens does not depend on how it drafts), so the committed features are queued once."""
        return [self.eagle]

    def begin(self, state: DecodeState, target_out: TargetOutput) -> None:
        self.last_mode = self.mode_for(state)
        for eagle in self._live():
            eagle.begin(state, target_out)

    def observe(self, state: DecodeState, num_accepted_B: torch.Tensor, target_out: TargetOutput) -> None:
        for eagle in self._live():
            eagle.observe(state, num_accepted_B, target_out)

    def propose(self, state: DecodeState, gamma: int, generator: torch.Generator | None = None) -> Proposal:
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        eagle = self.eagle  # raises before begin()
        draft = eagle.propose
        if self.mode == "auto" and self.last_mode == "tree" and not state.tree_ok:
            # a tree does not pay at this step: the tree drafter drafts a chain
            draft = functools.partial(EagleDrafter.propose, eagle)
        found = self.lookup.lookups(state, gamma)
        finished = state.finished_B.tolist()
        if gamma > 0 and all(len(f) >= self.min_tokens for b, f in enumerate(found) if not finished[b]):
            self._chose("lookup")  # the head's catch-up waits for its next draft
            return self.lookup.pack(state, found)
        self._chose("head")
        # gamma = 0: a plain step (the head's catch-up waits)
        return draft(state, gamma, generator)

    def _chose(self, which: str) -> None:
        self.last_choice = which
        self.counts[which] += 1


def ngram_eagle(target: Any, **options: Any) -> NGramEagleDrafter:
    """``ngram-eagle``: lookup first, else the head's chain."""
    return NGramEagleDrafter(target, mode="chain", **options)


def ngram_eagle_tree(target: Any, **options: Any) -> NGramEagleDrafter:
    """``ngram-eagle-tree``: lookup first, else an EAGLE token tree."""
    return NGramEagleDrafter(target, mode="tree", **options)


def ngram_eagle_auto(target: Any, **options: Any) -> NGramEagleDrafter:
    """``ngram-eagle-auto``: lookup first, else the tree for greedy single rows, the chain otherwise."""
    return NGramEagleDrafter(target, mode="auto", **options)


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
    ``ngram`` (with a note on stderr saying why). The engine builds that name (a slot drafter for
    ``ngram-eagle-auto``)."""
    reason = _shipped_head_unavailable(target)
    if reason is None:
        return "ngram-eagle-auto"
    print(f"[specdec] drafter 'default' -> 'ngram': {reason}", file=sys.stderr)
    return "ngram"


def default_drafter(target: Any, **options: Any) -> Any:
    """``default``: ``ngram-eagle-auto`` for a target with a shipped head (today ``smollm2-135m``), else
    prompt lookup (``ngram``, with a note on stderr). Options go to the drafter built; the returned
    drafter carries ``registry_name``, the name it was built under. How deep it drafts is the
    engine's depth controller's choice (:mod:`specdec.engine.depth`)."""
    name = default_name(target)
    drafter: Any = (
        ngram_eagle_auto(target, **options) if name == "ngram-eagle-auto" else NGramDrafter(target, **options)
    )
    drafter.registry_name = name
    return drafter
