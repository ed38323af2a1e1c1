"""Stop strings: the first generated token whose text completes one (the engine's and the CLI's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["StopStrings"]


class StopStrings:
    """Finds the first generated token whose text completes a stop string.

    Decodes only a window of recent tokens: a stop string of n characters ending at the newest token
    lies within its last ``4n + 8`` tokens (every token decodes to at least one character).
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.window = 4 * max(len(s) for s in self.stop_strings) + 8

    def _contains(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return any(s in text for s in self.stop_strings)

    def first_stop(self, ids: list[int], num_old: int) -> int | None:
        """Given a row's generated ids of which the first ``num_old`` were already checked, the
        length of the shortest prefix whose text contains a stop string, or None."""
        if not self._contains(ids[max(0, num_old - self.window) :]):
            return None
        for end in range(num_old + 1, len(ids) + 1):
            if self._contains(ids[max(0, end - self.window) : end]):
                return end
        return None
