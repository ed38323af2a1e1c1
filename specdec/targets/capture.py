"""Capturing decoder layers' outputs (EAGLE-3 heads fuse low, middle and last-layer features).

Shared by the targets' ``capture_layers`` and the drafter-data extractor: one rule for which layer
indices are valid, and one reading of a ``transformers`` decoder layer's forward-hook output.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["check_layer_indices", "layer_output"]


def check_layer_indices(layers: Iterable[int], num_layers: int) -> tuple[int, ...]:
    """``layers`` as a tuple, or ``ValueError`` unless each is an int decoder index in ``[0, num_layers)``."""
    layers = tuple(layers)
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in layers):
        raise ValueError(f"layers must be decoder layer indices in [0, {num_layers}), got {layers}")
    return layers


def layer_output(output) -> torch.Tensor:
    """A decoder layer's hidden states from its forward output (a tensor, or a tuple led by one in
    older ``transformers`` versions)."""
    return output[0] if isinstance(output, tuple) else output
