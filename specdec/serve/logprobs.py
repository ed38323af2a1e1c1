"""Log-probabilities in OpenAI's two response formats, from the engine's per-token values.

The engine reports, per token, its log-probability and the top-k alternatives
(:class:`specdec.engine.logprobs.TokenLogprob`: the target's raw ``log_softmax``). Here they become:

- ``/v1/completions`` (the legacy format, as vLLM and llama-server write it): ``{"tokens": [str],
  "token_logprobs": [float | null], "top_logprobs": [{str: float} | null], "text_offset": [int]}``.
  ``top_logprobs`` holds the chosen token and the k most likely (vLLM: up to k + 1 entries); with
  ``echo`` the prompt's first token has ``null`` for both (nothing precedes it).
- ``/v1/chat/completions``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}, ...k]}], "refusal": null}``.

A token's text is its own decoding (special tokens included); ``bytes`` its UTF-8 bytes, exact for
byte-level BPE and SentencePiece byte tokens even where a token holds part of a character.
``text_offset`` counts characters of the choice's text (the prompt's too, with ``echo``) from 0.
JSON has no -inf: a log-probability below -9999 is reported as -9999.0 (as vLLM does).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from specdec.engine.logprobs import TokenLogprob

__all__ = ["TokenTexts", "completion_logprobs", "chat_logprobs"]

_FLOOR = -9999.0
_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE token writes for a byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = _byte_decoder()


class TokenTexts:
    """A tokenizer's per-token text and bytes, cached (one ``decode`` per distinct token id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode(
            [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def _bytes(self, token_id: int) -> list[int]:
        text = self.text(token_id)
        if "\ufffd" in text:  # part of a character: the token's own bytes, where its vocabulary says them
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                match = _SP_BYTE.match(piece)
                if match:
                    return [int(match.group(1), 16)]
                if piece and all(c in _BYTE_DECODER for c in piece):
                    return [_BYTE_DECODER[c] for c in piece]
        return list(text.encode("utf-8"))


def _value(logprob: float) -> float:
    return max(logprob, _FLOOR)


def completion_logprobs(
    entries: Sequence[TokenLogprob | None], token_ids: Sequence[int], texts: TokenTexts, offset: int = 0
) -> tuple[dict[str, Any], int]:
    """The legacy ``logprobs`` object of ``token_ids`` (``entries``: one each, None where a token has
    none), its text offsets counted from ``offset``; returns it and the offset after the last token
    (a stream's next chunk goes on from there)."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = texts.text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_value(entry.logprob))
        top = {text: _value(entry.logprob)}
        for alt_id, alt in entry.top:
            top.setdefault(texts.text(alt_id), _value(alt))
        tops.append(top)
    body = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
    return body, offset


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [...], "refusal": None}``, one entry per token."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": texts.text(token_id), "logprob": _value(logprob), "bytes": texts.bytes(token_id)}

    content = []
    for entry in entries:
        item = one(entry.token_id, entry.logprob)
        item["top_logprobs"] = [one(t, lp) for t, lp in entry.top]
        content.append(item)
    return {"content": content, "refusal": None}
