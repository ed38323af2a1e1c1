"""Text from a growing list of generated token ids: stable pieces only, stop strings cut.

The server sends text as the engine commits tokens. :class:`TextStream` decodes incrementally
(:class:`specdec.detokenize.IncrementalDetokenizer`: a window of recent ids, so a push costs the
same at token 10 and at token 10,000) and emits only the new text that is stable: it holds back a
trailing incomplete character (U+FFFD, whose remaining bytes come in a later token) and, while stop
strings are set, the last ``len(longest stop) − 1`` characters (they could be the start of a stop
string). Text from the first stop string on is never returned (OpenAI's ``stop``: the stop sequence
is not included). For byte-level and SentencePiece decoders the pieces joined equal the decoding of
all ids (:func:`decode_text`), which is what a non-streamed response returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specdec.detokenize import IncrementalDetokenizer, decode_text

__all__ = ["TextStream", "decode_text"]


class TextStream:
    """One request's generated text, fed token ids and read as stable pieces.

    Args:
        tokenizer: the target's tokenizer (``decode``).
        stop_strings: strings at whose first occurrence the text ends (excluded).
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = ()) -> None:
        self.stop_strings = tuple(stop_strings)
        self.longest = max((len(s) for s in self.stop_strings), default=0)
        self.hold = max(self.longest, 1) - 1
        self.detok = IncrementalDetokenizer(tokenizer)
        self.sent = 0  # characters of the text returned so far
        self.stopped = False  # a stop string was found in the text
        self.text = ""  # the text so far (cut at a stop string), held-back characters included
        self._whole = ""  # the text of the ids the detokenizer has passed: whole characters only

    @property
    def ids(self) -> list[int]:
        return self.detok.ids

    def _cut(self, text: str, searched: int) -> str:
        """``text`` up to the first stop string (looked for from where one could start anew)."""
        start = max(0, searched - self.longest + 1)
        cuts = [i for i in (text.find(s, start) for s in self.stop_strings) if i >= 0]
        if cuts:
            self.stopped = True
            return text[: min(cuts)]
        return text

    def push(self, new_ids: Sequence[int], finished: bool) -> str:
        """Add the newly committed ids; return the text that became stable (all the rest when
        ``finished`` or once a stop string is found)."""
        if not self.stopped and new_ids:
            searched = len(self.text.rstrip("\ufffd"))
            self._whole += self.detok.push(new_ids)
            self.text = self._cut(self._whole + self.detok.pending(), searched)
        end = len(self.text)
        if not (finished or self.stopped):
            end = len(self.text.rstrip("\ufffd")) - self.hold
        if end <= self.sent:
            return ""
        piece = self.text[self.sent : end]
        self.sent = end
        return piece
