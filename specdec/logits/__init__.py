"""Logits processors, exact under speculation: penalties, logit bias, ``min_tokens``, a request's own
processors (:mod:`.processors`) and structured output (:mod:`.grammar`), applied to the target's
logits at every verify position with that position's own prefix."""

from specdec.logits.checks import BAN, check_bias
from specdec.logits.grammar import GRAMMAR_KINDS, Grammar, GrammarCompiler, GrammarSpec
from specdec.logits.processors import SAMPLING_CONTROLS, LogitsProcessor, Processors

__all__ = [
    "BAN",
    "GRAMMAR_KINDS",
    "Grammar",
    "GrammarCompiler",
    "GrammarSpec",
    "LogitsProcessor",
    "SAMPLING_CONTROLS",
    "Processors",
    "check_bias",
]
