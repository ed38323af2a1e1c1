"""Routing ops for MoE layers: fused top-k routing, sort by expert, permute and unpermute."""

from .op import ROUTING_BACKENDS, ExpertSort, RoutingBackend, permute, sort_by_expert, topk_routing, unpermute

__all__ = [
    "ROUTING_BACKENDS",
    "ExpertSort",
    "RoutingBackend",
    "permute",
    "sort_by_expert",
    "topk_routing",
    "unpermute",
]
