"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions``, checked and turned into token ids.

Every field is checked here, before the request reaches the engine, and a bad one is a 400 that
names it (:class:`specdec.serve.errors.APIError`). Fields OpenAI defines that the server does not
implement (``best_of`` > 1, ``suffix``, tools, functions) are refused unless they hold their
neutral value; the sampling controls (penalties, ``logit_bias``, ``min_p``, ``min_tokens``,
``response_format`` and vLLM's ``guided_*``) are checked by :mod:`specdec.serve.controls`; other
unknown fields are ignored, as vLLM does. A 400's ``param`` is the path of the field at fault, as
OpenAI writes it (``prompt[1]``, ``stream_options.include_usage``, ``messages[0].content``), and a
message quotes at most 80 characters of what the client sent.

One request may ask for several **choices**: ``/v1/completions`` takes a list of prompts, and both
endpoints take ``n``; every choice is its own engine request (:meth:`GenerationRequest.choices`),
indexed ``prompt_i * n + j`` as OpenAI orders them. Log-probabilities (completions ``logprobs: k``,
chat ``logprobs: true`` + ``top_logprobs: k``) are the target's raw ones
(:mod:`specdec.engine.logprobs`); completions ``echo`` returns the prompt before the completion, with
its tokens' log-probabilities when ``logprobs`` is set, and allows ``max_tokens: 0`` (scoring a text
without generating, as lm-eval's loglikelihood requests do).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from specdec.drafters.request_slots import mix_seed
from specdec.prompt_sets import has_chat_template
from specdec.sampling import validate_sampling
from specdec.seeds import check_seed
from specdec.serve.chat import chat_prompt_ids
from specdec.serve.controls import parse_controls
from specdec.serve.errors import APIError, bad_request, prompt_overflow

__all__ = ["ServedModel", "GenerationRequest", "Choice", "parse_completion", "parse_chat", "check_model"]

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
MAX_LOGPROBS = 20  # alternatives per token, at most (vLLM's default ``max_logprobs``; chat's OpenAI limit)
MAX_CHOICES = 128  # choices (prompts x n) in one request, at most

# Fields the server does not implement, and the values that mean "off".
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
}


@dataclass(frozen=True, kw_only=True)
class ServedModel:
    """What requests are checked against: the model's name, its context and its tokenizer.

    ``max_model_len`` cache slots per request, of which ``reserved`` (γ_max + 1) are kept for the
    deepest draft block of a request that decodes (:meth:`needed`).
    ``content_special_tokens``: chat content's special-token strings are the special tokens, not text
    (:mod:`specdec.serve.chat`).
    """

    name: str
    max_model_len: int
    reserved: int
    vocab_size: int
    tokenizer: Any
    content_special_tokens: bool = False

    def needed(self, prompt_tokens: int, new_tokens: int) -> int:
        """Cache slots a request takes: its prompt and new tokens, plus ``reserved`` for draft blocks
        unless it asks for one token, which comes from the prefill's last position (it never
        decodes, so never drafts: echo scoring, ``max_tokens`` 0 or 1)."""
        return prompt_tokens + new_tokens + (self.reserved if new_tokens > 1 else 0)


@dataclass(frozen=True, kw_only=True)
class Choice:
    """One choice of a request: its ``index`` in the response, its prompt and its seed."""

    index: int
    prompt: int  # which of the request's prompts
    prompt_ids: list[int]
    seed: int | None


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One checked request: its prompts' token ids, the number of choices per prompt and the engine's
    per-request settings. ``prompt_texts``: each prompt's text as the client sent it (None: sent as
    token ids), for ``echo``. ``logprobs``: alternatives per token (None: no log-probabilities);
    ``max_tokens`` 0 only with ``echo`` (the engine then generates one token, not returned)."""

    prompts: list[list[int]]
    prompt_texts: list[str | None]
    n: int
    logprobs: int | None
    echo: bool
    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    speculative: bool = True
    controls: dict[str, Any] = field(default_factory=dict)
    """``Engine.add_request``'s keywords for the sampling controls (:mod:`specdec.serve.controls`)."""

    @property
    def prompt_ids(self) -> list[int]:
        """The first prompt's token ids (a chat request has one prompt)."""
        return self.prompts[0]

    @property
    def num_prompt_tokens(self) -> int:
        """Usage's ``prompt_tokens``: every prompt once, whatever ``n``."""
        return sum(len(p) for p in self.prompts)

    def choices(self) -> list[Choice]:
        """Every choice, in index order (``prompt_i * n + j``). Choice j of every prompt draws from
        its own keyed stream: the request's seed for j = 0 (so ``n`` does not change the first choice,
        and a prompt gives the same text alone or in a list), a seed derived from it for j > 0; no
        seed: each choice draws one at random."""
        out = []
        for p, ids in enumerate(self.prompts):
            for j in range(self.n):
                seed = self.seed
                if seed is not None and j > 0:
                    seed = mix_seed(seed, j, _CHOICE_SALT)
                out.append(Choice(index=p * self.n + j, prompt=p, prompt_ids=ids, seed=seed))
        return out

    def engine_options(self, seed: int | None = None) -> dict[str, Any]:
        """Keyword arguments of ``Engine.add_request`` for a choice drawing from ``seed``."""
        return {
            "max_new_tokens": max(self.max_tokens, 1),
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "seed": seed,
            "stop_strings": list(self.stop) or None,
            "ignore_eos": self.ignore_eos,
            "speculative": self.speculative,
            "logprobs": self.logprobs,
            "prompt_logprobs": self.logprobs if self.echo else None,
            **self.controls,
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
        raise bad_request(f"{name} must be an integer >= {minimum}, got {value!r:.80}", name)
    return int(value)


def _optional_bool(body: dict[str, Any], name: str, default: bool = False, *, within: str = "") -> bool:
    """``body[name]``: absent or null is ``default``; else a boolean. ``within``: the path of
    ``body`` in the request (``stream_options``), for the 400."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        where = f"{within}.{name}" if within else name
        raise bad_request(f"{where} must be a boolean (true or false), got {value!r:.80}", where)
    return value


_CHOICE_SALT = 3  # mix_seed's salt for the seeds of choices j > 0 (the engine uses 1 and 2)


def _logprobs_fields(body: dict[str, Any], *, chat: bool) -> int | None:
    """Completions ``logprobs: k``, or chat ``logprobs: true`` with ``top_logprobs: k``: the number
    of alternatives per token, or None when no log-probabilities are asked for."""
    if not chat:
        value = body.get("logprobs")
        if value is None or value is False:
            return None
        if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
            raise bad_request(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {value!r:.80}", "logprobs"
            )
        if body.get("top_logprobs") not in (None, 0):
            raise bad_request(
                "top_logprobs is a chat field: /v1/completions takes logprobs: k", "top_logprobs"
            )
        return int(value)
    wanted = _optional_bool(body, "logprobs")
    top = body.get("top_logprobs")
    if top is None:
        return 0 if wanted else None
    if not _is_int(top) or not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(
            f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top!r:.80}", "top_logprobs"
        )
    if not wanted:
        if top == 0:  # the neutral value: no log-probabilities
            return None
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return int(top)


def check_model(body: dict[str, Any], served: str) -> None:
    """``model`` absent, null or the served name; another name is a 404."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad_request(f"model must be a string, got {model!r:.80}", "model")
    if model != served:
        shown = model if len(model) <= 80 else model[:80] + "..."
        raise APIError(
            404,
            f"The model `{shown}` does not exist; this server serves `{served}`",
            param="model",
            code="model_not_found",
        )


def _common(
    body: dict[str, Any],
    model: ServedModel,
    prompts: list[list[int]],
    *,
    chat: bool,
    prompt_texts: list[str | None] | None = None,
) -> GenerationRequest:
    """The fields both endpoints share, and the context check (the longest prompt's)."""
    best_of = body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of < 1):  # OpenAI's range, then "> 1: no"
        raise bad_request(f"best_of must be an integer >= 1, got {best_of!r:.80}", "best_of")
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and not any(value == v for v in neutral):
            raise bad_request(f"{name} is not supported by this server (got {value!r:.80})", name)
    n = body.get("n")
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r:.80}", "n")
    if n * len(prompts) > MAX_CHOICES:
        raise bad_request(
            f"n x the number of prompts must be at most {MAX_CHOICES}, got {n} x {len(prompts)}", "n"
        )
    logprobs = _logprobs_fields(body, chat=chat)
    echo = False
    if chat and body.get("echo") not in (None, False):
        raise bad_request("echo is not supported by /v1/chat/completions (use /v1/completions)", "echo")
    if not chat:
        echo = _optional_bool(body, "echo")
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    if not _is_number(temperature):
        raise bad_request(f"temperature must be a finite number, got {temperature!r:.80}", "temperature")
    top_p = body.get("top_p")
    if top_p is not None and not _is_number(top_p):
        raise bad_request(f"top_p must be a number in (0, 1], got {top_p!r:.80}", "top_p")
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < -1):
        raise bad_request(f"top_k must be an integer >= 1 (or -1 / 0: off), got {top_k!r:.80}", "top_k")
    top_k = None if top_k is None or top_k <= 0 else int(top_k)
    try:
        validate_sampling(float(temperature), top_k, None if top_p is None else float(top_p))
    except ValueError as err:
        raise bad_request(str(err), str(err).split(" ", 1)[0]) from None
    seed = body.get("seed")
    if seed is not None:
        try:
            seed = check_seed(seed)
        except ValueError:
            raise bad_request(f"seed must be an integer in [0, 2**64), got {seed!r:.80}", "seed") from None
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(s for s in stop if s)
    else:
        raise bad_request(f"stop must be a string or a list of strings, got {stop!r:.80}", "stop")
    stream = _optional_bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict):
            raise bad_request(f"stream_options must be an object, got {options!r:.80}", "stream_options")
        include_usage = _optional_bool(options, "include_usage", within="stream_options")
    max_tokens, named = _optional_int(body, "max_tokens", 0 if echo else 1), "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:  # OpenAI's current name wins
        max_tokens, named = _optional_int(body, "max_completion_tokens", 1), "max_completion_tokens"
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    num_prompt, context = len(prompts[longest]), model.max_model_len
    prompt_field = "messages" if chat else "prompt" if len(prompts) == 1 else f"prompt[{longest}]"
    if model.needed(num_prompt, 1) > context:  # no room for one token: the prompt is to blame
        raise prompt_overflow(prompt_field, num_prompt, context, model.reserved)
    if max_tokens is None:
        max_tokens = max(context - model.reserved - num_prompt, 1) if chat else COMPLETION_MAX_TOKENS
        named = prompt_field
    generated = max(max_tokens, 1)  # echo with max_tokens 0 still generates one token
    needed = model.needed(num_prompt, generated)
    if needed > context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens, and a request that generates "
            f"more than one token keeps {model.reserved} of them for speculative drafts; the prompt has "
            f"{num_prompt} tokens and max_tokens is {max_tokens} ({num_prompt} + {generated} + "
            f"{model.reserved} = {needed} > {context})",
            named,
            "context_length_exceeded",
        )
    return GenerationRequest(
        prompts=prompts,
        prompt_texts=list(prompt_texts) if prompt_texts is not None else [None] * len(prompts),
        n=int(n),
        logprobs=logprobs,
        echo=echo,
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=None if top_p is None else float(top_p),
        top_k=top_k,
        seed=seed,
        stop=stops,
        ignore_eos=_optional_bool(body, "ignore_eos"),
        stream=stream,
        include_usage=include_usage,
        speculative=_optional_bool(body, "speculative", True),
        controls=parse_controls(body, model.vocab_size, max(max_tokens, 1)),
    )


def _token_ids(value: list[Any], model: ServedModel, where: str) -> list[int]:
    for j, t in enumerate(value):
        if not _is_int(t) or not 0 <= t < model.vocab_size:
            raise bad_request(
                f"{where}[{j}] is {t!r:.80}; token ids must be integers in [0, {model.vocab_size})", where
            )
    return [int(t) for t in value]


def parse_completion(body: dict[str, Any], model: ServedModel) -> GenerationRequest:
    """A ``/v1/completions`` body: ``prompt`` a string, a list of token ids, or a list of prompts
    (strings or lists of token ids), each its own choice(s); a 400 about one of a list names it
    (``prompt[1]``)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt and not any(_is_int(t) for t in prompt):
        batch = prompt
    else:
        raise bad_request(
            "prompt must be a string, a list of token ids, or a list of strings or of token-id lists, "
            f"got {prompt!r:.80}",
            "prompt",
        )
    if len(batch) > MAX_CHOICES:
        raise bad_request(f"prompt: at most {MAX_CHOICES} prompts per request, got {len(batch)}", "prompt")
    prompts, texts = [], []
    for i, one in enumerate(batch):
        where = "prompt" if len(batch) == 1 else f"prompt[{i}]"
        if isinstance(one, str):
            ids = list(model.tokenizer(one).input_ids)
        elif isinstance(one, list) and one and all(_is_int(t) for t in one):
            ids = _token_ids(one, model, where)
        else:
            raise bad_request(
                f"{where} must be a string or a non-empty list of token ids, got {one!r:.80}", where
            )
        if not ids:
            raise bad_request(f"{where} is empty (no tokens)", where)
        prompts.append(ids)
        texts.append(one if isinstance(one, str) else None)
    return _common(body, model, prompts, chat=False, prompt_texts=texts)


def _message_text(content: Any, i: int) -> str:
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad_request(
                    f"{where}[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                    f"got {part!r:.80}",
                    f"{where}[{j}]",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"{where} must be a string or a list of text parts, got {content!r:.80}", where)


def parse_chat(body: dict[str, Any], model: ServedModel) -> GenerationRequest:
    """A ``/v1/chat/completions`` body: ``messages`` through the tokenizer's chat template, with the
    assistant's turn opened (``add_generation_prompt=True``), special-token strings in a content as
    text unless ``model.content_special_tokens`` (:func:`specdec.serve.chat.chat_prompt_ids`)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string role", f"messages[{i}]")
        turns.append({"role": m["role"], "content": _message_text(m.get("content"), i)})
    tokenizer = model.tokenizer
    if not has_chat_template(tokenizer):
        raise bad_request("this model's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        ids = chat_prompt_ids(tokenizer, turns, content_special_tokens=model.content_special_tokens)
    except Exception as err:  # the template's own checks (roles must alternate, ...)
        raise bad_request(f"messages: the chat template refused them: {err}", "messages") from None
    return _common(body, model, [ids], chat=True)
