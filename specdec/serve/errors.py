"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}`` and a status.

Every refusal of the server is an :class:`APIError`; the app turns it into that body. The
engine's ``ValueError`` messages name its own arguments (``max_new_tokens``, ``stop_strings``, ...):
:func:`from_engine_error` names the API field instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["APIError", "bad_request", "from_engine_error", "prompt_overflow", "unavailable"]

# The engine's argument names, as the API calls them.
_ENGINE_FIELDS = {
    "max_new_tokens": "max_tokens",
    "stop_strings": "stop",
    "prompt_ids": "prompt",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "seed": "seed",
    "ignore_eos": "ignore_eos",
    "speculative": "speculative",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
    "min_tokens": "min_tokens",
    # a grammar that does not compile names the field it came from (specdec.serve.controls)
    "response_format.json_schema": "response_format.json_schema",
    "response_format": "response_format",
    "guided_json": "guided_json",
    "guided_regex": "guided_regex",
    "guided_grammar": "guided_grammar",
    "guided_choice": "guided_choice",
}


@dataclass
class APIError(Exception):
    """A refused request: HTTP ``status`` and OpenAI's error fields (``headers``: e.g. Retry-After)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | int | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 naming the field at fault."""
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, retry_after_s: int | None = None) -> APIError:
    """A 503 (with ``Retry-After`` where ``retry_after_s`` is given)."""
    headers = {} if retry_after_s is None else {"Retry-After": str(retry_after_s)}
    return APIError(503, message, type="service_unavailable", headers=headers)


def prompt_overflow(field: str, num_prompt: int, max_model_len: int, reserved: int) -> APIError:
    """The 400 for a prompt of ``num_prompt`` tokens that alone leaves no room for one new token."""
    return bad_request(
        f"{field} is too long: it has {num_prompt} tokens, and this model's maximum context length is "
        f"{max_model_len} tokens, so a prompt may have at most {max_model_len - 1} tokens (one more is "
        f"the first new token; a request for more than one new token also keeps {reserved} for "
        f"speculative drafts)",
        field,
        "context_length_exceeded",
    )


def from_engine_error(err: ValueError) -> APIError:
    """A 400 for a ``ValueError`` of ``Engine.add_request``, its field named as the API names it."""
    message = str(err)
    first = message.split(" ", 1)[0].rstrip(":")
    param = _ENGINE_FIELDS.get(first)
    if param is not None and param != first:
        message = param + message[len(first) :]
    code = "context_length_exceeded" if "exceeds max_model_len" in message else None  # the engine's check
    return bad_request(message, param, code)
