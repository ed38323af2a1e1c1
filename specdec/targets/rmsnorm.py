"""RMSNorm (Zhang & Sennrich 2019, arXiv 1910.07467), as Llama applies it: the one norm of the project.

Legend: D model dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["rms_norm", "RMSNorm"]


def rms_norm(x_D: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · x / sqrt(mean(x²) + eps)`` over the last dim, computed in float32."""
    return F.rms_norm(x_D.float(), weight_D.shape, weight_D.float(), eps)


class RMSNorm(torch.nn.Module):
    """:func:`rms_norm` with a fixed (non-trainable) weight: the targets' final norm."""

    def __init__(self, weight_D: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight_D, requires_grad=False)
        self.eps = eps

    def forward(self, x_D: torch.Tensor) -> torch.Tensor:
        return rms_norm(x_D, self.weight, self.eps)
