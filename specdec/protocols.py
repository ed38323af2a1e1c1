"""The two plugin interfaces of the engine: a ``Target`` model and a ``Drafter``.

Legend: B batch, T block length, K draft length (γ), V vocabulary, D hidden size, L sequence capacity.

The decode loop (``specdec.loop``) owns a :class:`DecodeState` with every row's committed tokens.
Invariant between steps: the target's KV cache holds ``lengths_B - 1`` tokens per row: every
committed token except the last one, which is fed first in the next verify block.

A verify block for row b is ``[last committed token, d_1 .. d_K]`` at cache slots
``lengths_B[b] - 1 ...``; its K+1 logits give the target distribution for d_1..d_K and for the
bonus token. Blocks are contiguous per row, so a causal mask over *slot index* is the only mask a
chain needs, and rolling back is moving a row's length: nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from specdec.sampling import SamplingParams

__all__ = ["TargetOutput", "Target", "Proposal", "DecodeState", "Drafter"]


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


@runtime_checkable
class Target(Protocol):
    """A causal LM with a positional KV cache.

    Rows are independent: row b's block occupies cache slots ``start_B[b] .. start_B[b]+T-1`` and
    attends to slots ``< start_B[b]`` plus the block's own causal prefix. Slots past a row's valid
    length may hold stale entries from rejected drafts; they are never attended because every
    block overwrites its slots before attending.
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


@dataclass
class Proposal:
    """A drafter's guess: ``tokens_BK`` long, and ``probs_BKV`` (float32, full target vocab,
    processed by ``logits_to_probs`` with the run's sampling params) or None for a deterministic
    proposal. K may be smaller than the γ asked for, and may be 0.

    ``tree`` (optional): a :class:`specdec.tree.TreeProposal`; the loop then verifies the whole
    tree in one call (:func:`specdec.tree.verify_tree_proposal`), and ``tokens_BK`` / ``probs_BKV``
    are its first-candidate path (a valid chain proposal for loops that ignore trees)."""

    tokens_BK: torch.Tensor
    probs_BKV: torch.Tensor | None = None
    tree: object | None = None


@dataclass
class DecodeState:
    """Per-row token history shared by the loop and the drafters.

    ``tokens_BL``: prompt and committed tokens (slots past ``lengths_B`` are undefined);
    ``prompt_lengths_B``; ``lengths_B``: valid tokens per row; ``finished_B``: rows that hit a stop
    condition (the loop keeps them in the batch but ignores their output).
    """

    tokens_BL: torch.Tensor
    prompt_lengths_B: torch.Tensor
    lengths_B: torch.Tensor
    finished_B: torch.Tensor
    sampling: SamplingParams = field(default_factory=SamplingParams)

    @property
    def batch_size(self) -> int:
        return self.tokens_BL.shape[0]

    def last_tokens_B(self) -> torch.Tensor:
        """The last committed token of every row (the first token of the next verify block)."""
        rows = torch.arange(self.batch_size, device=self.tokens_BL.device)
        return self.tokens_BL[rows, self.lengths_B - 1]


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
        is the verify block's output (for drafters that read target features)."""
        ...
