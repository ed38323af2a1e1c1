"""Text from a growing list of generated token ids: stable pieces only, stop strings cut.

The server sends text as the engine commits tokens. :class:`TextStream` decodes all ids so far and
emits only the new suffix whose decoding is stable: it holds back trailing U+FFFD (the start of a
multi-byte character whose remaining bytes come in a later token) and, while stop strings are set,
the last ``len(longest stop) − 1`` characters (they could be the start of a stop string). Text from
the first stop string on is never returned (OpenAI's ``stop``: the stop sequence is not included).

Byte-level and SentencePiece decoders make the decoding of a prefix of the ids a prefix of the
decoding of all of them, up to a trailing incomplete character; so the pieces joined equal the
text of the whole (``text``), which is what a non-streamed response returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TextStream", "decode_text"]


def decode_text(tokenizer: Any, ids: Sequence[int]) -> str:
    """The text of generated ids as the server returns it: special tokens (EOS) skipped, no clean-up
    of spaces (so a prefix's text stays a prefix of the whole's)."""
    return tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


class TextStream:
    """One request's generated text, fed token ids and read as stable pieces.

    Args:
        tokenizer: the target's tokenizer (``decode``).
        stop_strings: strings at whose first occurrence the text ends (excluded).
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0  # characters of the text returned so far
        self.stopped = False  # a stop string was found in the text
        self.text = ""  # the text so far (cut at a stop string), held-back characters included

    def _cut(self, text: str) -> str:
        cuts = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        if cuts:
            self.stopped = True
            return text[: min(cuts)]
        return text

    def push(self, new_ids: Sequence[int], finished: bool) -> str:
        """Add the newly committed ids; return the text that became stable (all the rest when
        ``finished`` or once a stop string is found)."""
        if not self.stopped:
            self.ids.extend(new_ids)
            self.text = self._cut(decode_text(self.tokenizer, self.ids))
        end = len(self.text)
        if not (finished or self.stopped):
            end = len(self.text.rstrip("\ufffd")) - self.hold
        if end <= self.sent:
            return ""
        piece = self.text[self.sent : end]
        self.sent = end
        return piece
