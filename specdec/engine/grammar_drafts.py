"""Drafts shaped by a request's grammar (:mod:`specdec.logits.grammar`): a drafter's chain cut at its
first token the grammar forbids (that token's target probability is 0: it would be rejected without
a comparison, and everything after it with it), then the tokens the grammar forces from there, as
point-mass **free drafts** whatever the drafter said, up to the row's planned depth.

Forced tokens cost no drafting but do cost verification (a longer block, padded for the step's other
rows), so the depth controller decides how many a row drafts: it sees the row's first forced positions
as accepted with probability :data:`FORCED_ACCEPTANCE` (:mod:`specdec.engine.scheduler`), a function of
the row alone. Any proposal keeps the processed target distribution exactly (the rule compares it like
any draft), so this changes speed only. Rows in a token tree keep their tree (the mask rejects a
forbidden node).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specdec.protocols import SlotProposal

__all__ = ["FORCED_ACCEPTANCE", "free_drafts", "grammar_of", "shape_chains"]

FORCED_ACCEPTANCE = 0.9
"""The acceptance the depth controller assumes at a forced position (the target may still prefer
another spelling of the forced text: SmolLM2 accepted 0.93, then 0.79-0.70 given the one before, on
the JSON prompt set)."""


def grammar_of(request: Any) -> Any:
    """The request's grammar state, or None."""
    processors = request.processors
    return None if processors is None else processors.grammar


def free_drafts(request: Any, limit: int) -> list[int]:
    """The tokens the request's grammar forces after its committed output (at most ``limit``)."""
    grammar = grammar_of(request)
    return [] if grammar is None or not request.params.speculative else grammar.drafts([], limit)[1]


def shape_chains(proposal: SlotProposal, rows: Sequence[Any], limits: Sequence[int]) -> SlotProposal:
    """``proposal`` (over ``rows``, in order) with every grammar row's chain cut at its first forbidden
    token and extended by its forced tokens, up to its ``limits[i]`` drafts (its planned depth); the
    proposal itself where no row has a grammar (or it is one row's tree)."""
    if proposal.tree is not None or all(grammar_of(r) is None for r in rows):
        return proposal
    in_trees = {i for index, _ in proposal.trees for i in index}
    tokens = proposal.tokens_T.tolist()
    chains: list[list[int]] = []
    sources: list[list[int | None]] = []  # each draft's row of probs_TV (None: a point mass)
    counts: list[int] = []
    offset = 0
    for i, (request, count, limit) in enumerate(zip(rows, proposal.counts_B, limits, strict=True)):
        chain, source = tokens[offset : offset + count], list(range(offset, offset + count))
        offset += count
        grammar = grammar_of(request)
        if grammar is not None and i not in in_trees:
            try:
                n, forced = grammar.drafts(chain, limit)
            except Exception:  # no drafts: the row's mask raises again where it fails alone (the judge)
                n, forced = 0, []
            chain, source = chain[:n] + forced, source[:n] + [None] * len(forced)
        chains.append(chain)
        sources.append(source)
        counts.append(len(chain))
    flat = [t for c in chains for t in c]
    tokens_T = torch.tensor(flat, dtype=torch.long).to(proposal.tokens_T.device)
    probs_TV = None
    if proposal.probs_TV is not None:
        old = proposal.probs_TV
        probs_TV = old.new_zeros((len(flat), old.shape[-1]))
        index = [(j, s) for j, s in enumerate(s for src in sources for s in src) if s is not None]
        if index:
            to_j, from_s = (torch.tensor(x, device=old.device) for x in zip(*index, strict=True))
            probs_TV[to_j] = old[from_s]
        point = [j for j, s in enumerate(s for src in sources for s in src) if s is None]
        if point:
            probs_TV[torch.tensor(point, device=old.device), tokens_T[point].to(old.device)] = 1.0
    return SlotProposal(tokens_T, counts, probs_TV, trees=proposal.trees)
