"""Request intake: a body read, parsed and checked before its fields reach the parser of its route,
with nothing on the HTTP loop that grows with the body beyond reading it.

One large or malformed request must not stall the other clients (their streams, ``/health``), and no
client input may end in a 500. In order:

1. **Size.** A body over ``max_body_bytes`` is refused with a 413 before it is read: by its
   ``Content-Length`` at once, and a chunked body as soon as the bytes read pass the limit. A refused
   body is read on and dropped (up to :data:`DRAIN_FACTOR` times the limit) so the client, still
   sending, gets the 413 rather than a reset connection.
2. **JSON**, on the intake thread: not JSON, nested deeper than ``max_json_depth`` (a ``RecursionError``
   in the parser included), or holding a string that is not valid Unicode (a lone UTF-16 surrogate such
   as ``"\\ud800"``, which a JavaScript client sends when it cuts an emoji in half): a 400 whose
   ``param`` is the field's path (``messages[0].role``).
3. **Prompt size before tokenising**: a list of token ids longer than the context, or a text prompt
   (chat: the messages' text together) longer than the context times the longest token's characters
   (:func:`longest_token_chars`), cannot fit, and is a 400 that blames the prompt.
4. **Stop strings**: at most :data:`MAX_STOP_STRINGS` (the engine thread checks every one after every
   step of the request, so thousands would slow every client's stream).
5. **Chat roles**: ``system``, ``user``, ``assistant``, and those of :data:`TEMPLATE_ROLES` that the
   model's chat template names; any other is a 400 listing the accepted ones (a role is rendered into
   the template as it is, so a free-form role could write turns of its own).
6. **Parse and tokenise** by the route's parser, still on the intake thread: one thread, as vLLM's
   async tokenizer, since a fast tokenizer is not safe to share between threads.

Steps 2-6 run on that thread (:meth:`Intake.parse`), so the loop keeps serving while a request is
checked; with the body limited, every step is bounded.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from specdec.serve.errors import APIError, bad_request
from specdec.serve.protocol import ServedModel, check_model

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DRAIN_FACTOR",
    "MAX_STOP_STRINGS",
    "TEMPLATE_ROLES",
    "Intake",
    "IntakeLimits",
    "chat_roles",
    "check_prompt_size",
    "check_roles",
    "check_stop_count",
    "longest_token_chars",
    "parse_body",
    "read_body",
]

DEFAULT_MAX_BODY_BYTES = 1 << 20
"""1 MiB: a prompt of 2,048 token ids is about 14 KB of JSON, a batch of 8 such prompts about 110 KB.
Parsing a body of this size takes the loop's thread (JSON parsing holds the GIL) about 10 ms."""
DEFAULT_MAX_JSON_DEPTH = 32  # OpenAI's bodies nest 4 deep (messages[i].content[j].text)
DRAIN_FACTOR = 16
"""A refused body up to this many times the limit is read and dropped before the 413 (see step 1)."""
MAX_STOP_STRINGS = 64  # OpenAI takes 4; lm-eval's tasks send a few
BASE_ROLES = ("system", "user", "assistant")
TEMPLATE_ROLES = ("developer", "tool", "ipython", "function")
"""Roles accepted where the chat template names them (quoted, as a template compares roles)."""

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class IntakeLimits:
    """What a body may hold (:func:`IntakeLimits.for_model` derives the prompt limits).

    ``max_prompt_tokens``: token ids in a prompt (the context, ``max_model_len``).
    ``max_prompt_chars``: characters of a text prompt, ``max_model_len`` times the longest token's
    characters: a longer text cannot fit in the context.
    ``roles``: the chat roles accepted.
    """

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_prompt_tokens: int
    max_prompt_chars: int
    roles: tuple[str, ...] = BASE_ROLES

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_json_depth", "max_prompt_tokens", "max_prompt_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    @classmethod
    def for_model(cls, model: ServedModel, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> IntakeLimits:
        """The limits of a server over ``model`` (reads its tokenizer's vocabulary once)."""
        return cls(
            max_body_bytes=max_body_bytes,
            max_prompt_tokens=model.max_model_len,
            max_prompt_chars=model.max_model_len * longest_token_chars(model.tokenizer),
            roles=chat_roles(model.tokenizer),
        )


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token's entry in the vocabulary has (special tokens included): at least
    the characters of text one token covers (a byte-level entry has a character per byte)."""
    vocab = tokenizer.get_vocab()
    return max((len(piece) for piece in vocab), default=1) or 1


def chat_roles(tokenizer: Any) -> tuple[str, ...]:
    """``system``, ``user``, ``assistant``, and the :data:`TEMPLATE_ROLES` that ``tokenizer``'s chat
    template names in quotes (``'tool'`` or ``"tool"``)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = "\n".join(str(t) for t in template.values())
    if not isinstance(template, str):
        return BASE_ROLES
    extra = tuple(r for r in TEMPLATE_ROLES if f"'{r}'" in template or f'"{r}"' in template)
    return BASE_ROLES + extra


# --- 1. size (on the loop) ---------------------------------------------------------------------------
def _too_large(size: str, limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is {size} bytes; this server takes at most {limit} (--max-body-bytes)",
        code="request_too_large",
    )


async def read_body(request: Any, max_bytes: int) -> bytes:
    """The body of a Starlette ``request``, or a 413 once it is over ``max_bytes`` (see step 1)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise bad_request(f"Content-Length must be a number of bytes, got {declared!r:.40}")
        if int(declared) > max_bytes:
            if int(declared) <= DRAIN_FACTOR * max_bytes:
                await _drop(request.stream(), DRAIN_FACTOR * max_bytes)
            raise _too_large(declared.strip(), max_bytes)
    stream = request.stream()
    chunks, size = [], 0
    async for chunk in stream:
        size += len(chunk)
        if size > max_bytes:
            await _drop(stream, DRAIN_FACTOR * max_bytes - size)
            raise _too_large(f"more than {max_bytes}", max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


async def _drop(stream: Any, budget: int) -> None:
    """Read and drop the rest of a refused body, so that a client still sending it reads the 413
    rather than a reset connection; after ``budget`` bytes, stop (the connection then closes)."""
    try:
        async for chunk in stream:
            budget -= len(chunk)
            if budget < 0:
                return
    except Exception:  # the client left: nothing left to drop
        return


# --- 2. JSON (intake thread) -------------------------------------------------------------------------
def _where(path: Sequence[str | int]) -> str:
    """``path`` as OpenAI writes a field's place (``messages[0].content``), each key cut at 40 characters."""
    out = ""
    for part in path:
        if isinstance(part, str) and len(part) > 40:
            part = part[:40] + "..."
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "the request body"


def _param(path: Sequence[str | int]) -> str | None:
    """The 400's ``param``: the field's path (``messages[0].content``); None for the body itself."""
    return _where(path) if path and isinstance(path[0], str) else None


def _check_text(text: str, path: Sequence[str | int], what: str = "") -> None:
    """A 400 naming ``path`` if ``text`` does not encode as UTF-8 (a lone surrogate)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise bad_request(
            f"{what}{_where(path)} holds a lone UTF-16 surrogate (U+{ord(text[err.start]):04X}) at character "
            f"{err.start}: text must be valid Unicode (was a surrogate pair cut in half?)",
            _param(path),
            "invalid_unicode",
        ) from None


def _check_tree(body: Any, max_depth: int) -> None:
    """Every container at most ``max_depth`` deep, every string and key valid Unicode (iteratively:
    no recursion however deep the body is)."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(body, ())]
    while stack:
        node, path = stack.pop()
        if len(path) >= max_depth:
            raise bad_request(
                f"the request body nests deeper than {max_depth} levels (at {_where(path)})",
                _param(path),
                "too_deep",
            )
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(key, str):
                _check_text(key, path, "a key in ")
            if isinstance(value, str):
                _check_text(value, path + (key,))
            elif isinstance(value, (dict, list)):
                stack.append((value, path + (key,)))


def parse_body(raw: bytes, max_json_depth: int = DEFAULT_MAX_JSON_DEPTH) -> dict[str, Any]:
    """A JSON object from ``raw``, or a 400 (see step 2)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(
            f"the request body nests deeper than {max_json_depth} levels", None, "too_deep"
        ) from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4,300 digits
        raise bad_request(f"the request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_tree(body, max_json_depth)
    return body


# --- 3, 4. prompt size and roles (intake thread) -------------------------------------------------------
def _size_error(name: str, size: str, limits: IntakeLimits, why: str) -> APIError:
    return bad_request(
        f"{name} has {size}; {why} (the context is {limits.max_prompt_tokens} tokens)",
        name,
        "context_length_exceeded",
    )


def _check_one_prompt(prompt: Any, name: str, limits: IntakeLimits) -> None:
    if isinstance(prompt, str) and len(prompt) > limits.max_prompt_chars:
        raise _size_error(
            name,
            f"{len(prompt)} characters",
            limits,
            f"at most {limits.max_prompt_chars} can fit, as no token covers more than "
            f"{limits.max_prompt_chars // limits.max_prompt_tokens}",
        )
    if isinstance(prompt, list) and len(prompt) > limits.max_prompt_tokens:
        raise _size_error(name, f"{len(prompt)} token ids", limits, "it cannot fit")


def check_prompt_size(body: dict[str, Any], limits: IntakeLimits, *, chat: bool) -> None:
    """Step 3: a 400 for a prompt that cannot fit in the context, before it is tokenised or its ids
    are checked one by one (a list of prompts: each)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return  # the parser names what is wrong
        chars = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                texts = (p.get("text") for p in content if isinstance(p, dict))
                chars += sum(len(t) for t in texts if isinstance(t, str))
        if chars > limits.max_prompt_chars:
            raise _size_error(
                "messages",
                f"{chars} characters of text",
                limits,
                f"at most {limits.max_prompt_chars} can fit, as no token covers more than "
                f"{limits.max_prompt_chars // limits.max_prompt_tokens}",
            )
        return
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        for i, one in enumerate(prompt):  # a batch of prompts
            _check_one_prompt(one, f"prompt[{i}]", limits)
    else:
        _check_one_prompt(prompt, "prompt", limits)


def check_stop_count(body: dict[str, Any]) -> None:
    """Step 4: at most :data:`MAX_STOP_STRINGS` stop strings."""
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are taken", "stop")


def check_roles(body: dict[str, Any], roles: Sequence[str]) -> None:
    """Step 5: every message's role (where it is a string) is one of ``roles``."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if isinstance(role, str) and role not in roles:
            raise bad_request(
                f"messages[{i}].role is {role!r:.60}; this model's chat template takes "
                f"{', '.join(map(repr, roles))}",
                f"messages[{i}].role",
            )


# --- the intake thread --------------------------------------------------------------------------------
class Intake:
    """Reads a request's body on the loop, then checks and parses it on the one intake thread."""

    def __init__(self, limits: IntakeLimits, model_name: str) -> None:
        self.limits = limits
        self.model_name = model_name
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-intake")

    async def parse(self, request: Any, parse: Callable[[dict[str, Any]], T], *, chat: bool) -> T:
        """The body of ``request`` through steps 1-6, ``parse`` the route's own parser (its 400s
        pass through as they are)."""
        raw = await read_body(request, self.limits.max_body_bytes)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._checked, raw, parse, chat)

    def _checked(self, raw: bytes, parse: Callable[[dict[str, Any]], T], chat: bool) -> T:
        body = parse_body(raw, self.limits.max_json_depth)
        check_model(body, self.model_name)
        check_prompt_size(body, self.limits, chat=chat)
        check_stop_count(body)
        if chat:
            check_roles(body, self.limits.roles)
        return parse(body)

    def close(self) -> None:
        """Stop the intake thread (requests it has not begun are dropped)."""
        self._thread.shutdown(wait=False, cancel_futures=True)
