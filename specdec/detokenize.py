"""Incremental detokenization: text pieces from a growing list of token ids, as they become whole.

Decoding every id again at each new token makes a long stream quadratic. vLLM's detokenizer decodes
only a window of recent ids instead: ``ids[prefix_offset:read_offset]`` (already returned) and
``ids[prefix_offset:]``; the new text is the second's suffix beyond the first. The window starts a
few ids back so that a token's leading space and its merges with the left neighbour come out as in
the whole decoding, and it moves on only once its text ends in a whole character (no trailing
U+FFFD: the start of a multi-byte character whose other bytes come in a later token). For
byte-level and SentencePiece decoders the pieces joined equal the decoding of all ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer", "decode_text"]


def decode_text(tokenizer: Any, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    """The text of generated ids: special tokens (EOS) skipped by default, no clean-up of spaces
    (so a prefix's text stays a prefix of the whole's)."""
    return tokenizer.decode(
        list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces as they become printable.

    Args:
        tokenizer: a tokenizer with ``decode``.
        skip_special_tokens: leave special tokens (EOS) out of the text.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # the decoding window starts here (a character boundary)
        self.read_offset = 0  # ids whose text has been returned
        self._pending = ""  # the text of ids[read_offset:], as the last push decoded it

    def pending(self) -> str:
        """The text of the ids not yet returned (it may end in an incomplete character, U+FFFD)."""
        return self._pending

    def push(self, new_ids: Sequence[int]) -> str:
        """Add ids; return the newly printable text (possibly empty)."""
        self.ids.extend(new_ids)
        decode = lambda ids: decode_text(self.tokenizer, ids, skip_special_tokens=self.skip)
        done = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if len(full) > len(done) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._pending = ""
            return full[len(done) :]
        self._pending = full[len(done) :]
        return ""

    def flush(self) -> str:
        """Whatever is left (an incomplete sequence included) at the end of generation."""
        rest = self._pending
        self.prefix_offset = self.read_offset = len(self.ids)
        self._pending = ""
        return rest
