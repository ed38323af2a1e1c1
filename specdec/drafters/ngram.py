"""The ``ngram`` drafter: prompt lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding).

Legend: B batch, K draft length, L history length, N n-gram size.

For each row, take the last n tokens of its history (prompt + committed tokens), for n from
``max_ngram`` down to ``min_ngram``; find an earlier occurrence of that n-gram in the history and
propose the (up to γ) tokens that followed it. The proposal is a point mass (``probs_BKV=None``):
verification accepts draft x with probability target(x), which keeps sampling exact, and reduces to
"draft == argmax" in greedy decoding. No model, no training, no cache: it shines on inputs that get
copied (code editing, retrieval, summaries).
"""

from __future__ import annotations

import torch

from specdec.protocols import DecodeState, Proposal, Target, TargetOutput

__all__ = ["NGramDrafter", "lookup"]

_SEARCHES = ("latest", "earliest")


def lookup(
    history_L: torch.Tensor, gamma: int, *, max_ngram: int, min_ngram: int, search: str
) -> torch.Tensor:
    """Up to ``gamma`` tokens that followed an earlier occurrence of the history's last n-gram.

    Tries n from ``max_ngram`` down to ``min_ngram`` and stops at the first n with a match; among
    matches takes the most recent (``search="latest"``) or the first (``"earliest"``, as in
    ``transformers``' prompt lookup). Returns an empty tensor when nothing matches.
    """
    L = history_L.shape[0]
    for n in range(max_ngram, min_ngram - 1, -1):
        if L <= n:
            continue
        pattern_N = history_L[L - n :]
        # Windows that start at i = 0 .. L-1-n: each is followed by at least one token, and the
        # pattern's own position (i = L-n) is excluded.
        windows_WN = history_L[: L - 1].unfold(0, n, 1)
        hits = (windows_WN == pattern_N).all(dim=1).nonzero()
        if hits.numel() == 0:
            continue
        i = int(hits[-1 if search == "latest" else 0])
        return history_L[i + n : i + n + gamma]
    return history_L[:0]


class NGramDrafter:
    """A :class:`specdec.protocols.Drafter` by n-gram lookup in the row's own history.

    Options: ``max_ngram`` (3), ``min_ngram`` (1), ``search`` (``"latest"`` or ``"earliest"``).
    """

    def __init__(
        self, target: Target, *, max_ngram: int = 3, min_ngram: int = 1, search: str = "latest"
    ) -> None:
        for name, v in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        if search not in _SEARCHES:
            raise ValueError(f"search must be one of {_SEARCHES}, got {search!r}")
        self.max_ngram, self.min_ngram, self.search = max_ngram, min_ngram, search

    def begin(self, state: DecodeState, target_out: TargetOutput) -> None:
        pass

    def propose(self, state: DecodeState, gamma: int, generator: torch.Generator | None = None) -> Proposal:
        return self.pack(state, self.lookups(state, gamma))

    def lookups(self, state: DecodeState, gamma: int) -> list[torch.Tensor]:
        """Each row's lookup result (up to ``gamma`` tokens; empty for finished rows and misses)."""
        if gamma <= 0:
            return [state.tokens_BL[b, :0] for b in range(state.batch_size)]
        lengths = state.lengths_B.tolist()
        finished = state.finished_B.tolist()
        return [
            state.tokens_BL[b, :0]
            if finished[b]
            else lookup(
                state.tokens_BL[b, : lengths[b]],
                gamma,
                max_ngram=self.max_ngram,
                min_ngram=self.min_ngram,
                search=self.search,
            )
            for b in range(state.batch_size)
        ]

    @staticmethod
    def pack(state: DecodeState, found: list[torch.Tensor]) -> Proposal:
        """The proposal of per-row lookups: rows share K; a shorter row is padded."""
        B = state.batch_size
        K = max(len(f) for f in found)
        if K == 0:
            return Proposal(tokens_BK=state.tokens_BL.new_empty((B, 0)))
        if B == 1:
            return Proposal(tokens_BK=found[0].unsqueeze(0).clone())
        # Rows share K; a shorter row is padded with its last committed token. Any padding keeps
        # sampling exact (verification accepts it only with its target probability).
        tokens_BK = state.last_tokens_B().unsqueeze(1).repeat(1, K)
        for b, f in enumerate(found):
            tokens_BK[b, : len(f)] = f
        return Proposal(tokens_BK=tokens_BK)

    def observe(self, state: DecodeState, num_accepted_B: torch.Tensor, target_out: TargetOutput) -> None:
        pass
