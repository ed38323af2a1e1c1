"""A request's sampling controls as the engine holds them: the checks ``Engine.add_request`` makes of
them and the request's :class:`~specdec.logits.Processors` (its penalties, bias, ``min_tokens``, its own
processors and its grammar's state), with one grammar compiler per engine, built at the first
request that has a grammar."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specdec.engine.request import RequestParams
from specdec.logits import GrammarCompiler, GrammarSpec, Processors

__all__ = ["RequestControls"]


class RequestControls:
    """Builds each request's processors for an engine whose target has ``vocab_size`` tokens,
    ``eos_ids`` end-of-sequence tokens and ``tokenizer`` (None: no grammars)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._compiler: GrammarCompiler | None = None

    def processors(
        self, prompt_ids: list[int], params: RequestParams, logits_processors: Any, grammar: Any
    ) -> Processors | None:
        """The request's processors (None where it sets none); ``ValueError`` naming the argument
        where ``min_tokens`` passes ``max_new_tokens``, ``logits_processors`` are not callables, or the
        grammar is not a :class:`~specdec.logits.GrammarSpec` or does not compile."""
        if params.sampling.min_tokens > params.max_new_tokens:
            raise ValueError(
                f"min_tokens must be at most max_new_tokens ({params.max_new_tokens}), "
                f"got {params.sampling.min_tokens}"
            )
        if not isinstance(logits_processors, Sequence) or not all(callable(f) for f in logits_processors):
            raise ValueError(
                "logits_processors must be a list of callables fn(prompt_ids, output_ids, logits_V) -> "
                f"logits_V, got {logits_processors!r:.80}"
            )
        matcher = None if grammar is None else self._matcher(grammar, params)
        return Processors.build(
            params.sampling,
            prompt_ids,
            vocab_size=self.vocab_size,
            stop_ids=sorted(params.eos_token_ids),
            custom=list(logits_processors),
            grammar=matcher,
        )

    def _matcher(self, spec: Any, params: RequestParams) -> Any:
        """A fresh grammar state for the request (its end-of-sequence tokens, the target's if none)."""
        if not isinstance(spec, GrammarSpec):
            raise ValueError(f"grammar must be a specdec.logits.GrammarSpec, got {type(spec).__name__}")
        if self.tokenizer is None:
            raise ValueError("grammar needs a tokenizer: pass tokenizer= (the target has none)")
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._compiler.matcher(spec, sorted(params.eos_token_ids))
