"""The ``ngram`` drafter: prompt lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding).

Legend: B batch, G rows of a call, K draft length, L history length, N n-gram size.

For each row, take the last n tokens of its history (prompt + committed tokens), for n from
``max_ngram`` down to ``min_ngram``; find an earlier occurrence of that n-gram in the history and
propose the (up to γ) tokens that followed it. The proposal is a point mass (``probs_BKV=None``):
verification accepts draft x with probability target(x), which keeps sampling exact, and reduces to
"draft == argmax" in greedy decoding. No model, no training, no cache: it shines on inputs that get
copied (code editing, retrieval, summaries).

:class:`NGramDrafter` is a :class:`~specdec.protocols.SlotDrafter`: one call looks up every row's own
tokens and proposes what it finds, up to the row's depth, so rows of one call need not share a depth
and a row's proposal depends on its tokens only. There is no state but which slots hold a request.
"""

from __future__ import annotations

import torch

from specdec.drafters.slot_table import StatelessSlots
from specdec.protocols import DecodeState, DraftCall, SlotProposal, Target

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


class NGramDrafter(StatelessSlots):
    """Prompt lookup over ``num_slots`` engine rows (see the module doc).

    Options: ``max_ngram`` (3), ``min_ngram`` (1), ``search`` (``"latest"`` or ``"earliest"``).
    """

    def __init__(
        self,
        target: Target,
        *,
        num_slots: int = 1,
        max_ngram: int = 3,
        min_ngram: int = 1,
        search: str = "latest",
    ) -> None:
        super().__init__(num_slots)
        for name, v in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        if search not in _SEARCHES:
            raise ValueError(f"search must be one of {_SEARCHES}, got {search!r}")
        self.max_ngram, self.min_ngram, self.search = max_ngram, min_ngram, search
        self.vocab_size = int(target.vocab_size)

    def propose(self, call: DraftCall) -> SlotProposal:
        """Row i's lookup, up to ``depths[i]`` tokens (point masses: one-hot probabilities where a row of
        the call is sampled)."""
        self.check_propose(call, keyed=False)  # lookups draw nothing
        found = self.lookups(call.state, max(call.depths, default=0))
        rows = [f[:k] for f, k in zip(found, call.depths, strict=True)]
        tokens_T = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        probs_TV = None
        if any(not s.greedy for s in call.sampling) and tokens_T.numel():
            probs_TV = torch.nn.functional.one_hot(tokens_T, self.vocab_size).float()
        return SlotProposal(tokens_T, [len(r) for r in rows], probs_TV)

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
