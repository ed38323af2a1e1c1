"""Command-line argument types shared by ``specdec``'s and ``experiments``' commands.

Every user-caused failure at the command line is one line that names the argument and what was
expected, and exit status 2: :class:`ArgumentParser` prints argparse's own errors that way, and the
types here refuse NaN, infinities and malformed ``KEY=VALUE`` options up front.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from specdec.seeds import check_seed

__all__ = [
    "add_compile_argument",
    "ArgumentParser",
    "finite_float",
    "positive_int",
    "nonnegative_int",
    "positive_int_list",
    "seed_int",
    "csv",
    "parse_options",
    "check_text",
    "device_arg",
    "add_placement_arguments",
    "stderr_line",
    "interrupt_watch",
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


def seed_int(text: str) -> int:
    """A seed: an integer in [0, 2**64) (:func:`specdec.seeds.check_seed`)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64), got {text!r}") from None
    try:
        return check_seed(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64), got {text!r}") from None


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


def device_arg(text: str) -> str:
    """An argparse type: a torch device that exists here (``cpu``, ``cuda``, ``cuda:1``); ``cuda`` on a
    machine without one is refused up front, before anything loads."""
    from specdec.targets import check_device

    try:
        return check_device(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_placement_arguments(parser: argparse.ArgumentParser, *, what: str = "the target") -> None:
    """``--device`` and ``--dtype`` (where ``what`` runs, in which compute dtype): one spelling for
    ``specdec generate``, ``serve`` and the other commands that open a target. A model drafter and an
    EAGLE head follow the target's device and dtype."""
    parser.add_argument(
        "--device",
        type=device_arg,
        default=None,
        help=f"torch device of {what}: cpu (default), cuda, cuda:1, ...; a model drafter or draft head "
        "goes there too",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help=f"compute dtype of {what} (activations, KV cache; float weights stored in it); default: the "
        "weights format's own (float32 for a safetensors checkpoint and for quantised weights on a CPU, "
        "bfloat16 for quantised weights on a GPU); docs/targets.md lists what runs where",
    )


def add_compile_argument(parser: Any) -> None:
    """``--compile MODE``: the native target's decode and verify forwards captured per bucket
    (:mod:`specdec.targets.compiled`)."""
    parser.add_argument(
        "--compile",
        choices=("none", "graphs", "inductor"),
        default=None,
        help="capture the native target's decode/verify forwards: graphs (CUDA graphs), inductor "
        "(torch.compile; on CUDA also in CUDA graphs), none (default); see docs/gpu.md",
    )


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


@contextlib.contextmanager
def interrupt_watch() -> Iterator[Callable[[], bool]]:
    """Remember Ctrl-C (SIGINT) while active; yields ``interrupted() -> bool``.

    SIGINT still raises ``KeyboardInterrupt`` as Python's default handler does. Some libraries
    swallow it when it lands inside an import (a C extension that clears the error while importing
    numpy for torch, say), and the run then fails later with an unrelated error: a command asks
    ``interrupted()`` to report that failure as the interrupt it was (one line, status 130). A
    handler other than Python's default (an ignored SIGINT, a caller's own) is left alone, as is
    SIGINT outside the main thread.
    """
    seen = False

    def on_sigint(signum: int, frame: Any) -> None:
        nonlocal seen
        seen = True
        raise KeyboardInterrupt

    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield lambda: False
        return
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield lambda: seen
    finally:
        signal.signal(signal.SIGINT, previous)
