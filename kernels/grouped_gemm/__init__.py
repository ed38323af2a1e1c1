"""Grouped GEMM over expert-sorted rows: reference, torch/oneDNN backends, Triton kernels, the custom op."""

from .onednn_backend import (
    clear_packed_weights,
    grouped_swiglu_onednn,
    onednn_available,
    swiglu_blocks_onednn,
)
from .op import (
    GROUPED_GEMM_BACKENDS,
    GroupedGemmBackend,
    grouped_gemm,
    select_backend,
    triton_autotune_choices,
)
from .reference import grouped_gemm_reference, grouped_gemm_weight_grad_reference
from .swiglu import grouped_swiglu

__all__ = [
    "GROUPED_GEMM_BACKENDS",
    "GroupedGemmBackend",
    "clear_packed_weights",
    "grouped_gemm",
    "grouped_swiglu",
    "grouped_swiglu_onednn",
    "onednn_available",
    "select_backend",
    "swiglu_blocks_onednn",
    "grouped_gemm_reference",
    "grouped_gemm_weight_grad_reference",
    "triton_autotune_choices",
]
