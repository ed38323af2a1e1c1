"""Grouped GEMM over expert-sorted rows: reference, torch backend, Triton kernels and the custom op."""

from .op import GROUPED_GEMM_BACKENDS, GroupedGemmBackend, grouped_gemm, triton_autotune_choices
from .reference import grouped_gemm_reference, grouped_gemm_weight_grad_reference

__all__ = [
    "GROUPED_GEMM_BACKENDS",
    "GroupedGemmBackend",
    "grouped_gemm",
    "grouped_gemm_reference",
    "grouped_gemm_weight_grad_reference",
    "triton_autotune_choices",
]
