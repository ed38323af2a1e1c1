"""``specdec generate``'s sampling controls: ``--min-p``, the penalties, ``--logit-bias``,
``--min-tokens`` and structured output (``--json-schema``, ``--json-object``, ``--regex``,
``--grammar``), turned into :func:`specdec.generate`'s keywords (:mod:`specdec.logits`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specdec.cli_args import finite_float

__all__ = ["add_control_arguments", "controls_from_args"]


def add_control_arguments(p: argparse.ArgumentParser) -> None:
    """The controls' options (every one off by default)."""
    g = p.add_argument_group("sampling controls (exact under speculation: docs/serving.md)")
    g.add_argument("--min-p", type=finite_float, default=None, help="keep tokens with p >= min_p x p_max")
    g.add_argument("--presence-penalty", type=finite_float, default=None, help="OpenAI's, in [-2, 2]")
    g.add_argument("--frequency-penalty", type=finite_float, default=None, help="OpenAI's, in [-2, 2]")
    g.add_argument("--repetition-penalty", type=finite_float, default=None, help="CTRL's, > 0 (1: none)")
    g.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="token id bias in [-100, 100]; -100 bans",
    )
    g.add_argument("--min-tokens", type=int, default=None, help="no end-of-sequence token before this many")
    s = g.add_mutually_exclusive_group()
    s.add_argument(
        "--json-schema", metavar="SCHEMA", help="a JSON schema the output follows: inline JSON or a file"
    )
    s.add_argument("--json-object", action="store_true", help="the output is one JSON object")
    s.add_argument("--regex", metavar="REGEX", help="a regular expression the output matches")
    s.add_argument("--grammar", metavar="FILE", type=Path, help="an EBNF (GBNF) grammar file, root ::= ...")


def _bias(items: list[str]) -> dict[int, float] | None:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias must be ID=BIAS (an int and a number), got {item!r}") from None
        if not sep:
            raise ValueError(f"--logit-bias must be ID=BIAS, got {item!r}")
    return out or None


def controls_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`specdec.generate`'s keywords for the given controls."""
    from specdec.logits import GrammarSpec

    grammar = None
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            path = Path(text)
            if not path.is_file():
                raise ValueError(f"--json-schema must be inline JSON or a file, got {text!r:.80}")
            text = path.read_text()
        grammar = GrammarSpec.json_schema(text, field="--json-schema")
    elif args.json_object:
        grammar = GrammarSpec("json_object", field="--json-object")
    elif args.regex is not None:
        grammar = GrammarSpec("regex", args.regex, field="--regex")
    elif args.grammar is not None:
        if not args.grammar.is_file():
            raise ValueError(f"--grammar: no such file {str(args.grammar)!r}")
        grammar = GrammarSpec("ebnf", args.grammar.read_text(), field="--grammar")
    return {
        "min_p": args.min_p,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "repetition_penalty": args.repetition_penalty,
        "logit_bias": _bias(args.logit_bias),
        "min_tokens": args.min_tokens,
        "grammar": grammar,
    }
