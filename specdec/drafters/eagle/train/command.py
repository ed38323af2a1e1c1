"""``specdec train-head``: train an EAGLE draft head for a target (:func:`.loop.train`).

    specdec train-head [--steps N] [--out specdec/weights/eagle-smollm2-135m.safetensors]
    specdec train-head --target /path/to/llama-checkpoint   # any Llama-family target
    specdec train-head --compat speculators                 # a head vLLM and SGLang can run

One option per :class:`.config.TrainConfig` field (:mod:`.options`), plus where to write the head,
the cache and the checkpoints. ``python -m experiments train-drafter`` is an alias of this command.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from specdec.cli_args import ArgumentParser
from specdec.drafters.eagle.train.config import TrainConfig
from specdec.drafters.eagle.train.options import add_config_arguments, config_from_args

__all__ = ["add_train_head", "cmd_train_head", "main"]

DESCRIPTION = "Train the EAGLE draft head for a target on its own features, on the CPU."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's options: output paths, ``--no-eval``, and one per :class:`TrainConfig` field."""
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to save the head (default specdec/weights/eagle-<target>.safetensors, the target's "
        "built-in name or its checkpoint folder's name and hash)",
    )
    p.add_argument(
        "--data-root", type=Path, default=None, help="feature cache root (default ~/.cache/specdec)"
    )
    p.add_argument("--work", type=Path, default=None, help="checkpoint directory (default inside the cache)")
    p.add_argument("--no-eval", action="store_true", help="skip held-out speculative decoding")
    add_config_arguments(p, TrainConfig)


def add_train_head(sub: argparse._SubParsersAction) -> None:
    """Register ``train-head`` on the ``specdec`` parser's subcommands."""
    p = sub.add_parser("train-head", help="train an EAGLE draft head for a target", description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=cmd_train_head)


def cmd_train_head(args: argparse.Namespace) -> int:
    """Build (or reuse) the data cache, train, save the head; progress lines go to stderr."""
    from specdec.drafters.eagle.train.dataset import target_cache_name
    from specdec.drafters.eagle.train.loop import train

    cfg = config_from_args(TrainConfig, args)
    out = args.out or Path("specdec/weights") / f"eagle-{target_cache_name(cfg.data.target)}.safetensors"
    train(
        cfg,
        out=out,
        work=args.work,
        data_root=args.data_root,
        evaluate=not args.no_eval,
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``specdec train-head`` on its own (``python -m experiments train-drafter`` calls this); a bad
    config value raises ``ValueError``."""
    p = ArgumentParser(prog="specdec train-head", description=DESCRIPTION)
    add_arguments(p)
    return cmd_train_head(p.parse_args(argv))
