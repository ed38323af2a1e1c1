"""The committed tokens' true target features that the draft head has not run yet (lazy catch-up).

Legend: B batch, T block length, Q queue capacity, D the width of a queued feature (the target's
hidden size; with an EAGLE-3 head, the aux layers' outputs and the last layer's side by side).

After each verification the target's features of the committed tokens must go through the head's
layer (its KV cache holds one (feature, token) pair per committed position) before the head drafts
again. A row that does not draft with the head at a step (depth 0, or prompt lookup proposed) need
not pay for that now: the features wait here, and the next head draft runs every waiting pair in
one block, one forward of the head layer over several positions, which costs far less than one
forward per position (the layer's weights are read once for the whole block), and nothing at all
if the head never drafts again.

Row b's column t holds the feature at position ``start_b + t``, where ``start_b`` is the head
cache's length for that row (the drafter's ``cache_len_B``); ``counts[b]`` columns are valid.
"""

from __future__ import annotations

import torch

__all__ = ["FeatureQueue"]


class FeatureQueue:
    """Per-row queue of true features (see the module doc); rows may hold different counts."""

    def __init__(self, batch_size: int, dim: int, device: torch.device | str, capacity: int = 64) -> None:
        self.feat_BQD = torch.zeros(batch_size, max(1, capacity), dim, dtype=torch.float32, device=device)
        self.counts = [0] * batch_size  # valid columns per row (Python ints: read at every step)

    @property
    def longest(self) -> int:
        """The most features any row holds."""
        return max(self.counts)

    def push(self, feat_BTD: torch.Tensor, new_B: list[int]) -> None:
        """Append row b's first ``new_B[b]`` features of a block (copied: the block may be freed)."""
        end = max(c + n for c, n in zip(self.counts, new_B, strict=True))
        B, Q, D = self.feat_BQD.shape
        if end > Q:  # grow by doubling
            grown = self.feat_BQD.new_zeros(B, max(end, 2 * Q), D)
            grown[:, :Q] = self.feat_BQD
            self.feat_BQD = grown
        for b, (c, n) in enumerate(zip(self.counts, new_B, strict=True)):
            if n > 0:
                self.feat_BQD[b, c : c + n] = feat_BTD[b, :n]
        self.counts = [c + n for c, n in zip(self.counts, new_B, strict=True)]

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The queued block ``[B, T, D]`` (T = the longest row; a view, valid until the next push)
        and each row's count ``[B]``; the queue is empty afterwards."""
        count_B = torch.tensor(self.counts, dtype=torch.long, device=self.feat_BQD.device)
        feat_BTD = self.feat_BQD[:, : self.longest]
        self.counts = [0] * len(self.counts)
        return feat_BTD, count_B

    # --- by row index (one queue row per engine slot: :mod:`specdec.drafters.eagle.drafter`) ---------
    def push_rows(self, rows: list[int], feat_GTD: torch.Tensor, new_G: list[int]) -> None:
        """Append ``new_G[i]`` features of block row i to queue row ``rows[i]`` (the others untouched)."""
        new_B = [0] * len(self.counts)
        for r, n in zip(rows, new_G, strict=True):
            new_B[r] = n
        end = max(self.counts[r] + n for r, n in zip(rows, new_G, strict=True))
        B, Q, D = self.feat_BQD.shape
        if end > Q:  # grow by doubling
            grown = self.feat_BQD.new_zeros(B, max(end, 2 * Q), D)
            grown[:, :Q] = self.feat_BQD
            self.feat_BQD = grown
        for i, (r, n) in enumerate(zip(rows, new_G, strict=True)):
            if n > 0:
                self.feat_BQD[r, self.counts[r] : self.counts[r] + n] = feat_GTD[i, :n]
                self.counts[r] += n

    def take_rows(self, rows: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Queue rows ``rows``' features ``[G, T, D]`` (a copy; T = the longest of them) and counts;
        those rows are empty afterwards."""
        counts = [self.counts[r] for r in rows]
        feat_GTD = self.feat_BQD[rows, : max(counts)]
        for r in rows:
            self.counts[r] = 0
        return feat_GTD, counts
