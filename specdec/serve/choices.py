"""One choice of a response: its engine outputs turned into text and log-probabilities.

A request has one choice per prompt and ``n`` (:meth:`specdec.serve.protocol.GenerationRequest.choices`),
each its own engine request. :class:`ChoiceOutput` follows one of them: the generated text through a
:class:`~specdec.serve.detokenize.TextStream` (stable pieces, stop strings cut), the prompt before it
with ``echo`` (the text as sent, or the decoding of the token ids sent), and the log-probabilities
in the endpoint's format (:mod:`specdec.serve.logprobs`): with ``echo``, the prompt's tokens first
(their values from the prefill, the first one null), then the generated ones. A request with
``max_tokens: 0`` (``echo`` only) has the engine generate one token, which is not returned.
"""

from __future__ import annotations

from typing import Any

from specdec.engine import RequestOutput
from specdec.serve.detokenize import TextStream, decode_text
from specdec.serve.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from specdec.serve.protocol import Choice, GenerationRequest
from specdec.serve.responses import FINISH_REASONS

__all__ = ["ChoiceOutput"]


class ChoiceOutput:
    """One choice's text and log-probabilities, streamed (:meth:`push`) or whole (:meth:`whole`)."""

    def __init__(
        self, gen: GenerationRequest, choice: Choice, tokenizer: Any, texts: TokenTexts, *, chat: bool
    ) -> None:
        self.gen = gen
        self.choice = choice
        self.index = choice.index
        self.tokenizer = tokenizer
        self.texts = texts
        self.chat = chat
        self.text = TextStream(tokenizer, gen.stop)
        self.started = False  # the first output (and the echoed prompt) went out
        self.offset = 0  # the next token's text_offset (completions logprobs)
        self.done = False

    def _echo_text(self) -> str:
        sent = self.gen.prompt_texts[self.choice.prompt]
        if sent is not None:
            return sent
        return decode_text(self.tokenizer, self.choice.prompt_ids, skip_special_tokens=False)

    def _generated(self, out: RequestOutput, new: bool) -> tuple[list[int], list[Any]]:
        """The generated ids (the step's new ones, or all) and their log-probabilities; none at all
        for ``max_tokens: 0``."""
        if self.gen.max_tokens == 0:
            return [], []
        ids = out.new_token_ids if new else out.token_ids
        logprobs = out.new_logprobs if new else out.logprobs
        return ids, list(logprobs or [])

    def _logprobs(self, out: RequestOutput, ids: list[int], entries: list[Any], first: bool) -> Any:
        if self.gen.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.texts)
        if first and self.gen.echo:
            ids = self.choice.prompt_ids + ids
            entries = list(out.prompt_logprobs or [None] * len(self.choice.prompt_ids)) + entries
        body, self.offset = completion_logprobs(entries, ids, self.texts, self.offset)
        return body

    def finish_reason(self, out: RequestOutput) -> str:
        """OpenAI's finish reason of the choice's last output."""
        if self.gen.max_tokens == 0:
            return "length"
        return "stop" if self.text.stopped else FINISH_REASONS[out.finish_reason or "abort"]

    def push(self, out: RequestOutput) -> tuple[str, Any]:
        """A stream's next piece of text and the log-probabilities of the step's new tokens (the
        prompt's first, with ``echo``)."""
        first = not self.started
        self.started = True
        ids, entries = self._generated(out, new=True)
        piece = self.text.push(ids, out.finished)
        if first and self.gen.echo:
            piece = self._echo_text() + piece
        return piece, self._logprobs(out, ids, entries, first)

    def whole(self, out: RequestOutput) -> tuple[str, Any]:
        """The whole text and log-probabilities from the choice's last output."""
        ids, entries = self._generated(out, new=False)
        self.text.push(ids, True)
        text = self.text.text
        if self.gen.echo:
            text = self._echo_text() + text
        return text, self._logprobs(out, ids, entries, True)
