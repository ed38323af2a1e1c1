"""The ``specdec`` command line: a thin layer over :func:`specdec.generate` and :mod:`specdec.bench`.

    specdec generate --target smollm2-135m --drafter default --prompt "Write a haiku." --chat \\
        --max-new-tokens 64 --temperature 0 --gamma 4 [--json]
    specdec bench --prompt-set humaneval,mtbench --num-prompts 5 --temperatures 0,0.7
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "build_parser", "open_target", "parse_options", "IncrementalDetokenizer"]

DTYPES = ("float32", "bfloat16", "float16")


def parse_options(items: Sequence[str] | None, flag: str) -> dict[str, Any]:
    """``["k=v", ...]`` → dict; values become int, float or bool when they look like one."""
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
        out[key] = value
    return out


def open_target(name: str, *, backend: str = "auto", dtype: str | None = None, device: str | None = None):
    """Load a target with :func:`specdec.targets.load_target` (on ``device``: ``cpu``, ``cuda``, ...).

    With ``backend="auto"`` it falls back to the ``transformers`` adapter while the native Llama
    target (``specdec.targets.llama``) is not installed.
    """
    import torch

    from specdec.targets import load_target

    options: dict[str, Any] = {}
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        options["dtype"] = getattr(torch, dtype)
    if device is not None:
        options["device"] = check_device(device)
    try:
        return load_target(name, backend=backend, **options)
    except ModuleNotFoundError as e:
        if backend != "auto" or e.name != "specdec.targets.llama":
            raise
        print("[specdec] native llama target not available; using the transformers adapter", file=sys.stderr)
        return load_target(name, backend="hf", **options)


def check_device(device: str) -> str:
    """``device`` if torch can place tensors there, else a ``ValueError`` naming it."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}") from e
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device here")
    return str(parsed)


def target_tokenizer(target: Any, name: str):
    """The target's tokenizer (``target.tokenizer``, else loaded from the checkpoint)."""
    tokenizer = getattr(target, "tokenizer", None)
    if tokenizer is None:
        from specdec.targets.loading import load_tokenizer

        tokenizer = load_tokenizer(name)
    return tokenizer


def encode_prompt(tokenizer: Any, text: str, *, chat: bool) -> list[int]:
    """Token ids of a raw prompt, or of a user turn in the tokenizer's chat template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat needs a tokenizer with a chat template; this one has none")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    return list(tokenizer(text).input_ids)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces as they become printable.

    Decodes a short window of recent tokens (so a token's leading space and merges with its left
    neighbour come out right) and holds text back while it ends in an incomplete UTF-8 sequence
    (U+FFFD), as vLLM's incremental detokenizer does.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, new_ids: Sequence[int]) -> str:
        """Add ids; return the newly printable text (possibly empty)."""
        self.ids.extend(new_ids)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip)
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is left (an incomplete sequence included) at the end of generation."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip)
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]


def _metrics_line(m: Any, drafter: str) -> str:
    return (
        f"[specdec] {m.num_generated_tokens} tokens in {m.total_time_s:.2f} s: "
        f"{m.tokens_per_second:.1f} tok/s | drafter {drafter}: alpha {m.acceptance_rate:.2f}, "
        f"tau {m.mean_accepted_tokens:.2f} | TTFT {m.ttft_s * 1e3:.0f} ms, TPOT {m.tpot_s * 1e3:.1f} ms "
        f"(p50 {m.latency_p50_s * 1e3:.1f}, p99 {m.latency_p99_s * 1e3:.1f}) | "
        f"target {m.target_time_s:.2f} s, draft {m.draft_time_s:.2f} s"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    import specdec
    from specdec.policies import make_policy
    from specdec.registry import DRAFTERS, create_drafter

    drafter_options = parse_options(args.drafter_option, "--drafter-option")
    policy = make_policy(args.gamma_policy, gamma=args.gamma)
    target = open_target(args.target, backend=args.backend, dtype=args.dtype, device=args.device)
    tokenizer = target_tokenizer(target, args.target)
    prompt_ids = encode_prompt(tokenizer, args.prompt, chat=args.chat)

    on_commit = None
    detok = None
    if not args.json:
        detok = IncrementalDetokenizer(tokenizer)

        def on_commit(row: int, ids: list[int]) -> None:
            sys.stdout.write(detok.push(ids))
            sys.stdout.flush()

    # Built here, once, so the name reported is the drafter that ran (``default`` picks one).
    drafter = create_drafter(args.drafter, target, **drafter_options)
    drafter_name = getattr(drafter, "registry_name", DRAFTERS.resolve(args.drafter))
    out = specdec.generate(
        target,
        [prompt_ids],
        drafter=drafter,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        gamma=policy,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop_strings=args.stop or None,
        tokenizer=tokenizer,
        on_commit=on_commit,
        verify=args.verify,
        verify_options=parse_options(args.verify_option, "--verify-option"),
    )
    token_ids = out.token_ids[0]
    if args.json:
        result = {
            "prompt_token_ids": out.prompt_token_ids[0],
            "token_ids": token_ids,
            "text": tokenizer.decode(token_ids, skip_special_tokens=True),
            "finish_reason": out.finish_reasons[0],
            "target": args.target,
            "drafter": drafter_name,
            "gamma_policy": args.gamma_policy,
            "verify": args.verify,
            "metrics": out.metrics.to_dict(),
        }
        print(json.dumps(result))
    else:
        sys.stdout.write(detok.flush() + "\n")
        sys.stdout.flush()
        print(_metrics_line(out.metrics, drafter_name), file=sys.stderr)
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding")
    p.add_argument(
        "--target", default="smollm2-135m", help="built-in name or local checkpoint (default: %(default)s)"
    )
    p.add_argument(
        "--drafter", default="default", help="drafter name from the registry (default: %(default)s)"
    )
    p.add_argument(
        "--drafter-option", action="append", metavar="KEY=VALUE", help="drafter option (repeatable)"
    )
    p.add_argument("--prompt", required=True, help="prompt text (raw, or a user turn with --chat)")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--gamma", type=int, default=4, help="draft length (fixed, or the policy's start)")
    p.add_argument("--gamma-policy", default="fixed", help="fixed | heuristic | cost (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="target dtype (default: the target's, fp32)")
    p.add_argument(
        "--backend", default="auto", help="target backend: auto | hf | llama (default: %(default)s)"
    )
    p.add_argument(
        "--device", default=None, help="torch device of the target: cpu (default), cuda, cuda:1, ..."
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument(
        "--verify", default="exact", help="verification rule: exact | lenient (lossy) (default: %(default)s)"
    )
    p.add_argument(
        "--verify-option", action="append", metavar="KEY=VALUE", help="rule option, e.g. lenience=0.5"
    )
    p.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    """The ``specdec`` argument parser (``generate`` and ``bench`` subcommands)."""
    parser = argparse.ArgumentParser(
        prog="specdec", description="Speculative decoding with exact verification."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    from specdec.bench import add_arguments

    bench = sub.add_parser("bench", help="benchmark drafters against plain decoding and transformers")
    add_arguments(bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``specdec`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
