"""Fused CPU routing for MoE inference (``csrc/moe_route_cpu.c``): route and sort in one call, gather,
and a combine that reads each expert's output block in place.

Legend: T tokens, E experts, K slots per token (top_k), D model dim, M = T*K slots (dropless).

The general routing path is four ops (``topk_routing``, ``sort_by_expert``, ``permute``,
``unpermute``) of ~15 PyTorch calls. On a CPU at decode and verify sizes (T = 1..16) their dispatch
overhead is about a third of the MoE layer's time; at T = 512 the sorts, the copy of every expert's
output into one ``[M, D]`` buffer and the combine still cost ~0.5 ms. Here:

- :func:`route_sorted_cpu`: scores, top-k, weights and the counting sort by expert, one C call;
- :func:`gather_rows_cpu`: ``x_MD[m] = x_TD[token_of_row_M[m]]``;
- :func:`combine_blocks_cpu`: ``out_TD[t] = sum_k weights_TK[t, k] * y[row of slot t*K+k]``, where the
  rows live in a list of per-expert output blocks (no ``[M, D]`` concatenation).

Semantics are exactly those of the references in ``reference.py`` (``topk_routing_reference``,
``sort_by_expert_reference``, ``permute_reference``, ``unpermute_reference``);
``tests/test_routing_native.py`` checks them against each other. float32 only, forward only (no
autograd): :class:`moe.MoE` uses these when it runs on a CPU without gradients and no backend is
forced (``moe/native_cpu.py`` has the conditions).
:func:`native_routing_available` is False when no C compiler is found; the layer then takes the
general path.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..native import build_library

__all__ = [
    "MAX_EXPERTS",
    "NativeRoute",
    "native_routing_available",
    "route_sorted_cpu",
    "gather_rows_cpu",
    "combine_blocks_cpu",
]

_SOURCE = Path(__file__).parent / "csrc" / "moe_route_cpu.c"
MAX_EXPERTS = 4096  # the C routine's stack buffers
_P = ctypes.c_void_p
_L = ctypes.c_long
_I = ctypes.c_int


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = build_library(_SOURCE)
    except (RuntimeError, OSError):
        return None
    lib.moe_route_topk.argtypes = [_P, _L, _I, _I, _I, _P, _I, ctypes.c_float, _P, _P, _P, _P, _P, _P, _P]
    lib.moe_route_topk.restype = _I
    lib.moe_gather.argtypes = [_P, _P, _L, _L, _P, _I]
    lib.moe_gather.restype = None
    lib.moe_combine.argtypes = [_P, _P, _P, _P, _P, _L, _I, _L, _P, _I]
    lib.moe_combine.restype = None
    return lib


def native_routing_available() -> bool:
    """True when the C routing library builds (or is cached) on this machine."""
    return _library() is not None


@dataclass
class NativeRoute:
    """One routing decision and its expert order (all int64 except weights_TK, float32).

    experts_TK, weights_TK: as ``kernels.topk_routing`` returns them (weights already times ``scale``).
    group_sizes_E, expert_offsets_E: slots per expert and where each expert's rows start.
    sorted_slots_M: the slots in expert order (``kernels.sort_by_expert``'s ``sorted_slots_M``).
    token_of_row_M: ``sorted_slots_M // K``; row_of_slot_S: its inverse permutation (row of slot s).
    """

    experts_TK: Tensor
    weights_TK: Tensor
    group_sizes_E: Tensor
    expert_offsets_E: Tensor
    sorted_slots_M: Tensor
    token_of_row_M: Tensor
    row_of_slot_S: Tensor


def route_sorted_cpu(
    logits_TE: Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    bias_E: Tensor | None = None,
    scale: float = 1.0,
) -> NativeRoute:
    """Top-k routing (see ``topk_routing_reference``) and the counting sort by expert, in one C call.

    logits_TE: contiguous float32 CPU [T, E]; bias_E: optional float32 [E] selection bias.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the native routing library is not available (no C compiler?)")
    if logits_TE.dtype != torch.float32 or logits_TE.dim() != 2 or logits_TE.device.type != "cpu":
        raise ValueError(
            f"logits_TE must be a float32 CPU tensor [T, E], got {logits_TE.dtype} {tuple(logits_TE.shape)} "
            f"on {logits_TE.device}"
        )
    num_tokens, num_experts = logits_TE.shape
    if not 1 <= top_k <= num_experts or num_experts > MAX_EXPERTS:
        raise ValueError(f"top_k must be in [1, E={num_experts}] and E <= {MAX_EXPERTS}, got top_k={top_k}")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if bias_E is not None and (bias_E.dtype != torch.float32 or bias_E.shape != (num_experts,)):
        raise ValueError(f"bias_E must be float32 [{num_experts}], got {bias_E.dtype} {tuple(bias_E.shape)}")
    logits_TE = logits_TE.contiguous()
    num_slots = num_tokens * top_k
    ints = torch.empty(4 * num_slots + 2 * num_experts, dtype=torch.int64)
    experts, sorted_slots, token_of_row, row_of_slot = ints[: 4 * num_slots].view(4, num_slots).unbind(0)
    sizes, offsets = ints[4 * num_slots :].view(2, num_experts).unbind(0)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32)
    rc = lib.moe_route_topk(
        logits_TE.data_ptr(),
        num_tokens,
        num_experts,
        top_k,
        1 if scoring == "sigmoid" else 0,
        None if bias_E is None else bias_E.contiguous().data_ptr(),
        1 if renormalize else 0,
        float(scale),
        experts.data_ptr(),
        weights.data_ptr(),
        sizes.data_ptr(),
        sorted_slots.data_ptr(),
        token_of_row.data_ptr(),
        row_of_slot.data_ptr(),
        offsets.data_ptr(),
    )
    if rc != 0:
        raise RuntimeError(f"moe_route_topk failed ({rc})")
    return NativeRoute(
        experts.view(num_tokens, top_k), weights, sizes, offsets, sorted_slots, token_of_row, row_of_slot
    )


def gather_rows_cpu(x_TD: Tensor, route: NativeRoute) -> Tensor:
    """x_MD[m] = x_TD[route.token_of_row_M[m]] (``permute_reference``); x_TD contiguous float32 CPU."""
    lib = _library()
    num_rows, dim = route.token_of_row_M.numel(), x_TD.shape[1]
    if x_TD.dtype != torch.float32 or not x_TD.is_contiguous() or x_TD.shape[0] != route.weights_TK.shape[0]:
        raise ValueError(
            f"x_TD must be contiguous float32 [T={route.weights_TK.shape[0]}, D], got {x_TD.dtype} "
            f"{tuple(x_TD.shape)}"
        )
    x_MD = torch.empty(num_rows, dim, dtype=torch.float32)
    lib.moe_gather(
        x_TD.data_ptr(),
        route.token_of_row_M.data_ptr(),
        num_rows,
        dim,
        x_MD.data_ptr(),
        torch.get_num_threads(),
    )
    return x_MD


def combine_blocks_cpu(blocks_E: list[Tensor | None], route: NativeRoute, dim: int) -> Tensor:
    """out_TD[t] = sum_k weights_TK[t, k] * (row of slot t*K+k), the row read from its expert's block.

    blocks_E[e] is expert e's output, contiguous float32 [group_sizes_E[e], dim] (None when empty): the
    rows of ``y_MD`` from ``expert_offsets_E[e]`` on (``unpermute_reference`` of their concatenation).
    """
    lib = _library()
    num_experts = route.group_sizes_E.numel()
    if len(blocks_E) != num_experts:
        raise ValueError(f"blocks_E must have one entry per expert ({num_experts}), got {len(blocks_E)}")
    pointers = (ctypes.c_void_p * num_experts)()
    for e, (block, rows) in enumerate(zip(blocks_E, route.group_sizes_E.tolist(), strict=True)):
        if rows == 0:
            continue
        if (
            block is None
            or block.dtype != torch.float32
            or not block.is_contiguous()
            or tuple(block.shape) != (rows, dim)
        ):
            got = None if block is None else f"{block.dtype} {tuple(block.shape)}"
            raise ValueError(f"blocks_E[{e}] must be contiguous float32 [{rows}, {dim}], got {got}")
        pointers[e] = block.data_ptr()
    num_tokens, top_k = route.weights_TK.shape
    out_TD = torch.empty(num_tokens, dim, dtype=torch.float32)
    lib.moe_combine(
        pointers,
        route.expert_offsets_E.data_ptr(),
        route.experts_TK.data_ptr(),
        route.row_of_slot_S.data_ptr(),
        route.weights_TK.data_ptr(),
        num_tokens,
        top_k,
        dim,
        out_TD.data_ptr(),
        torch.get_num_threads(),
    )
    return out_TD
