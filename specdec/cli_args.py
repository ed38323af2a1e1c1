"""Command-line argument types shared by ``specdec``'s and ``experiments``' commands.

Every user-caused failure at the command line is one line that names the argument and what was
expected, and exit status 2: :class:`ArgumentParser` prints argparse's own errors that way, and the
types here refuse NaN, infinities and malformed ``KEY=VALUE`` options up front.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from specdec.seeds import check_seed

__all__ = [
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
    "add_engine_arguments",
    "config_from_args",
    "depth_or_policy",
    "stderr_line",
    "interrupt_watch",
]


def config_from_args(cls: type, args: argparse.Namespace, /, **given: Any) -> Any:
    """A config dataclass from parsed arguments: each field from the argument of its name, where
    the parser has one, and ``given`` for the fields whose flags are named or parsed otherwise."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    parsed = {name: value for name, value in vars(args).items() if name in names}
    return cls(**{**parsed, **given})


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


def depth_or_policy(text: str) -> int | str:
    """An argparse type: a draft depth (an integer >= 0) or a depth policy name."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        return nonnegative_int(text)
    if not text:
        raise argparse.ArgumentTypeError("expected a depth (integer) or a policy name")
    return text


def add_engine_arguments(
    parser: argparse.ArgumentParser,
    *,
    drafter: str | None = "one",
    gamma: str | None = "depth",
    gamma_default: int | None = None,
    verify: bool = True,
    threads: bool = False,
) -> None:
    """The engine's options, one spelling for ``specdec generate``, ``serve`` and ``bench``.

    Always: the target (``--target``, ``--weights``, ``--device``, ``--dtype``, ``--backend``,
    ``--compile``; a model drafter and an EAGLE head follow the target's device and dtype). Then, by
    command:

    - ``drafter``: ``"one"`` (``--drafter NAME``, ``--drafter-option KEY=VALUE``), ``"per-label"``
      (the command names its drafters itself; ``--drafter-option DRAFTER.KEY=VALUE``) or None;
    - ``gamma``: ``"depth"`` (``--gamma N`` with default ``gamma_default``, None: the policy's, and
      ``--gamma-policy NAME``), ``"depth-or-policy"`` (``--gamma N|POLICY``, default ``auto``,
      and ``--gamma-option KEY=VALUE``) or None;
    - ``verify``: ``--verify RULE`` and ``--verify-option KEY=VALUE``;
    - ``threads``: ``--threads N`` (torch's intra-op threads).
    """
    if drafter not in ("one", "per-label", None):
        raise ValueError(f"drafter must be 'one', 'per-label' or None, got {drafter!r}")
    if gamma not in ("depth", "depth-or-policy", None):
        raise ValueError(f"gamma must be 'depth', 'depth-or-policy' or None, got {gamma!r}")
    from specdec.targets.llama_weights import WEIGHT_MODES

    add = parser.add_argument
    add("--target", default="smollm2-135m", help="built-in name or local checkpoint (default: %(default)s)")
    add(
        "--weights",
        choices=WEIGHT_MODES,
        default=None,
        help="native target weight format (default for a GGUF model such as smollm2-135m: gguf-q8, "
        "8-bit activations, where the CPU kernels have integer dot products (AVX2, AVX-512), else gguf, "
        "which equals transformers' output, and gguf dequantised into --dtype on a GPU; fp32 for a "
        "safetensors checkpoint, or --dtype's format)",
    )
    add(
        "--device",
        type=device_arg,
        default=None,
        help="torch device of the target: cpu (default), cuda, cuda:1, ...; a model drafter or draft head "
        "goes there too",
    )
    add(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="compute dtype of the target (activations, KV cache; float weights stored in it); default: the "
        "weights format's own (float32 for a safetensors checkpoint and for quantised weights on a CPU, "
        "bfloat16 for quantised weights on a GPU); docs/targets.md lists what runs where",
    )
    add("--backend", default="auto", help="target backend: auto | hf | llama (default: %(default)s)")
    add(
        "--compile",
        choices=("none", "graphs", "inductor"),
        default=None,
        help="capture the native target's decode/verify forwards: graphs (CUDA graphs), inductor "
        "(torch.compile; on CUDA also in CUDA graphs), none (default); see docs/gpu.md",
    )
    if threads:
        add("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    if drafter == "one":
        add("--drafter", default="default", help="drafter name from the registry (default: %(default)s)")
        add("--drafter-option", action="append", metavar="KEY=VALUE", help="drafter option (repeatable)")
    elif drafter == "per-label":
        add(
            "--drafter-option",
            action="append",
            metavar="DRAFTER.KEY=VALUE",
            help="option for one drafter, e.g. layerskip.num_layers=8 (repeatable)",
        )
    if gamma == "depth":
        add(
            "--gamma",
            type=nonnegative_int,
            default=gamma_default,
            help="draft depth: fixed's depth, or the deepest an adaptive policy drafts (default: "
            + ("the policy's)" if gamma_default is None else "%(default)s)"),
        )
        add(
            "--gamma-policy",
            default="auto",
            help="depth policy: fixed (exactly --gamma each step) | batch-table | goodput | auto (drafts "
            "0..--gamma) (default: %(default)s)",
        )
    elif gamma == "depth-or-policy":
        add(
            "--gamma",
            type=depth_or_policy,
            default="auto",
            help="draft depth: an integer (every request) or a depth policy: auto, fixed, batch-table, "
            "goodput (default: %(default)s)",
        )
        add("--gamma-option", action="append", metavar="KEY=VALUE", help="depth policy option")
    if verify:
        add(
            "--verify",
            default="exact",
            help="verification rule: exact | gumbel | lenient (lossy) (default: %(default)s)",
        )
        add("--verify-option", action="append", metavar="KEY=VALUE", help="rule option, e.g. lenience=0.5")


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
