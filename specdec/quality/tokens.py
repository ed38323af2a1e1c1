"""Two tokenizations of one text, compared: ours and a peer's (llama.cpp's ``llama-tokenize``).

Legend: L tokens of a whole text.

A perplexity is a mean over the tokens a run scores, so two runs over the same text give comparable
figures only where they score the same token stream: the same number of chunks, and the same tokens
in them. Two tokenizers with the same vocabulary and merges can still split a text differently
where their pre-tokenizers (the regex that cuts the text into words before the merges) differ.

:func:`token_differences` walks both streams and lists the places where they differ, picking up
again after each one. :func:`compare_tokens` says whether the scored tokens are the same (the two
PPLs comparable) and sorts the places in two kinds: the same characters split into other tokens
(``"\\n", "\\n"`` against ``"\\n\\n"``: the pre-tokenizers differ), and other characters (a
backslash and ``t`` against a tab: the peer read the text otherwise), with the first of each.
:func:`describe` says it in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["token_differences", "compare_tokens", "describe"]

ANCHOR = 4
"""Equal tokens that must follow a difference for the two streams to count as lined up again."""

WINDOW = 64
"""How many tokens either side a difference may span before the streams count as not lined up."""


def _lined_up(ours_L: np.ndarray, theirs_L: np.ndarray, i: int, j: int) -> bool:
    """Whether ``ours_L[i:]`` and ``theirs_L[j:]`` start with :data:`ANCHOR` equal tokens (or end
    together, equal up to their ends)."""
    k = min(ANCHOR, len(ours_L) - i, len(theirs_L) - j)
    if k < ANCHOR and not (i + k == len(ours_L) and j + k == len(theirs_L)):
        return False
    return bool(np.array_equal(ours_L[i : i + k], theirs_L[j : j + k]))


def token_differences(
    ours: Sequence[int] | np.ndarray, theirs: Sequence[int] | np.ndarray
) -> tuple[list[tuple[int, int, int, int]], bool]:
    """Where two token streams of one text differ: spans ``(i0, i1, j0, j1)``, in order, where
    ``ours[i0:i1]`` stands for ``theirs[j0:j1]``, each the shortest (fewest tokens in all) after which
    both go on with :data:`ANCHOR` equal tokens. Returns ``(spans, lined_up)``; where a difference
    does not line up again within :data:`WINDOW` tokens either side (the texts themselves differ), its
    span runs to both ends and ``lined_up`` is False."""
    ours_L = np.asarray(ours, dtype=np.int64).reshape(-1)
    theirs_L = np.asarray(theirs, dtype=np.int64).reshape(-1)
    spans: list[tuple[int, int, int, int]] = []
    i = j = 0
    while True:
        n = min(len(ours_L) - i, len(theirs_L) - j)
        unequal = np.flatnonzero(ours_L[i : i + n] != theirs_L[j : j + n])
        if unequal.size == 0:
            if i + n < len(ours_L) or j + n < len(theirs_L):  # one stream goes on past the other's end
                spans.append((i + n, len(ours_L), j + n, len(theirs_L)))
            return spans, True
        i, j = i + int(unequal[0]), j + int(unequal[0])
        step = next(
            (
                (di, total - di)
                for total in range(1, 2 * WINDOW + 1)
                for di in range(max(0, total - WINDOW), min(total, WINDOW) + 1)
                if _lined_up(ours_L, theirs_L, i + di, j + total - di)
            ),
            None,
        )
        if step is None:
            spans.append((i, len(ours_L), j, len(theirs_L)))
            return spans, False
        spans.append((i, i + step[0], j, j + step[1]))
        i, j = i + step[0], j + step[1]


def _example(
    tokenizer: Any, ours_L: np.ndarray, theirs_L: np.ndarray, span: tuple[int, int, int, int], context: int
) -> dict[str, Any]:
    """One place: its first token, the characters there (``context`` of our tokens either side) and
    each side's pieces (a span that runs to the ends: its first ``context`` tokens)."""
    i0, i1, j0, j1 = span
    i1, j1 = min(i1, i0 + context), min(j1, j0 + context)
    return {
        "token": i0,
        "text": tokenizer.decode(ours_L[max(0, i0 - context) : i1 + context].tolist()),
        "ours": [tokenizer.decode([t]) for t in ours_L[i0:i1].tolist()],
        "peer": [tokenizer.decode([t]) for t in theirs_L[j0:j1].tolist()],
    }


def compare_tokens(
    ours: Sequence[int],
    theirs: Sequence[int],
    *,
    ctx: int,
    chunks: int | None,
    tokenizer: Any,
    context: int = 6,
) -> dict[str, Any]:
    """Our tokens of a text against a peer's of the same text, for runs cutting both into chunks of
    ``ctx`` tokens (at most ``chunks``); ``tokenizer`` decodes either. Returns:

    - ``n_tokens_ours``, ``n_tokens_peer``; ``n_chunks_ours``, ``n_chunks_peer``;
    - ``scored_equal``: the same number of chunks and the same tokens in them: the two PPLs are over
      the same tokens and comparable;
    - ``first_different``: the first token that differs (None where the streams are equal);
    - ``places``: how many places differ over the whole text (:func:`token_differences`; places
      closer than :data:`ANCHOR` tokens count as one), and ``lined_up`` (False: after the last place
      the streams never agree again). Of them, ``places_split``: the same characters split into
      other tokens (the pre-tokenizers differ), and ``places_text``: other characters (the peer
      read the text otherwise);
    - ``examples``: the first place of each kind (``split``, ``text``; None where there is none):
      its ``token``, the characters there (``text``) and each side's pieces (``ours``, ``peer``).
    """
    ours_L = np.asarray(ours, dtype=np.int64).reshape(-1)
    theirs_L = np.asarray(theirs, dtype=np.int64).reshape(-1)
    spans, lined_up = token_differences(ours_L, theirs_L)

    def n_chunks(n: int) -> int:
        return n // ctx if chunks is None else min(chunks, n // ctx)

    n_ours, n_peer = n_chunks(len(ours_L)), n_chunks(len(theirs_L))
    scored = n_ours * ctx
    kinds: dict[str, list[tuple[int, int, int, int]]] = {"split": [], "text": []}
    for i0, i1, j0, j1 in spans:
        same = tokenizer.decode(ours_L[i0:i1].tolist()) == tokenizer.decode(theirs_L[j0:j1].tolist())
        kinds["split" if same else "text"].append((i0, i1, j0, j1))
    return {
        "n_tokens_ours": len(ours_L),
        "n_tokens_peer": len(theirs_L),
        "n_chunks_ours": n_ours,
        "n_chunks_peer": n_peer,
        "scored_equal": n_ours == n_peer and np.array_equal(ours_L[:scored], theirs_L[:scored]),
        "first_different": spans[0][0] if spans else None,
        "places": len(spans),
        "lined_up": lined_up,
        "places_split": len(kinds["split"]),
        "places_text": len(kinds["text"]),
        "examples": {
            kind: _example(tokenizer, ours_L, theirs_L, found[0], context) if found else None
            for kind, found in kinds.items()
        },
    }


def _place(peer: str, example: dict[str, Any]) -> str:
    ours = " ".join(repr(p) for p in example["ours"]) or "nothing"
    theirs = " ".join(repr(p) for p in example["peer"]) or "nothing"
    return f"first at token {example['token']:,}, in {example['text']!r}: ours {ours}, {peer}'s {theirs}"


def describe(peer: str, tokens: dict[str, Any]) -> str:
    """One line under the PPL table: whether ``peer``'s PPL is over our tokens (``tokens``:
    :func:`compare_tokens`, or ``{"reason": ...}`` where they could not be compared), and where not,
    where and how the two differ."""
    if "reason" in tokens:
        return (
            f"{peer}'s tokens not compared ({tokens['reason']}): its PPL may be over other tokens than ours."
        )
    n_ours, n_peer = tokens["n_tokens_ours"], tokens["n_tokens_peer"]
    if tokens["scored_equal"]:
        tail = (
            f" (the unscored tail differs: {n_peer:,} tokens against our {n_ours:,})"
            if tokens["places"]
            else ""
        )
        return f"{peer} scores the same tokens as ours{tail}: the two PPLs are comparable."
    kinds = []
    if tokens["places_split"]:
        split = f"at {tokens['places_split']:,} the same characters are split into other tokens"
        kinds.append(f"{split} ({_place(peer, tokens['examples']['split'])})")
    if tokens["places_text"]:
        text = f"at {tokens['places_text']:,} {peer} reads other characters"
        if not tokens["lined_up"]:
            text += ", and after the last the two never line up again"
        kinds.append(f"{text} ({_place(peer, tokens['examples']['text'])})")
    return (
        f"**{peer}'s PPL is not comparable with ours: it scores other tokens.** Its tokens of the text: "
        f"{n_peer:,} ({tokens['n_chunks_peer']} chunks), ours {n_ours:,} ({tokens['n_chunks_ours']} "
        f"chunks); they differ at {tokens['places']:,} place{'s' if tokens['places'] > 1 else ''}: "
        + "; ".join(kinds)
        + "."
    )
