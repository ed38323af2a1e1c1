"""Response bodies in OpenAI's shape: completions and chat completions, whole or as stream chunks.

``usage`` carries, beside OpenAI's three counts, the request's own speculative counts:
``num_draft_tokens`` (draft tokens the target verified for it) and ``num_accepted_tokens`` (of those,
accepted), so α = accepted / draft for that request; summed over its choices where it has several.

A response holds one choice per prompt and ``n`` (:meth:`ResponseShape.choice`, in index order); a
stream's chunks carry one choice each, its ``index`` telling which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specdec.engine import RequestMetrics

__all__ = ["FINISH_REASONS", "ResponseShape", "usage"]

# The engine's finish reasons as OpenAI names them (the stop sequence or EOS: "stop").
FINISH_REASONS = {
    "eos": "stop",
    "stop_string": "stop",
    "grammar": "stop",  # the grammar allows no further token (logged)
    "length": "length",
    "abort": "abort",
    "error": "error",
}


def _error(message: str) -> dict[str, Any]:
    """The ``error`` of a failed choice, in the shape of OpenAI's error bodies."""
    return {"message": message, "type": "server_error", "param": None, "code": None}


def usage(
    prompt_tokens: int, completion_tokens: int, metrics: RequestMetrics | Sequence[RequestMetrics]
) -> dict[str, int]:
    """OpenAI's usage object plus the request's drafted and accepted token counts (``metrics``: of
    each of its choices, summed)."""
    every = [metrics] if isinstance(metrics, RequestMetrics) else list(metrics)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "num_draft_tokens": sum(m.num_drafted for m in every),
        "num_accepted_tokens": sum(m.num_accepted for m in every),
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

    def choice(
        self,
        text: str,
        finish_reason: str,
        *,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> dict[str, Any]:
        """One choice of a non-streamed response (``error``: why a choice whose ``finish_reason`` is
        ``"error"`` failed)."""
        if self.chat:
            choice: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": index, "text": text}
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        if error is not None:
            choice["error"] = _error(error)
        return choice

    def full(
        self, text: str | list[dict[str, Any]], finish_reason: str | None, usage: dict[str, int]
    ) -> dict[str, Any]:
        """The whole response of a non-streamed request: one choice (its text and finish reason), or
        ``text`` the list of its :meth:`choice` bodies (``finish_reason`` None)."""
        choices = text if isinstance(text, list) else [self.choice(text, finish_reason or "stop")]
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": choices,
            "usage": usage,
        }

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        *,
        role: bool = False,
        with_usage: bool = False,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> dict[str, Any]:
        """One stream chunk of choice ``index``: new text (chat: a ``delta``; ``role`` opens the
        assistant's turn), the new tokens' ``logprobs``, and the finish reason on the last one (with
        ``error``, why a choice failed); ``with_usage`` adds ``"usage": null`` (OpenAI does on every
        chunk but the usage chunk when ``stream_options.include_usage`` is set)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        if error is not None:
            choice["error"] = _error(error)
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
