"""Routing ops for MoE layers: fused top-k routing, sort by expert, permute and unpermute."""

from .native import (
    MAX_EXPERTS,
    NativeRoute,
    combine_blocks_cpu,
    gather_rows_cpu,
    native_routing_available,
    route_sorted_cpu,
)
from .op import ROUTING_BACKENDS, ExpertSort, RoutingBackend, permute, sort_by_expert, topk_routing, unpermute

__all__ = [
    "MAX_EXPERTS",
    "NativeRoute",
    "combine_blocks_cpu",
    "gather_rows_cpu",
    "native_routing_available",
    "route_sorted_cpu",
    "ROUTING_BACKENDS",
    "ExpertSort",
    "RoutingBackend",
    "permute",
    "sort_by_expert",
    "topk_routing",
    "unpermute",
]
