"""``specdec export-head``: write an EAGLE-3 head file in vLLM's speculators or SGLang's format.

    specdec export-head HEAD --format speculators|sglang --out DIR [--verifier ID_OR_DIR] [--dtype bfloat16]

``HEAD`` is a head file (a path, or the name of a file shipped in ``specdec/weights/``) in the
``"eagle3"`` layout (``specdec train-head --compat speculators``); a head that the
format cannot express is refused with the reasons (:func:`specdec.drafters.eagle.formats.unexportable`).
"""

from __future__ import annotations

import argparse

__all__ = ["add_export_head"]

_DTYPES = ("bfloat16", "float16", "float32")


def cmd_export_head(args: argparse.Namespace) -> int:
    import torch

    from specdec.drafters.eagle.formats import check_output_dir, export_head_file

    check_output_dir(args.out, "--out")  # before reading the head, so the error names the flag
    out = export_head_file(
        args.head, args.format, args.out, dtype=getattr(torch, args.dtype), verifier=args.verifier
    )
    print(f"wrote {args.format} head: {out / 'config.json'}, {out / 'model.safetensors'}")
    return 0


def add_export_head(sub: argparse._SubParsersAction) -> None:
    """Register ``export-head`` on the ``specdec`` parser's subcommands."""
    from specdec.drafters.eagle.formats import FORMATS

    p = sub.add_parser("export-head", help="export an EAGLE-3 head to vLLM's speculators or SGLang's format")
    p.add_argument("head", help="head file (path, or a file name shipped in specdec/weights/)")
    p.add_argument("--format", required=True, choices=FORMATS, help="speculators (vLLM) or sglang")
    p.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    p.add_argument(
        "--verifier",
        default=None,
        help="the target's Hugging Face id or local directory, recorded as the verifier (speculators format)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=_DTYPES, help="weight dtype (default: %(default)s)")
    p.set_defaults(func=cmd_export_head)
