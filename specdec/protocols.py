"""The plugin interfaces of the engine: a ``Target`` model, its optional capabilities, and a ``Drafter``.

Legend: B batch, T block length, K draft length (γ), N tree nodes, V vocabulary, D hidden size,
L sequence capacity.

The engine (:mod:`specdec.engine`) owns a :class:`DecodeState` with every row's committed tokens.
Invariant between steps: the target's KV cache holds ``lengths_B - 1`` tokens per row: every
committed token except the last one, which is fed first in the next verify block.

A verify block for row b is ``[last committed token, d_1 .. d_K]`` at cache slots
``lengths_B[b] - 1 ...``; its K+1 logits give the target distribution for d_1..d_K and for the
bonus token. Blocks are contiguous per row, so a causal mask over *slot index* is the only mask a
chain needs, and rolling back is moving a row's length: nothing is copied. A token tree is one
block too (its nodes in topological order, each attending its ancestors); after verification the
accepted path's keys/values are compacted into chain order (:meth:`TreeTarget.copy_slots`).

What a target must offer, by capability (each checked with ``isinstance``):

- every target: :class:`Target` (``vocab_size``, ``eos_token_ids``, ``reset``, ``forward``,
  ``rollback``); optional attributes ``tokenizer``, ``device`` and ``max_context_length``;
- tree drafters (``eagle-tree``): :class:`TreeTarget`, tree attention in ``forward`` and ``copy_slots``;
- feature-level drafters (EAGLE): :class:`FeatureTarget`, ``forward`` returns ``hidden_BTD``,
  ``parts()`` gives the embedding, final norm and LM head, ``capture_layers`` adds layer outputs;
- self-speculation (``layerskip``): :class:`LayerTarget`, ``forward_layers`` runs a sub-network.

Drafters come in two kinds: a :class:`SlotDrafter` is one instance per engine that keeps state per
engine cache row (slot), adds and drops slots as requests come and go, and drafts every row of a
step in one call, described by one :class:`DraftCall` (every built-in drafter; ``eagle``: one head
forward per draft position for all drafting rows); a :class:`Drafter`
is written for one generation, the simple way in for a plugin, and runs through one adapter
(:mod:`specdec.drafters.request_slots`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from specdec.sampling import SamplingParams

if TYPE_CHECKING:
    from specdec.verify.noise import PositionNoise

__all__ = [
    "TargetOutput",
    "TargetParts",
    "Target",
    "TreeTarget",
    "FeatureTarget",
    "LayerTarget",
    "Proposal",
    "DecodeState",
    "Drafter",
    "DraftCall",
    "SlotProposal",
    "SlotDrafter",
]


@dataclass
class TargetOutput:
    """What one target forward returns.

    ``logits_BTV``: float logits at the requested block positions (all T unless the call asked for
    fewer). ``hidden_BTD``: the last decoder layer's output (before the final norm) at every block
    position, or None when the target does not expose it (feature-level drafters need it).
    ``aux_hidden_BTD``: decoder layer index → that layer's output ``[B, T, D]`` at every block
    position, for the layers a drafter asked the target to capture (``capture_layers``; EAGLE-3
    heads fuse low, middle and last-layer features); None when none were asked for.
    """

    logits_BTV: torch.Tensor
    hidden_BTD: torch.Tensor | None = None
    aux_hidden_BTD: dict[int, torch.Tensor] | None = None

    def select(self, rows: Sequence[int]) -> TargetOutput:
        """Rows ``rows`` (any subset, in that order) as one output; this output itself for every row
        in order."""
        if len(rows) == self.logits_BTV.shape[0] and list(rows) == list(range(len(rows))):
            return self
        index = torch.tensor(rows, dtype=torch.long)
        aux = None if not self.aux_hidden_BTD else {k: h[index] for k, h in self.aux_hidden_BTD.items()}
        hidden = None if self.hidden_BTD is None else self.hidden_BTD[index]
        return TargetOutput(logits_BTV=self.logits_BTV[index], hidden_BTD=hidden, aux_hidden_BTD=aux)


@dataclass(frozen=True)
class TargetParts:
    """The target tensors a feature-level draft head reuses (shared, never copied or trained):
    the token embedding ``[V, D]``, the final RMSNorm's weight and epsilon, the LM head ``[V, D]``,
    and the architecture ``config`` (``hidden_size``, ``num_hidden_layers``, ``rope_parameters``
    or ``rope_theta``, ...)."""

    embed_VD: torch.Tensor
    norm_D: torch.Tensor
    norm_eps: float
    lm_head_VD: torch.Tensor
    config: Any


@runtime_checkable
class Target(Protocol):
    """A causal LM with a positional KV cache.

    Rows are independent: row b's block occupies cache slots ``start_B[b] .. start_B[b]+T-1`` and
    attends to slots ``< start_B[b]`` plus the block's own causal prefix. Slots past a row's valid
    length may hold stale entries from rejected drafts; they are never attended because every
    block overwrites its slots before attending.

    Optional attributes the engine reads when present: ``device`` (where token tensors live),
    ``tokenizer`` (stop strings) and ``max_context_length`` (prompt + new tokens + γ + 1 must fit).
    One target serves one generation at a time: :func:`specdec.generate` holds a lock on it.
    """

    vocab_size: int
    """Size of the logits' last dim."""

    eos_token_ids: tuple[int, ...]
    """Token ids that end a sequence."""

    def reset(self, batch_size: int, max_len: int) -> None:
        """Prepare an empty cache for ``batch_size`` rows of up to ``max_len`` tokens each."""
        ...

    def forward(
        self,
        tokens_BT: torch.Tensor,
        start_B: torch.Tensor,
        *,
        logits_index_BN: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run a block, write its keys/values to the cache, return its logits.

        ``logits_index_BN`` (optional) selects, per row, the block positions whose logits are
        wanted (prefill needs only each row's last prompt token); default: all T.
        """
        ...

    def rollback(self, lengths_B: torch.Tensor) -> None:
        """Declare that row b's cache holds only its first ``lengths_B[b]`` slots. O(1)."""
        ...


@runtime_checkable
class TreeTarget(Target, Protocol):
    """A target that verifies a token tree in one call (SpecInfer, arXiv 2305.09781)."""

    def forward(
        self,
        tokens_BT: torch.Tensor,
        start_B: torch.Tensor,
        *,
        logits_index_BN: torch.Tensor | None = None,
        tree_mask_TT: torch.Tensor | None = None,
        depth_T: torch.Tensor | None = None,
    ) -> TargetOutput:
        """As :meth:`Target.forward`; with ``tree_mask_TT[i, j]`` (block token i may attend block
        token j, diagonal set) and ``depth_T`` (rope position offsets) the block is a tree."""
        ...

    def copy_slots(self, src_slots_BN: torch.Tensor, dst_start_B: torch.Tensor) -> None:
        """Move the keys/values at slots ``src_slots_BN[b]`` to ``dst_start_B[b] + arange(N)``."""
        ...


@runtime_checkable
class FeatureTarget(Target, Protocol):
    """A target whose features a draft head reads (EAGLE): ``forward`` sets ``hidden_BTD``."""

    def parts(self) -> TargetParts:
        """The embedding, final norm and LM head (the head shares them) and the config."""
        ...

    def capture_layers(self, layers: Sequence[int]) -> None:
        """Also return these decoder layers' outputs from ``forward`` (``aux_hidden_BTD``)."""
        ...


@runtime_checkable
class LayerTarget(Target, Protocol):
    """A target that runs a sub-network of itself (self-speculation, LayerSkip arXiv 2404.16710)."""

    def forward_layers(
        self,
        tokens_BT: torch.Tensor,
        start_B: torch.Tensor,
        *,
        num_layers: int | None = None,
        layers: Sequence[int] | None = None,
        logits_index_BN: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Some of its layers, then the final norm and LM head; leaves the cache's lengths alone."""
        ...


@dataclass
class Proposal:
    """A drafter's guess: ``tokens_BK`` long, and ``probs_BKV`` (float32, full target vocab,
    processed by ``logits_to_probs`` with the run's sampling params) or None for a deterministic
    proposal. K may be smaller than the γ asked for, and may be 0.

    ``tree`` (optional): a :class:`specdec.verify.token_tree.TreeProposal`; the engine then verifies
    the whole tree in one target call (the target must be a :class:`TreeTarget`), and ``tokens_BK``
    / ``probs_BKV`` are its first-candidate path (a valid chain proposal where a tree does not
    pay). The engine checks every proposal (shapes, dtypes, id range, finite normalised
    probabilities) before the target sees it."""

    tokens_BK: torch.Tensor
    probs_BKV: torch.Tensor | None = None
    tree: Any | None = None


@dataclass
class DecodeState:
    """Per-row token history shared by the engine and the drafters.

    ``tokens_BL``: prompt and committed tokens (slots past ``lengths_B`` are undefined);
    ``prompt_lengths_B``; ``lengths_B``: valid tokens per row; ``finished_B``: rows that hit a stop
    condition (the engine keeps them in the batch but ignores their output). ``sampling`` and
    ``tree_ok`` are what a :class:`Drafter` written for one request reads (the adapter sets them from
    its row's :class:`DraftCall`): the generation's settings, and whether a token tree pays at this
    step (the row is verified alone, since a tree takes a forward of its own, and a tree-sized block
    costs little more than one token on this machine). A :class:`SlotDrafter` reads both from the
    call. Neither ever changes what is emitted, only how fast.
    """

    tokens_BL: torch.Tensor
    prompt_lengths_B: torch.Tensor
    lengths_B: torch.Tensor
    finished_B: torch.Tensor
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tree_ok: bool = True

    @property
    def batch_size(self) -> int:
        return self.tokens_BL.shape[0]

    def last_tokens_B(self) -> torch.Tensor:
        """The last committed token of every row (the first token of the next verify block)."""
        rows = torch.arange(self.batch_size, device=self.tokens_BL.device)
        return self.tokens_BL[rows, self.lengths_B - 1]

    def select(self, rows: Sequence[int]) -> DecodeState:
        """Rows ``rows`` (any subset, in that order) as one state; this state itself for every row in
        order."""
        if len(rows) == self.batch_size and list(rows) == list(range(len(rows))):
            return self
        index = torch.tensor(rows, dtype=torch.long)
        pick = lambda t: t[index.to(t.device)]  # noqa: E731
        return DecodeState(
            tokens_BL=pick(self.tokens_BL),
            prompt_lengths_B=pick(self.prompt_lengths_B),
            lengths_B=pick(self.lengths_B),
            finished_B=pick(self.finished_B),
            sampling=self.sampling,
            tree_ok=self.tree_ok,
        )

    def row(self, b: int) -> DecodeState:
        """Row ``b`` alone, as a batch of one (views of this state's tensors)."""
        return DecodeState(
            tokens_BL=self.tokens_BL[b : b + 1],
            prompt_lengths_B=self.prompt_lengths_B[b : b + 1],
            lengths_B=self.lengths_B[b : b + 1],
            finished_B=self.finished_B[b : b + 1],
            sampling=self.sampling,
            tree_ok=self.tree_ok,
        )


@runtime_checkable
class Drafter(Protocol):
    """Proposes up to γ tokens per row; learns how many were accepted.

    Call order per generation: ``begin`` once after the target's prefill, then for each step
    ``propose`` → (target verifies) → ``observe``. A drafter with its own cache rolls it back in
    ``observe``. Exactness never depends on the drafter: any proposal, however bad, leaves the
    output distribution equal to the target's; the drafter only sets the speed.
    """

    def begin(self, state: DecodeState, target_out: TargetOutput) -> None:
        """Start a new generation; ``target_out`` is the prefill output (``hidden_BTD`` may be set)."""
        ...

    def propose(self, state: DecodeState, gamma: int, generator: torch.Generator | None = None) -> Proposal:
        """Return up to ``gamma`` draft tokens per row, continuing ``state``'s committed tokens."""
        ...

    def observe(self, state: DecodeState, num_accepted_B: torch.Tensor, target_out: TargetOutput) -> None:
        """After verification: ``state`` already holds the newly committed tokens; ``target_out``
        is the verify block's output along the committed path (for drafters that read target
        features): for a tree, the root and the accepted nodes in path order."""
        ...


@dataclass
class DraftCall:
    """One :meth:`SlotDrafter.propose`: the rows that draft in a step, described once.

    ``slots``: the rows' engine cache rows (distinct); ``depths``: at most this many drafts for each
    (ints >= 0; 0: none); ``state``: the rows' committed tokens, row i for ``slots[i]``
    (:func:`specdec.engine.units.group_state`; its ``sampling`` and ``tree_ok`` are not read:
    they are the fields below); ``sampling``: each row's settings; ``noise``: one seed per row, a
    sampled row's randomness (stream ``"draft"``, keyed by output position; None where no row is
    sampled); ``tree_ok``: a drafter that can draft a token tree may (the engine sets it where the call
    has one row, verified alone, and a tree-sized block costs little more than one token);
    ``processors``: each row's logits processors (:class:`specdec.logits.Processors`, None for a row
    that has none; None where no row has any). A drafter with a distribution applies row i's to its
    logits at every draft position, with the drafts before it as the position's path
    (:meth:`~specdec.logits.Processors.process_draft`), so it drafts what the processed target would
    keep; exactness does not depend on it (the rule compares every draft with the processed target).
    """

    slots: Sequence[int]
    depths: Sequence[int]
    state: DecodeState
    sampling: Sequence[SamplingParams]
    noise: PositionNoise | None = None
    tree_ok: bool = False
    processors: Sequence[Any] | None = None

    def __post_init__(self) -> None:
        G = len(self.slots)
        if len(self.depths) != G or len(self.sampling) != G or self.state.batch_size != G:
            raise ValueError(
                f"depths ({len(self.depths)}), sampling ({len(self.sampling)}) and state "
                f"({self.state.batch_size} rows) must have one entry per slot ({G})"
            )
        if any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in self.depths):
            raise ValueError(f"depths must be ints >= 0, got {list(self.depths)}")
        if self.noise is not None and self.noise.num_rows != G:
            raise ValueError(f"noise must have one seed per slot ({G}), got {self.noise.num_rows}")
        if self.processors is not None and len(self.processors) != G:
            raise ValueError(f"processors must have one entry per slot ({G}), got {len(self.processors)}")

    @property
    def size(self) -> int:
        """G: the rows of the call."""
        return len(self.slots)

    def select(self, rows: Sequence[int]) -> DraftCall:
        """Rows ``rows`` (indices into this call, in that order) as a call of their own."""
        rows = list(rows)
        return DraftCall(
            [self.slots[i] for i in rows],
            [self.depths[i] for i in rows],
            self.state.select(rows),
            [self.sampling[i] for i in rows],
            None if self.noise is None else self.noise.select(rows),
            self.tree_ok,
            None if self.processors is None else [self.processors[i] for i in rows],
        )

    def with_depths(self, depths: Sequence[int]) -> DraftCall:
        """The same rows asking for ``depths`` instead."""
        return replace(self, depths=list(depths))


@dataclass
class SlotProposal:
    """A :class:`SlotDrafter`'s ragged chains, one per proposed row in the order asked.

    ``tokens_T``: every row's draft tokens back to back (row i's are ``tokens_T[offsets[i] :
    offsets[i] + counts_B[i]]``, ``offsets`` the running sum of ``counts_B``); ``counts_B``: each
    row's number of drafts (at most its depth, 0 allowed); ``probs_TV``: float32 full-vocabulary draft
    probabilities of each token, or None when every row is greedy (point-mass proposals); a greedy
    row's entries in a mixed proposal are zeros, to be ignored. ``tree``: for a call of one row, a
    token-tree :class:`Proposal` instead of its chain (``tokens_T`` then holds the tree's main path).
    ``trees``: token trees instead of the chains of some rows of a call of several, as (the rows'
    indices in the call, a tree :class:`Proposal` over those rows, one tree shape); each is verified
    by a forward of its own.

    What the call cost apart from drafting on: ``catch_up_s``, seconds of work owed for committed
    tokens (a draft head's pass over the tokens it has not seen; 0 if none), and ``catch_up_tokens``,
    the positions of that work (the longest row's).
    """

    tokens_T: torch.Tensor
    counts_B: list[int]
    probs_TV: torch.Tensor | None = None
    tree: Proposal | None = None
    trees: list[tuple[list[int], Proposal]] = field(default_factory=list)
    catch_up_s: float = 0.0
    catch_up_tokens: int = 0

    def chains(self, index: Sequence[int], greedy: bool) -> Proposal:
        """Rows ``index`` (of equal counts) as one chain :class:`Proposal` ``[G, K]`` (a point mass
        where ``greedy``)."""
        K = self.counts_B[index[0]]
        if any(self.counts_B[i] != K for i in index):
            raise ValueError(
                f"index must select rows of equal counts, got {[self.counts_B[i] for i in index]}"
            )
        starts = [sum(self.counts_B[:i]) for i in index]
        at = torch.tensor([s + k for s in starts for k in range(K)], dtype=torch.long)
        tokens_GK = self.tokens_T[at.to(self.tokens_T.device)].view(len(index), K)
        if greedy or self.probs_TV is None or K == 0:  # point masses, or nothing drafted
            return Proposal(tokens_GK, None)
        return Proposal(tokens_GK, self.probs_TV[at.to(self.probs_TV.device)].view(len(index), K, -1))


@runtime_checkable
class SlotDrafter(Protocol):
    """One drafter for every row of an engine: state per engine cache row (slot), rows drafted together.

    Call order per request at slot s: ``add(s, ...)`` once its prompt is prefilled (and its first token
    committed), then per step ``propose`` → (target verifies) → ``observe`` over the slots decoding in
    that step, and ``drop(s)`` when it leaves (finished, aborted); the slot may then be added again for
    another request. A row's proposal must depend only on that row (its tokens, its features, its
    seed), never on the other rows of the call: the engine's outputs must not depend on neighbours.
    As for :class:`Drafter`, exactness never depends on the drafter, only speed. The engine reads
    nothing of a slot drafter but these four methods and ``num_slots``.
    """

    num_slots: int
    """Rows of state (the engine's ``max_num_seqs``)."""

    def add(self, slot: int, prompt_ids: Sequence[int], prefill_out: TargetOutput) -> None:
        """A request enters at cache row ``slot``: its prompt and the prompt's prefill output
        (``hidden_BTD [1, P, D]`` and ``aux_hidden_BTD`` where the target gives them)."""
        ...

    def drop(self, slot: int) -> None:
        """The request at ``slot`` leaves; what the drafter kept for it is forgotten."""
        ...

    def propose(self, call: DraftCall) -> SlotProposal:
        """Up to ``call.depths[i]`` draft tokens for row ``call.slots[i]``, continuing the call state's
        row i, with ``call.sampling[i]`` and its seed in ``call.noise``; the proposal says what the
        call cost apart from drafting on (``catch_up_s``, ``catch_up_tokens``)."""
        ...

    def observe(
        self, slots: Sequence[int], num_accepted: Sequence[int], features: TargetOutput, *, state: DecodeState
    ) -> None:
        """After verification: ``state`` already holds the rows' newly committed tokens (accepted
        drafts + 1 each, ``num_accepted``); ``features`` is the verify block's output along each row's
        committed path (row i for ``slots[i]``)."""
        ...
