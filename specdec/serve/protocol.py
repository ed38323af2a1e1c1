"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions``, checked and turned into token ids.

Every field is checked here, before the request reaches the engine, and a bad one is a 400 that
names it (:class:`specdec.serve.errors.APIError`). Fields OpenAI defines that the server does not
implement (``logprobs``, ``echo``, penalties, tools, ...) are refused unless they hold their
neutral value; other unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from specdec.prompt_sets import has_chat_template
from specdec.sampling import validate_sampling
from specdec.seeds import check_seed
from specdec.serve.errors import APIError, bad_request, prompt_overflow

__all__ = ["ServedModel", "GenerationRequest", "parse_completion", "parse_chat", "check_model"]

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left

# Fields the server does not implement, and the values that mean "off".
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "min_tokens": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


@dataclass(frozen=True, kw_only=True)
class ServedModel:
    """What requests are checked against: the model's name, its context and its tokenizer.

    ``max_model_len`` cache slots per request, of which ``reserved`` (γ_max + 1) are kept for the
    deepest draft block: a request needs prompt + max_tokens + reserved <= max_model_len.
    """

    name: str
    max_model_len: int
    reserved: int
    vocab_size: int
    tokenizer: Any


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One checked request: token ids and the engine's per-request settings."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool

    def engine_options(self) -> dict[str, Any]:
        """Keyword arguments of ``Engine.add_request``."""
        return {
            "max_new_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop_strings": list(self.stop) or None,
            "ignore_eos": self.ignore_eos,
        }


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _optional_int(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < minimum:
        raise bad_request(f"{name} must be an integer >= {minimum}, got {value!r}", name)
    return int(value)


def _optional_bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {value!r}", name)
    return value


def check_model(body: dict[str, Any], served: str) -> None:
    """``model`` absent, null or the served name; another name is a 404."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad_request(f"model must be a string, got {model!r}", "model")
    if model != served:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves `{served}`",
            param="model",
            code="model_not_found",
        )


def _common(
    body: dict[str, Any], model: ServedModel, prompt_ids: list[int], *, chat: bool
) -> GenerationRequest:
    """The fields both endpoints share, and the context check."""
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and not any(value == v for v in neutral):
            raise bad_request(f"{name} is not supported by this server (got {value!r:.80})", name)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad_request(f"n must be 1 (one choice per request), got {n!r}", "n")
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    if not _is_number(temperature):
        raise bad_request(f"temperature must be a finite number, got {temperature!r}", "temperature")
    top_p = body.get("top_p")
    if top_p is not None and not _is_number(top_p):
        raise bad_request(f"top_p must be a number in (0, 1], got {top_p!r}", "top_p")
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < -1):
        raise bad_request(f"top_k must be an integer >= 1 (or -1 / 0: off), got {top_k!r}", "top_k")
    top_k = None if top_k is None or top_k <= 0 else int(top_k)
    try:
        validate_sampling(float(temperature), top_k, None if top_p is None else float(top_p))
    except ValueError as err:
        raise bad_request(str(err), str(err).split(" ", 1)[0]) from None
    seed = body.get("seed")
    if seed is not None:
        try:
            seed = check_seed(seed)
        except ValueError as err:
            raise bad_request(str(err), "seed") from None
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(s for s in stop if s)
    else:
        raise bad_request(f"stop must be a string or a list of strings, got {stop!r}", "stop")
    stream = _optional_bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict):
            raise bad_request(f"stream_options must be an object, got {options!r}", "stream_options")
        include_usage = _optional_bool(options, "include_usage")
    max_tokens, named = _optional_int(body, "max_tokens", 1), "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:  # OpenAI's current name wins
        max_tokens, named = _optional_int(body, "max_completion_tokens", 1), "max_completion_tokens"
    room = model.max_model_len - model.reserved - len(prompt_ids)
    prompt_field = "messages" if chat else "prompt"
    if room < 1:  # the prompt alone leaves no room for one token: it is to blame, not max_tokens
        raise prompt_overflow(prompt_field, len(prompt_ids), model.max_model_len, model.reserved)
    if max_tokens is None:
        max_tokens = room if chat else COMPLETION_MAX_TOKENS
        named = prompt_field
    if len(prompt_ids) + max_tokens + model.reserved > model.max_model_len or max_tokens < 1:
        raise bad_request(
            f"This model's maximum context length is {model.max_model_len} tokens, {model.reserved} of "
            f"which are kept for speculative drafts; the prompt has {len(prompt_ids)} tokens and "
            f"max_tokens is {max_tokens} ({len(prompt_ids)} + {max_tokens} + {model.reserved} = "
            f"{len(prompt_ids) + max_tokens + model.reserved} > {model.max_model_len})",
            named,
            "context_length_exceeded",
        )
    return GenerationRequest(
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=None if top_p is None else float(top_p),
        top_k=top_k,
        seed=seed,
        stop=stops,
        ignore_eos=_optional_bool(body, "ignore_eos"),
        stream=stream,
        include_usage=include_usage,
    )


def _token_ids(value: list[Any], model: ServedModel) -> list[int]:
    for t in value:
        if not _is_int(t) or not 0 <= t < model.vocab_size:
            raise bad_request(
                f"prompt holds {t!r}; token ids must be integers in [0, {model.vocab_size})", "prompt"
            )
    return [int(t) for t in value]


def parse_completion(body: dict[str, Any], model: ServedModel) -> GenerationRequest:
    """A ``/v1/completions`` body: ``prompt`` a string or a list of token ids (or a list of one of
    either); several prompts in one request are refused (one choice per request)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = list(model.tokenizer(prompt).input_ids)
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        ids = _token_ids(prompt, model)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request(f"prompt: one prompt per request, got a batch of {len(prompt)}", "prompt")
    else:
        raise bad_request(f"prompt must be a string or a list of token ids, got {prompt!r:.80}", "prompt")
    if not ids:
        raise bad_request("prompt is empty (no tokens)", "prompt")
    return _common(body, model, ids, chat=False)


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad_request(
                    f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are "
                    f"supported, got {part!r:.80}",
                    "messages",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")


def parse_chat(body: dict[str, Any], model: ServedModel) -> GenerationRequest:
    """A ``/v1/chat/completions`` body: ``messages`` through the tokenizer's chat template, with the
    assistant's turn opened (``add_generation_prompt=True``)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string role", "messages")
        turns.append({"role": m["role"], "content": _message_text(m.get("content"), i)})
    tokenizer = model.tokenizer
    if not has_chat_template(tokenizer):
        raise bad_request("this model's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    except Exception as err:  # the template's own checks (roles must alternate, ...)
        raise bad_request(f"messages: the chat template refused them: {err}", "messages") from None
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    return _common(body, model, ids, chat=True)
