"""MoE kernels: routing ops and grouped GEMM, each with a plain-PyTorch reference and a Triton kernel.

Legend: T tokens, E experts, K experts per token (top_k) -- or, for grouped_gemm, the input features --
D model dim, M token slots in expert order (T*top_k), N output features.

Public API (all differentiable where it makes sense, all registered as torch.library custom ops under
the namespace `specdec_kernels` so torch.compile can trace them):

    grouped_gemm(x_MK, w_EKN, group_sizes_E, backend=None) -> y_MN
        y[rows of group e] = x[rows of group e] @ w_EKN[e]; gradients for x and w (dX, dW).
    topk_routing(logits_TE, top_k, *, scoring="softmax", renormalize=False, bias_E=None, backend=None)
        -> (weights_TK float32, experts_TK int64)
    sort_by_expert(experts_TK, num_experts, *, backend=None)
        -> ExpertSort(sorted_slots_M, group_sizes_E, expert_offsets_E1)
    permute(x_TD, sorted_slots_M, top_k, *, backend=None) -> x_MD
    unpermute(y_MD, sorted_slots_M, weights_TK, *, backend=None) -> out_TD

A typical dropless MoE forward (SwiGLU experts; w1/w3: [E, D, F], w2: [E, F, D]):

    weights_TK, experts_TK = topk_routing(router_logits_TE, top_k, renormalize=True)
    slots_M, group_sizes_E, _ = sort_by_expert(experts_TK, num_experts)
    x_MD = permute(x_TD, slots_M, top_k)
    h_MF = silu(grouped_gemm(x_MD, w1_EDF, group_sizes_E)) * grouped_gemm(x_MD, w3_EDF, group_sizes_E)
    out_TD = unpermute(grouped_gemm(h_MF, w2_EFD, group_sizes_E), slots_M, weights_TK)

Backends: "torch" (plain PyTorch), "onednn" (grouped GEMM only: CPU float32 on oneDNN-packed weights,
the CPU fast path) and "triton" (needs CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).
backend=None picks Triton on CUDA when triton is installed, oneDNN for float32 grouped GEMMs on CPU,
torch elsewhere. grouped_swiglu(x_MD, w_gate_up_EDN, w_down_EHD, group_sizes_E, backend=None) runs
whole SwiGLU experts: expert by expert on oneDNN without autograd on CPU (grouped_swiglu_onednn),
two grouped GEMMs otherwise.
CPU inference without gradients has a fused native path (kernels/routing/native.py, C compiled once
per machine): route_sorted_cpu (top-k routing and the sort by expert in one call), gather_rows_cpu,
and combine_blocks_cpu, which combines per-expert output blocks (swiglu_blocks_onednn) in place.
The environment variables SPECDEC_GROUPED_GEMM_BACKEND and SPECDEC_ROUTING_BACKEND, when set, override
the choice for grouped_gemm and for the routing ops. SPECDEC_TRITON_TMA=0 switches the Triton grouped
GEMM's TMA-descriptor loads off, SPECDEC_TRITON_AUTOTUNE=0 its autotuning (first fitting config is used).
More backends register in GROUPED_GEMM_BACKENDS / ROUTING_BACKENDS. ``Registry`` (kernels/registry.py) is
the project's one plugin registry class, which ``specdec`` and ``moe`` build their registries on.
Triton is imported lazily, only when a Triton backend runs, so `import kernels` works without it.
Plain-PyTorch references live in kernels/*/reference.py; docs/kernels.md has the design notes.
"""

from ._backends import BackendRegistry, eager_direct_call, triton_available
from .grouped_gemm import (
    GROUPED_GEMM_BACKENDS,
    GroupedGemmBackend,
    clear_packed_weights,
    grouped_gemm,
    grouped_swiglu,
    grouped_swiglu_onednn,
    onednn_available,
    swiglu_blocks_onednn,
    triton_autotune_choices,
)
from .registry import Registry
from .routing import (
    ROUTING_BACKENDS,
    ExpertSort,
    NativeRoute,
    RoutingBackend,
    combine_blocks_cpu,
    gather_rows_cpu,
    native_routing_available,
    permute,
    route_sorted_cpu,
    sort_by_expert,
    topk_routing,
    unpermute,
)

__all__ = [
    "GROUPED_GEMM_BACKENDS",
    "ROUTING_BACKENDS",
    "BackendRegistry",
    "Registry",
    "ExpertSort",
    "GroupedGemmBackend",
    "NativeRoute",
    "RoutingBackend",
    "clear_packed_weights",
    "combine_blocks_cpu",
    "eager_direct_call",
    "gather_rows_cpu",
    "grouped_gemm",
    "grouped_swiglu",
    "grouped_swiglu_onednn",
    "native_routing_available",
    "onednn_available",
    "permute",
    "route_sorted_cpu",
    "sort_by_expert",
    "swiglu_blocks_onednn",
    "topk_routing",
    "triton_autotune_choices",
    "triton_available",
    "unpermute",
]
