"""Target models: a generic ``transformers`` adapter and a lean native Llama-family implementation."""

from __future__ import annotations

import json
import os
from typing import Any

from specdec.registry import TARGETS
from specdec.targets.llama_config import NATIVE_FAMILIES
from specdec.targets.loading import resolve_checkpoint

__all__ = ["load_target", "open_target", "open_target_from", "check_device", "DTYPES"]

DTYPES = ("float32", "bfloat16", "float16")
"""Target dtypes by name (``--dtype``)."""


def load_target(name_or_path: str | os.PathLike, *, backend: str = "auto", **options: Any):
    """Load a target by built-in name or local checkpoint.

    ``backend``: ``"auto"`` (native ``llama`` for the families in
    :data:`specdec.targets.llama_config.NATIVE_FAMILIES`, ``hf`` otherwise) or any name in
    :data:`specdec.registry.TARGETS` (``hf``, ``llama``, or a plugin's). ``compile``: a mode of
    :data:`specdec.targets.compiled.COMPILE_MODES` (default ``none``): the native target's decode and
    verify forwards captured per bucket (:func:`specdec.targets.compiled.compile_target`; its PyTorch
    linear backend, ``reference`` unless ``linear_backend`` says otherwise).
    """
    from specdec.targets.compiled import COMPILE_MODES, compile_target

    mode = options.pop("compile", None) or "none"
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
    if backend == "auto":
        path = resolve_checkpoint(name_or_path) / "config.json"
        try:
            model_type = json.loads(path.read_text()).get("model_type")
        except (OSError, json.JSONDecodeError, AttributeError) as err:
            raise ValueError(f"{path}: not a readable checkpoint config.json ({err})") from None
        backend = "llama" if model_type in NATIVE_FAMILIES else "hf"
    if backend == "hf" and options.get("weights") not in (None, "auto", "fp32"):
        raise ValueError(
            f"weights={options['weights']!r} needs the native target (backend 'llama'); 'hf' runs fp32"
        )
    if backend == "hf":
        options.pop("weights", None)
    if mode != "none":
        if backend != "llama":
            raise ValueError(f"compile={mode!r} needs the native target (backend 'llama'), got {backend!r}")
        options.setdefault("linear_backend", "reference")
    return compile_target(TARGETS.get(backend)(name_or_path, **options), mode)


def open_target(
    name: str,
    *,
    backend: str = "auto",
    dtype: str | None = None,
    device: str | None = None,
    weights: str | None = None,
    compile: str | None = None,
):
    """:func:`load_target` with the command line's string options: ``dtype`` a name in
    :data:`DTYPES` (the compute dtype: activations, KV cache, float weights; None: the weights
    format's own), ``device`` a torch device (``cpu``, ``cuda:0``), ``weights`` a format of
    :data:`specdec.targets.llama_weights.WEIGHT_MODES` (native target only), ``compile`` a mode of
    :data:`specdec.targets.compiled.COMPILE_MODES`; ``ValueError`` naming a
    bad one, or a combination the native target does not run (:mod:`specdec.targets.placement`)."""
    import torch

    options: dict[str, Any] = {"compile": compile}
    if weights is not None:
        options["weights"] = weights
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        options["dtype"] = getattr(torch, dtype)
    if device is not None:
        options["device"] = check_device(device)
    return load_target(name, backend=backend, **options)


def open_target_from(options: Any):
    """:func:`open_target` with the options an object carries as attributes (``target``,
    ``backend``, ``dtype``, ``device``, ``weights``, ``compile``): the arguments that
    :func:`specdec.cli_args.add_engine_arguments` parses, or a config with the same fields."""
    return open_target(
        options.target,
        backend=options.backend,
        dtype=options.dtype,
        device=options.device,
        weights=options.weights,
        compile=options.compile,
    )


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
