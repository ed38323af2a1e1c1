"""The ``specdec serve`` subcommand: its arguments, and the command (heavy imports only when it runs).

    specdec serve --target smollm2-135m --drafter default --host 127.0.0.1 --port 8000 \\
        [--max-num-seqs N] [--gamma auto|fixed|N] [--verify exact] [--api-key KEY] [--max-waiting N] \\
        [--max-body-bytes N] [--allowed-origins ORIGIN ...] [--chat-content-special-tokens] \\
        [--device cuda] [--dtype bfloat16] [--compile graphs]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

from specdec.cli_args import (
    add_engine_arguments,
    config_from_args,
    finite_float,
    nonnegative_int,
    parse_options,
    positive_int,
)

__all__ = ["add_serve", "cmd_serve"]

SERVE_PACKAGES = ("fastapi", "uvicorn", "sse_starlette", "prometheus_client")


def add_serve(sub: argparse._SubParsersAction) -> None:
    """Add ``serve`` to the ``specdec`` subcommands."""
    p = sub.add_parser("serve", help="an OpenAI-compatible streaming server on the engine (extra [serve])")
    add_engine_arguments(p, gamma="depth-or-policy", threads=True)
    p.add_argument(
        "--max-num-seqs", type=positive_int, default=8, help="cache slots: requests decoding at once"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        help="token budget of one engine step (default: the engine's, 512)",
    )
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="cache slots per request: prompt + max_tokens + gamma + 1 must fit (default: the engine's)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)"
    )
    p.add_argument(
        "--port", type=nonnegative_int, default=8000, help="port (0: any free one; default: %(default)s)"
    )
    p.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: --target)"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $SPECDEC_API_KEY, else none; "
        "an empty key is an error)",
    )
    p.add_argument(
        "--max-waiting",
        type=nonnegative_int,
        default=256,
        help="engine requests (a request has one per prompt and n) waiting for a slot before new "
        "requests get 429 (default: %(default)s)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=None,
        help="largest request body; a larger one gets 413 before it is read (default: 1048576, 1 MiB)",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        type=_values,
        default=[],
        metavar="ORIGIN",
        help="origins (scheme://host[:port], or *) whose browser pages may call the API: CORS headers "
        "(default: none, no CORS headers); a JSON list is taken too, as vLLM's",
    )
    p.add_argument(
        "--allowed-methods",
        nargs="+",
        type=_values,
        default=[["*"]],
        metavar="METHOD",
        help="methods allowed to those origins (default: *)",
    )
    p.add_argument(
        "--allowed-headers",
        nargs="+",
        type=_values,
        default=[["*"]],
        metavar="HEADER",
        help="request headers allowed to those origins (default: *)",
    )
    p.add_argument(
        "--chat-content-special-tokens",
        action="store_true",
        help="tokenise special-token strings in chat message content (<|im_start|>) as the special tokens, "
        "which lets a message open turns of its own (default: as plain text, as OpenAI does)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=finite_float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM/SIGINT (default: %(default)s)",
    )
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=cmd_serve)


def _values(text: str) -> list[str]:
    """One value of a list flag: a JSON list of strings (vLLM's form) or the string itself."""
    if not text.startswith("["):
        return [text]
    try:
        values = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r:.80}") from None
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r:.80}")
    return values


def _joined(values: list[list[str]]) -> tuple[str, ...]:
    return tuple(v for one in values for v in one)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the server (returns when a signal has stopped it)."""
    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(
            "specdec serve needs the [serve] extra (pip install -e '.[serve]'): "
            f"{', '.join(missing)} not installed"
        )
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    from specdec.serve.server import ServeConfig, check_api_key, serve

    api_key = args.api_key
    if api_key is not None:
        check_api_key(api_key, "--api-key")
    else:
        api_key = os.environ.get("SPECDEC_API_KEY")
        if api_key is not None:
            check_api_key(api_key, "$SPECDEC_API_KEY")
    config = config_from_args(
        ServeConfig,
        args,
        drafter_options=parse_options(args.drafter_option, "--drafter-option"),
        gamma_options=parse_options(args.gamma_option, "--gamma-option"),
        verify_options=parse_options(args.verify_option, "--verify-option"),
        api_key=api_key,
        max_body_bytes=args.max_body_bytes or ServeConfig.max_body_bytes,
        allowed_origins=_joined(args.allowed_origins),
        allowed_methods=_joined(args.allowed_methods),
        allowed_headers=_joined(args.allowed_headers),
        shutdown_timeout_s=args.shutdown_timeout,
    )
    return serve(config)
