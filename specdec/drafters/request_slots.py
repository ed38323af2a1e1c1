"""Slot drafters over :class:`~specdec.protocols.Drafter` objects: one instance per request, or one
instance that drafts cohorts of rows.

Legend: G rows of a call, K a row's draft depth, T a call's drafted tokens (all rows, back to back),
V vocabulary, L sequence capacity.

The engine talks to one :class:`~specdec.protocols.SlotDrafter`. A drafter written against the
one-generation :class:`~specdec.protocols.Drafter` protocol (begin / propose / observe over a
``DecodeState``) enters it through one of two adapters:

- :class:`RequestSlots`: an instance per slot (a plugin by name, a deep copy of a drafter object).
  ``add`` takes an instance; its ``begin`` runs at the slot's first ``propose`` or ``observe`` (``add``
  gets no row state), with the row as it was at the start of that step: the prompt and its first token,
  as the engine's ``begin`` used to see it. Each row drafts alone, from a ``torch.Generator`` seeded with
  :func:`mix_seed` of its request seed and output position, so a row's drafts never depend on its
  neighbours.
- :class:`CohortSlots`: one instance for every row of a drafter that declares ``batched_rows = True``
  (the toy Markov drafters of :mod:`specdec.testing`): it keeps no per-row state, so the rows sharing a
  depth and sampling settings are drafted by one ``propose`` over a G-row state, their randomness keyed
  by each row's seed (the ``noise`` its ``propose`` takes, stream ``"draft"``).

Both return the ragged :class:`~specdec.protocols.SlotProposal`: rows back to back, greedy rows' draft
probabilities zeros, a sampled row's point-mass proposal (``probs_BKV=None``) one-hot.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from specdec.checks import check_proposal
from specdec.drafters.slot_table import SlotTable
from specdec.host_sync import avoids_host
from specdec.protocols import DecodeState, DraftCall, Drafter, Proposal, SlotProposal, TargetOutput
from specdec.sampling import SamplingParams
from specdec.verify.noise import PositionNoise

__all__ = ["CohortSlots", "RequestSlots", "mix_seed"]


def mix_seed(seed: int, position: int, salt: int) -> int:
    """A 64-bit seed for a torch.Generator from (request seed, position, use): splitmix64."""
    z = (seed + 0x9E3779B97F4A7C15 * (position + 1) + salt) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


# --- shared pieces ----------------------------------------------------------------------------------
def _check_observe(
    table: SlotTable,
    slots: Sequence[int],
    num_accepted: Sequence[int],
    features: TargetOutput,
    state: DecodeState,
) -> list[int]:
    """``observe``'s arguments: slots in use, one accepted count (an int >= 0), state row and features
    row per slot; returns the slots."""
    slots = table._check_slots(slots)
    G = len(slots)
    if len(num_accepted) != G or state.batch_size != G or features.logits_BTV.shape[0] != G:
        raise ValueError(
            f"num_accepted ({len(num_accepted)}), state ({state.batch_size} rows) and features "
            f"({features.logits_BTV.shape[0]} rows) must have one entry per slot ({G})"
        )
    if any(isinstance(a, bool) or int(a) != a or a < 0 for a in num_accepted):
        raise ValueError(f"num_accepted must be ints >= 0, got {list(num_accepted)}")
    return slots


def _ragged(
    chains: list[tuple[torch.Tensor, torch.Tensor | None]],
    sampling: Sequence[SamplingParams],
    vocab_size: int,
    empty_device: torch.device,
) -> SlotProposal:
    """Per row its drafts ``[K]`` and their probabilities ``[K, V]`` (None: a point mass) as one
    ragged proposal, on the device of the first row that drafted."""
    counts = [int(tokens_K.shape[0]) for tokens_K, _ in chains]
    drafted = [tokens_K for tokens_K in (c[0] for c in chains) if tokens_K.numel()]
    device = drafted[0].device if drafted else empty_device
    tokens_T = (
        torch.cat([t.to(device) for t in drafted])
        if drafted
        else torch.zeros(0, dtype=torch.long, device=device)
    )
    if all(s.greedy for s in sampling):
        return SlotProposal(tokens_T, counts, None)
    parts = []
    for (tokens_K, probs_KV), params in zip(chains, sampling, strict=True):
        K = tokens_K.shape[0]
        if K == 0:
            continue
        if params.greedy:  # ignored: a greedy row's entries in a mixed proposal
            parts.append(torch.zeros((K, vocab_size), dtype=torch.float32, device=device))
        elif probs_KV is None:  # a sampled row's point mass
            # ids out of the vocabulary are clamped here; the engine's check of the chain names them
            parts.append(
                torch.nn.functional.one_hot(tokens_K.to(device).clamp(0, vocab_size - 1), vocab_size).float()
            )
        else:
            parts.append(probs_KV.to(device=device, dtype=torch.float32))
    probs_TV = torch.cat(parts) if parts else torch.zeros((0, vocab_size), dtype=torch.float32, device=device)
    return SlotProposal(tokens_T, counts, probs_TV)


def _on_host(proposal: Proposal) -> bool:
    """Check a proposal's values here where it is on the host (a greedy row's probabilities never
    reach the engine's checks); a proposal on the device is checked by the engine, with the step's
    one read."""
    return isinstance(proposal, Proposal) and not avoids_host(proposal.tokens_BK)


def _with_trees(proposal: SlotProposal, trees: list[tuple[list[int], Proposal]]) -> SlotProposal:
    """The chains with the call's token trees: a call of one row as ``tree``, else as ``trees``."""
    if len(proposal.counts_B) == 1 and trees:
        proposal.tree = trees[0][1]
    else:
        proposal.trees = trees
    return proposal


# --- an instance per request ------------------------------------------------------------------------
class RequestSlots(SlotTable):
    """A :class:`~specdec.protocols.Drafter` instance per slot, as one slot drafter (see the module doc).

    Args:
        new_instance: ``new_instance(slot)`` builds the instance of the request entering at ``slot``.
        num_slots: the engine's cache rows.
        vocab_size: the target's vocabulary (one-hot draft probabilities of a point mass).
        reuse: keep a dropped instance and hand it to the next ``add`` (``begin`` restarts a drafter:
            a drafter given as an object, deep-copied only while requests overlap).
        clock: what times an instance's lazy ``begin`` (the engine's clock).
        name: what the engine reports as its drafter.
    """

    def __init__(
        self,
        new_instance: Callable[[int], Drafter],
        *,
        num_slots: int,
        vocab_size: int,
        reuse: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        name: str = "per-request",
    ) -> None:
        super().__init__(num_slots)
        if not callable(new_instance):
            raise ValueError(
                f"new_instance must be callable (slot -> Drafter), got {type(new_instance).__name__}"
            )
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        self.new_instance = new_instance
        self.vocab_size = vocab_size
        self.reuse = reuse
        self.name = name
        self.now = clock  # times a lazy begin
        self.instances: list[Drafter | None] = [None] * num_slots
        self.idle: list[Drafter] = []  # dropped instances waiting for the next add (reuse)
        self._unbegun: dict[int, TargetOutput] = {}  # slot -> its prefill output, until the lazy begin
        self._sampling: list[SamplingParams | None] = [None] * num_slots  # the slot's, from its proposes
        self._steps = [0] * num_slots  # observes of the slot's request (its step, for messages)

    # --- the protocol -------------------------------------------------------------------------------
    def add(self, slot: int, prompt_ids: Sequence[int], prefill_out: TargetOutput) -> None:
        """The request at ``slot`` gets an instance (an idle one where ``reuse``); it begins at the slot's
        first ``propose`` or ``observe``."""
        self._take(slot, prompt_ids)
        try:
            instance = self.idle.pop() if self.idle else self.new_instance(slot)
            if not isinstance(instance, Drafter):
                raise ValueError(
                    f"new_instance({slot}) built {type(instance).__name__}, "
                    "not a Drafter (begin/propose/observe)"
                )
        except BaseException:
            self._free(slot)
            raise
        self.instances[slot] = instance
        self._unbegun[slot] = prefill_out
        self._sampling[slot] = None
        self._steps[slot] = 0

    def drop(self, slot: int) -> None:
        """Forget ``slot``'s request; its instance waits for the next ``add`` where ``reuse``."""
        self._free(slot)
        instance, self.instances[slot] = self.instances[slot], None
        self._unbegun.pop(slot, None)
        self._sampling[slot] = None
        if self.reuse and instance is not None:
            self.idle.append(instance)

    def propose(self, call: DraftCall) -> SlotProposal:
        """Row i's instance proposes up to ``depths[i]`` tokens from its row of the call's state with
        ``sampling[i]`` and ``tree_ok``, its generator seeded by ``mix_seed(seed, output position, 1)``
        (none without ``noise``); rows at depth 0 are not called. A row whose instance drafts a token
        tree gets it (verified alone). The call's catch-up: an instance's lazy ``begin`` here, and what
        an instance reports of its own (the optional ``catch_up_s`` / ``catch_up_tokens`` counters of a
        one-request drafter: work owed for committed tokens)."""
        slots = self.check_propose(call, keyed=False)
        depths, state, sampling, noise = call.depths, call.state, call.sampling, call.noise
        seeds = None if noise is None else noise.seeds_B.tolist()
        lengths, prompts = state.lengths_B.tolist(), state.prompt_lengths_B.tolist()
        chains: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        trees: list[tuple[list[int], Proposal]] = []
        seconds, tokens = 0.0, 0
        for i, slot in enumerate(slots):
            self._sampling[slot] = sampling[i]
            row = replace(state.row(i), sampling=sampling[i], tree_ok=call.tree_ok)
            instance, begun_s, begun = self._begun(slot, row)
            caught_s, caught = getattr(instance, "catch_up_s", 0.0), getattr(instance, "catch_up_tokens", 0)
            K = depths[i]
            if K == 0:
                chains.append((torch.zeros(0, dtype=torch.long, device=state.tokens_BL.device), None))
            else:
                generator = None
                if seeds is not None:
                    generator = torch.Generator().manual_seed(mix_seed(seeds[i], lengths[i] - prompts[i], 1))
                proposal = instance.propose(row, K, generator)
                check_proposal(
                    proposal,
                    batch_size=1,
                    gamma=K,
                    vocab_size=self.vocab_size,
                    values=_on_host(proposal),
                    step=self._steps[slot] + 1,
                    source=self.name,
                )
                probs = None if proposal.probs_BKV is None else proposal.probs_BKV[0]
                chains.append((proposal.tokens_BK[0], probs))
                if proposal.tree is not None:  # each row's tree is verified alone
                    trees.append(([i], proposal))
            seconds += begun_s + getattr(instance, "catch_up_s", 0.0) - caught_s
            tokens = max(tokens, begun, getattr(instance, "catch_up_tokens", 0) - caught)
        proposal = _with_trees(_ragged(chains, sampling, self.vocab_size, state.tokens_BL.device), trees)
        proposal.catch_up_s, proposal.catch_up_tokens = seconds, tokens
        return proposal

    def observe(
        self, slots: Sequence[int], num_accepted: Sequence[int], features: TargetOutput, *, state: DecodeState
    ) -> None:
        """Row i's instance observes its row of ``state`` (the committed tokens included), its accepted
        count and its row of ``features``; a row not begun yet begins first, at the step's start
        (``lengths_B`` less the ``num_accepted[i] + 1`` tokens just committed)."""
        slots = _check_observe(self, slots, num_accepted, features, state)
        for i, slot in enumerate(slots):
            row = replace(state.row(i), sampling=self._sampling[slot] or state.sampling)
            a = int(num_accepted[i])
            instance = self.instances[slot]
            if slot in self._unbegun:
                at_start = replace(row, lengths_B=row.lengths_B - (a + 1))
                instance, _, _ = self._begun(slot, at_start)
            instance.observe(row, torch.tensor([a]), features.select([i]))
            self._steps[slot] += 1

    # --- the pieces ---------------------------------------------------------------------------------
    def _begun(self, slot: int, row: DecodeState) -> tuple[Drafter, float, int]:
        """``slot``'s instance, begun on ``row`` (the step's start) if it has not begun yet; with the
        seconds and tokens of that begin (work owed for the prompt: catch-up, not drafting)."""
        instance = self.instances[slot]
        if slot not in self._unbegun:
            return instance, 0.0, 0
        t0 = self.now()
        instance.begin(row, self._unbegun.pop(slot))
        return instance, self.now() - t0, int(row.lengths_B[0])


# --- one instance for every row ---------------------------------------------------------------------
class CohortSlots(SlotTable):
    """One ``batched_rows = True`` drafter for every slot, drafting cohorts of rows (see the module doc).

    Args:
        drafter: the drafter (no per-row state; draws from the keyed ``noise`` its ``propose`` takes,
            if it takes one); it is never told ``begin``.
        num_slots: the engine's cache rows.
        vocab_size: the target's vocabulary (one-hot draft probabilities of a point mass).
        name: what the engine reports as its drafter (default: the drafter's class name).
    """

    def __init__(self, drafter: Drafter, *, num_slots: int, vocab_size: int, name: str | None = None) -> None:
        super().__init__(num_slots)
        if not isinstance(drafter, Drafter):
            raise ValueError(f"drafter must have begin/propose/observe, got {type(drafter).__name__}")
        if getattr(drafter, "batched_rows", False) is not True:
            raise ValueError(f"drafter must declare batched_rows = True, got {type(drafter).__name__}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.name = type(drafter).__name__ if name is None else name
        self.keyed = "noise" in inspect.signature(drafter.propose).parameters
        self.observes = getattr(drafter, "observes", True) is not False
        self._sampling: list[SamplingParams | None] = [None] * num_slots  # the slot's, from its proposes
        self._steps = 0  # proposes (for messages)

    def add(self, slot: int, prompt_ids: Sequence[int], prefill_out: TargetOutput) -> None:
        """The request at ``slot`` joins the cohorts."""
        self._take(slot, prompt_ids)
        self._sampling[slot] = None

    def drop(self, slot: int) -> None:
        """The request at ``slot`` leaves."""
        self._free(slot)
        self._sampling[slot] = None

    def propose(self, call: DraftCall) -> SlotProposal:
        """One ``propose`` per cohort of rows sharing a depth (> 0) and sampling settings, with their
        keyed ``noise`` where the drafter takes it; a cohort whose proposal is a token tree gets it
        (one tree shape for its rows)."""
        slots = self.check_propose(call, keyed=self.keyed)
        depths, state, sampling, noise = call.depths, call.state, call.sampling, call.noise
        self._steps += 1
        cohorts: dict[tuple[int, SamplingParams], list[int]] = {}
        for i, slot in enumerate(slots):
            self._sampling[slot] = sampling[i]
            if depths[i] > 0:
                cohorts.setdefault((depths[i], sampling[i]), []).append(i)
        empty = torch.zeros(0, dtype=torch.long, device=state.tokens_BL.device)
        chains: list[tuple[torch.Tensor, torch.Tensor | None]] = [(empty, None)] * len(slots)
        trees: list[tuple[list[int], Proposal]] = []
        for (K, params), index in cohorts.items():
            kwargs = {}
            if self.keyed and noise is not None:
                kwargs["noise"] = PositionNoise(noise.seeds_B[torch.tensor(index, device=noise.device)])
            rows = replace(state.select(index), sampling=params, tree_ok=call.tree_ok)
            proposal = self.drafter.propose(rows, K, None, **kwargs)
            check_proposal(
                proposal,
                batch_size=len(index),
                gamma=K,
                vocab_size=self.vocab_size,
                values=_on_host(proposal),
                step=self._steps,
                source=self.name,
            )
            for j, i in enumerate(index):
                probs = None if proposal.probs_BKV is None else proposal.probs_BKV[j]
                chains[i] = (proposal.tokens_BK[j], probs)
            if proposal.tree is not None:  # the cohort's tree, verified by a forward of its own
                trees.append((index, proposal))
        return _with_trees(_ragged(chains, sampling, self.vocab_size, state.tokens_BL.device), trees)

    def observe(
        self, slots: Sequence[int], num_accepted: Sequence[int], features: TargetOutput, *, state: DecodeState
    ) -> None:
        """One ``observe`` per group of rows sharing sampling settings (each slot's from its last
        ``propose``, else ``state.sampling``); none for a drafter that declares ``observes = False``."""
        slots = _check_observe(self, slots, num_accepted, features, state)
        if not self.observes:
            return
        groups: dict[SamplingParams, list[int]] = {}
        for i, slot in enumerate(slots):
            groups.setdefault(self._sampling[slot] or state.sampling, []).append(i)
        for params, index in groups.items():
            accepted_G = torch.tensor([int(num_accepted[i]) for i in index], dtype=torch.long)
            rows = replace(state.select(index), sampling=params)
            self.drafter.observe(rows, accepted_G, features.select(index))
