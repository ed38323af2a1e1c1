"""Command-line argument types shared by ``specdec``'s and ``experiments``' commands.

Every user-caused failure at the command line is one line that names the argument and what was
expected, and exit status 2: :class:`ArgumentParser` prints argparse's own errors that way, and the
types here refuse NaN, infinities and malformed ``KEY=VALUE`` options up front.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

__all__ = [
    "ArgumentParser",
    "finite_float",
    "positive_int",
    "nonnegative_int",
    "positive_int_list",
    "csv",
    "parse_options",
    "check_text",
    "stderr_line",
]


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (``prog: error: ...``), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def finite_float(text: str) -> float:
    """A finite float; NaN and infinities are refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _int(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int(text, 1)


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    return _int(text, 0)


def csv(cast: Callable[[str], Any]) -> Callable[[str], tuple]:
    """A comma-separated list, each item through ``cast`` (an argparse type)."""

    def parse(text: str) -> tuple:
        return tuple(cast(x.strip()) for x in text.split(",") if x.strip())

    return parse


def positive_int_list(text: str) -> list[int]:
    """A non-empty comma-separated list of integers >= 1 (benchmark sizes such as ``1,8,512``)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_options(items: Sequence[str] | None, flag: str) -> dict[str, Any]:
    """``["k=v", ...]`` → dict; values become int, float or bool when they look like one (a NaN or
    infinite number is a ``ValueError`` naming the flag and the key)."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} expects key=value, got {item!r}")
        value: Any = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for cast in (int, float):
                try:
                    value = cast(raw)
                    break
                except ValueError:
                    pass
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{flag} {key}: expected a finite number, got {raw!r}")
        out[key] = value
    return out


def check_text(value: str, flag: str) -> str:
    """``value`` if it is valid UTF-8 text (the shell may pass undecodable bytes as surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{flag} is not valid UTF-8 text ({err.reason} at character {err.start})") from None
    return value


def stderr_line(prog: str, err: BaseException) -> None:
    """Print ``prog: error: <message>`` on one line."""
    print(f"{prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
