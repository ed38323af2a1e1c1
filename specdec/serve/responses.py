"""Response bodies in OpenAI's shape: completions and chat completions, whole or as stream chunks.

``usage`` carries, beside OpenAI's three counts, the request's own speculative counts:
``num_draft_tokens`` (draft tokens the target verified for it) and ``num_accepted_tokens`` (of those,
accepted), so α = accepted / draft for that request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.engine import RequestMetrics

__all__ = ["FINISH_REASONS", "ResponseShape", "usage"]

# The engine's finish reasons as OpenAI names them (the stop sequence or EOS: "stop").
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length", "abort": "abort"}


def usage(prompt_tokens: int, completion_tokens: int, metrics: RequestMetrics) -> dict[str, int]:
    """OpenAI's usage object plus the request's drafted and accepted token counts."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "num_draft_tokens": metrics.num_drafted,
        "num_accepted_tokens": metrics.num_accepted,
    }


@dataclass(frozen=True, kw_only=True)
class ResponseShape:
    """Builds one request's bodies: ``chat`` picks ``chat.completion`` over ``text_completion``."""

    chat: bool
    request_id: str
    model: str
    created: int

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str, usage: dict[str, int]) -> dict[str, Any]:
        """The whole response of a non-streamed request."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=finish_reason)
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": [choice],
            "usage": usage,
        }

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        *,
        role: bool = False,
        with_usage: bool = False,
    ) -> dict[str, Any]:
        """One stream chunk: new text (chat: a ``delta``; ``role`` opens the assistant's turn) and the
        finish reason on the last one; ``with_usage`` adds ``"usage": null`` (OpenAI does on every
        chunk but the usage chunk when ``stream_options.include_usage`` is set)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=None, finish_reason=finish_reason)
        body = {
            **self._head("chat.completion.chunk" if self.chat else "text_completion"),
            "choices": [choice],
        }
        if with_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """The last chunk of a stream with ``include_usage``: no choices, the usage."""
        return {
            **self._head("chat.completion.chunk" if self.chat else "text_completion"),
            "choices": [],
            "usage": usage,
        }
