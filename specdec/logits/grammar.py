"""Structured output: a request's output follows a JSON schema, any JSON object, a regular expression
or an EBNF grammar, through xgrammar (Dong et al. 2024, arXiv 2411.15100; what vLLM and SGLang use).

Legend: T block positions, W = ⌈V / 32⌉ bitmask words, V vocabulary.

:class:`GrammarSpec` says what to follow (checked and compiled where the request is made:
``ValueError`` naming the field when a schema is unsupported or a grammar does not compile).
:class:`Grammar` is one request's matcher over its committed output. As a logits processor
(:class:`specdec.logits.Processors`) it masks every verify position with the grammar state of that
position's own prefix: it accepts the draft tokens on the position's path, fills the token bitmask and
rolls back, so a drafted token the grammar forbids has target probability 0 and is rejected whatever
the target says. A state that allows no token at all (a dead end; or the grammar is complete and the
request ignores its end-of-sequence tokens) allows only the end-of-sequence token, and committing it
ends the request (finish reason ``"grammar"``, ``"stop"`` on the server; logged): never NaN, a crash
or a hang.

**Free drafts** (:meth:`Grammar.forced`): where the grammar admits exactly one continuation string
(xgrammar's jump-forward string: JSON's punctuation, a schema's keys), its tokens are proposed as
point-mass drafts whatever the drafter says. Any deterministic proposal keeps the processed target
distribution exactly (the rule compares it with the target like any other draft), and these cost no
drafting. :meth:`Grammar.drafts` also finds a drafter's chain's first token the grammar forbids (the
engine cuts the chain there: :mod:`specdec.engine.grammar_drafts`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GRAMMAR_KINDS", "Grammar", "GrammarCompiler", "GrammarSpec", "allowed_tokens"]

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must follow: ``kind`` one of :data:`GRAMMAR_KINDS`; ``source`` the JSON
    schema (as JSON text), the regular expression or the EBNF grammar (GBNF, llama.cpp's form, is
    EBNF with ``root ::=``); empty for ``json_object``. ``field``: the request field it came from, for
    error messages."""

    kind: str
    source: str = ""
    field: str = "grammar"

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(
                f"{self.field}: the grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}"
            )
        if not isinstance(self.source, str):
            raise ValueError(f"{self.field} must be a string, got {type(self.source).__name__}")
        if self.kind != "json_object" and not self.source.strip():
            raise ValueError(f"{self.field} must not be empty for a {self.kind} grammar")

    @classmethod
    def json_schema(cls, schema: Any, field: str = "json_schema") -> GrammarSpec:
        """From a schema given as a mapping (or JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise ValueError(f"{field} is not valid JSON: {err}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"{field} must be a JSON object (a schema), got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema), field)


def _bit(b: int) -> int:
    """Bit ``b`` of an int32 bitmask word as an int32 value (bit 31 is the sign)."""
    return 1 << b if b < 31 else -(1 << 31)


def allowed_tokens(bitmask_TW: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[T, V]`` bool from xgrammar's int32 token bitmask ``[T, W]`` (token v is bit v % 32 of word
    v // 32): the unpacking where xgrammar's own kernel does not run (an accelerator's logits)."""
    shifts_32 = torch.arange(32, dtype=torch.int32, device=bitmask_TW.device)
    bits_TW32 = (bitmask_TW.unsqueeze(-1) >> shifts_32) & 1
    return bits_TW32.reshape(bitmask_TW.shape[0], -1)[:, :vocab_size].bool()


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` for one tokenizer (xgrammar caches compiled grammars)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self.xgr, self.vocab_size = xgr, vocab_size
        self.tokenizer = tokenizer
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids)
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.stop_ids = list(stop_ids)

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar; ``ValueError`` naming ``spec.field`` when it does not compile."""
        c = self.compiler
        try:
            if spec.kind == "json_object":  # OpenAI's: an object (the built-in JSON grammar takes any value)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "json_schema":
                return c.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
            if spec.kind == "regex":
                return c.compile_regex(spec.source)
            return c.compile_grammar(spec.source)
        except Exception as err:  # xgrammar raises RuntimeError / its own errors with the parser's message
            message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(err).strip())  # its log prefix
            raise ValueError(f"{spec.field}: the {spec.kind} does not compile: {message[:300]}") from None

    def matcher(self, spec: GrammarSpec, stop_ids: Sequence[int]) -> Grammar:
        """A fresh :class:`Grammar` for one request; its end-of-sequence tokens ``stop_ids`` (the
        target's when empty)."""
        return Grammar(self, self.compile(spec), list(stop_ids) or self.stop_ids)


class Grammar:
    """One request's grammar state over its committed output (see the module)."""

    def __init__(self, compiler: GrammarCompiler, compiled: Any, stop_ids: list[int]) -> None:
        xgr = compiler.xgr
        self.xgr, self.tokenizer, self.vocab_size = xgr, compiler.tokenizer, compiler.vocab_size
        self.stop_ids = stop_ids
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids)
        self.ended: str | None = None

    # --- the committed state --------------------------------------------------------------------
    def commit(self, tokens: Sequence[int]) -> None:
        """Committed tokens enter the matcher; a dead end or a completed grammar ends the request."""
        for t in tokens:
            if self.ended is not None:
                return
            if self.matcher.is_terminated():
                self.ended = "the grammar is complete"
                return
            if not self.matcher.accept_token(int(t)):
                if int(t) in self.stop_ids:  # the dead-end stop (see mask)
                    self.ended = "the grammar allows no token here (a dead end): the output ends"
                    return
                raise ValueError(f"token {int(t)} was committed where the grammar forbids it")
        if self.ended is None and self.matcher.is_terminated():
            self.ended = "the grammar is complete"

    # --- masks ----------------------------------------------------------------------------------
    def _walk(self, path: Sequence[int]) -> int:
        """Accept ``path`` from the committed state: ``len(path)``, or ``~n`` (negative) where its
        token n is forbidden after n accepted. The matcher then holds the accepted tokens: the caller
        rolls them back."""
        for n, t in enumerate(path):
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(t)):
                return ~n  # -(n + 1): forbidden after n accepted
        return len(path)

    def mask(self, x_TV: torch.Tensor, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """``x_TV`` (float32) with each position's forbidden tokens at −inf, in place (a position past a
        forbidden draft is left as it is: never reached); a dead-end position allows the
        end-of-sequence token alone."""
        T = len(paths)
        bitmask_TW = self.xgr.allocate_token_bitmask(T, self.vocab_size)  # every token allowed
        for t, path in enumerate(paths):
            accepted = self._walk(path)
            if accepted >= 0:
                if self.matcher.is_terminated():
                    bitmask_TW[t].zero_()
                else:
                    self.matcher.fill_next_token_bitmask(bitmask_TW, t)
                if not bool(bitmask_TW[t].any()):  # a dead end: the end-of-sequence token alone
                    stop = self.stop_ids[0]
                    bitmask_TW[t, stop // 32] = _bit(stop % 32)
            n = accepted if accepted >= 0 else ~accepted
            if n:
                self.matcher.rollback(n)
        if x_TV.device.type == "cpu":
            self.xgr.apply_token_bitmask_inplace(x_TV, bitmask_TW, vocab_size=self.vocab_size)
        else:
            x_TV.masked_fill_(~allowed_tokens(bitmask_TW, self.vocab_size).to(x_TV.device), float("-inf"))
        return x_TV

    # --- drafts ---------------------------------------------------------------------------------
    def drafts(self, chain: Sequence[int], limit: int) -> tuple[int, list[int]]:
        """A drafter's ``chain`` (from the committed state) as the grammar shapes it, in one walk: how
        many of its tokens the grammar allows in a row (n), then at most ``limit - n`` tokens of the
        string it forces after those (xgrammar's jump-forward string, re-tokenised, each checked by
        the matcher): free drafts. The matcher ends where it began."""
        walked = self._walk(chain)
        n = walked if walked >= 0 else ~walked  # the matcher holds the n allowed tokens
        tokens: list[int] = []
        if n < limit and self.ended is None and not self.matcher.is_terminated():
            text = self.matcher.find_jump_forward_string()
            if text:
                for t in self.tokenizer.encode(text, add_special_tokens=False)[: limit - n]:
                    if not self.matcher.accept_token(int(t)):
                        break
                    tokens.append(int(t))
        if n + len(tokens):
            self.matcher.rollback(n + len(tokens))
        return n, tokens
