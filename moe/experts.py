"""SwiGLU experts: E routed experts stored stacked (grouped GEMM), and the dense shared experts.

Legend: M token slots in expert order, T tokens, D model dim, H expert hidden dim, E experts.

Each expert is SwiGLU (Shazeer, arXiv:2002.05202): y = (silu(x W_gate) * (x W_up)) W_down. The routed
experts keep their weights as stacked tensors, w_gate_up [E, D, 2H] (gate in the first H columns, up in the
last H: one fused GEMM) and w_down [E, H, D], so that expert parallelism shards them by slicing dim 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kernels


def swiglu(h_MN: Tensor, hidden_dim: int) -> Tensor:
    """silu(gate) * up for h = [gate | up] along the last dim."""
    gate, up = h_MN[..., :hidden_dim], h_MN[..., hidden_dim:]
    if torch.is_grad_enabled() and h_MN.requires_grad:
        return F.silu(gate) * up
    return F.silu(gate).mul_(up)  # no autograd: reuse the silu buffer


class SwiGLUExperts(nn.Module):
    """E SwiGLU experts over expert-sorted rows, computed with kernels.grouped_gemm.

    Parameters: w_gate_up [E, D, 2H], w_down [E, H, D].
    """

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden_dim: int,
        *,
        backend: str | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.dim, self.hidden_dim = num_experts, dim, hidden_dim
        self.backend = backend
        self.w_gate_up = nn.Parameter(
            torch.empty(num_experts, dim, 2 * hidden_dim, device=device, dtype=dtype)
        )
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default bounds, per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        nn.init.uniform_(self.w_gate_up, -1 / math.sqrt(self.dim), 1 / math.sqrt(self.dim))
        nn.init.uniform_(self.w_down, -1 / math.sqrt(self.hidden_dim), 1 / math.sqrt(self.hidden_dim))

    def forward(self, x_MD: Tensor, group_sizes_E: Tensor) -> Tensor:
        """y_MD for rows of x_MD grouped by expert (group_sizes_E rows each, in expert order).

        kernels.grouped_swiglu: on CPU in float32 without autograd, expert by expert on oneDNN;
        otherwise two grouped GEMMs around the SwiGLU.
        """
        return kernels.grouped_swiglu(x_MD, self.w_gate_up, self.w_down, group_sizes_E, backend=self.backend)

    def expert(self, e: int, x_TD: Tensor) -> Tensor:
        """Plain-PyTorch expert e applied to x_TD (the reference the grouped path is tested against)."""
        h = x_TD @ self.w_gate_up[e]
        return (F.silu(h[:, : self.hidden_dim]) * h[:, self.hidden_dim :]) @ self.w_down[e]

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, dim={self.dim}, hidden_dim={self.hidden_dim}"


class SharedExperts(nn.Module):
    """Always-active experts, fused into one dense SwiGLU of hidden size Hs, with an optional sigmoid gate.

    n shared SwiGLU experts summed equal one SwiGLU whose hidden units are their concatenation, which is
    how DeepSeek-MoE (arXiv:2401.06066) and Qwen2-MoE store them. With `gated`, the output is scaled per
    token by sigmoid(x . output_gate) (Qwen2-MoE's shared_expert_gate).

    Parameters: w_gate_up [D, 2Hs], w_down [Hs, D], output_gate [1, D] (when gated).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        *,
        gated: bool = False,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dim, self.hidden_dim = dim, hidden_dim
        self.w_gate_up = nn.Parameter(torch.empty(dim, 2 * hidden_dim, device=device, dtype=dtype))
        self.w_down = nn.Parameter(torch.empty(hidden_dim, dim, device=device, dtype=dtype))
        self.output_gate = nn.Parameter(torch.empty(1, dim, device=device, dtype=dtype)) if gated else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default bounds."""
        nn.init.uniform_(self.w_gate_up, -1 / math.sqrt(self.dim), 1 / math.sqrt(self.dim))
        nn.init.uniform_(self.w_down, -1 / math.sqrt(self.hidden_dim), 1 / math.sqrt(self.hidden_dim))
        if self.output_gate is not None:
            nn.init.uniform_(self.output_gate, -1 / math.sqrt(self.dim), 1 / math.sqrt(self.dim))

    def forward(self, x_TD: Tensor) -> Tensor:
        """y_TD = SwiGLU(x_TD), times sigmoid(x_TD . output_gate) when gated (oneDNN on CPU in float32
        without autograd, as for the routed experts)."""
        if torch.is_grad_enabled() and (x_TD.requires_grad or self.w_gate_up.requires_grad):
            y_TD = swiglu(x_TD @ self.w_gate_up, self.hidden_dim) @ self.w_down
        else:  # one group: the dense SwiGLU on the inference fast path
            x_2d = x_TD.reshape(-1, self.dim).contiguous()
            sizes = torch.tensor([x_2d.shape[0]])
            y_TD = kernels.grouped_swiglu(x_2d, self.w_gate_up[None], self.w_down[None], sizes).reshape(
                x_TD.shape
            )
        if self.output_gate is not None:
            y_TD = y_TD * torch.sigmoid(F.linear(x_TD, self.output_gate))
        return y_TD

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden_dim={self.hidden_dim}, gated={self.output_gate is not None}"
