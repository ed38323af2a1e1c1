"""A communication MODEL of expert-parallel all-to-all: bytes by counting, times from assumed bandwidths.

Legend: T tokens per rank, D hidden size, H expert hidden size, k experts per token (top-k), E routed
experts, R expert-parallel degree (ranks = GPUs), G GPUs per node, N = R/G nodes, L = E/R experts per
rank, M nodes a token may use (DeepSeek-V3's node-limited routing, arXiv 2412.19437 §2.1.2).

Nothing here is measured. It is the arithmetic behind the tables of DeepEP (github.com/deepseek-ai/DeepEP,
"Dispatch/Combine #EP, bottleneck bandwidth") and of MegaBlocks-style all-to-all (arXiv 2211.15841):

Bytes of one token row sent in a dispatch or combine:
    bf16: 2·D.   fp8 (DeepSeek-V3 / DeepEP): D bytes + one fp32 scale per 128 channels, D + 4·⌈D/128⌉.

Copies of a row per token and per dispatch, by link, under routing that treats all ranks alike (uniform
top-k, or uniform node-limited), so every rank is the destination of a copy with the same probability:
  - "slot" (moe.parallel, torchtitan, MegaBlocks with expert parallelism): one row per (token, expert)
    slot, straight to the owner rank. Of the k rows, k/R stay on the rank, k·(G'−1)/R cross NVLink
    (G' = min(G, R)) and k·(R−G')/R cross nodes (RDMA).
  - "node-dedup" (DeepEP normal kernels): a token crosses to each remote node that hosts one of its
    experts once, over RDMA to the GPU with the sender's local index, which forwards it over NVLink to the
    other GPUs of that node that need it; on its own node the sender uses NVLink directly. With
    n_nodes = E[distinct nodes touched] and n_ranks = E[distinct ranks touched]:
        RDMA copies   = n_nodes · (N−1)/N
        NVLink copies = n_ranks · (R−N)/R   (every touched rank except the sender and the N−1 landing GPUs)
    where, drawing k distinct experts uniformly from the P = E·M/N experts of the M allowed nodes,
        n_nodes = M · (1 − C(P − E/N, k) / C(P, k)),   n_ranks = M·G · (1 − C(P − L, k) / C(P, k)).
The combine moves the same copies back (bf16; DeepEP reduces within a node before RDMA), so it has the
dispatch's copy counts with bf16 rows.

Time of one all-to-all on a GPU: the NVLink and RDMA transfers run concurrently, so
    t = max(nvlink_bytes / nvlink_bw, rdma_bytes / rdma_bw) + latency,
with per-GPU unidirectional bandwidths (DeepEP measures against ~160 GB/s NVLink on H800 and ~50 GB/s per
400 Gb/s CX7 NIC). Expert compute per rank (balanced: T·k rows per rank): 6·D·H·T·k FLOPs for SwiGLU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "DEEPEP_LOW_LATENCY",
    "DTYPES",
    "SCHEMES",
    "Traffic",
    "expert_flops",
    "measure_traffic",
    "node_dedup_traffic",
    "row_bytes",
    "simulate_routing",
    "slot_traffic",
    "traffic",
    "transfer_time_s",
]

DTYPES = ("bf16", "fp8")
SCHEMES = ("slot", "node-dedup")

# DeepEP V1 low-latency kernels (docs/legacy.md of github.com/deepseek-ai/DeepEP): H800 + CX7 400 Gb/s,
# 128 tokens per batch, hidden 7168, top-8, FP8 dispatch, BF16 combine, pure RDMA.
# EP degree -> (dispatch latency us, dispatch GB/s, combine latency us, combine GB/s), as published.
DEEPEP_LOW_LATENCY: dict[int, tuple[float, float, float, float]] = {
    8: (77, 98, 114, 127),
    16: (118, 63, 195, 74),
    32: (155, 48, 273, 53),
    64: (173, 43, 314, 46),
    128: (192, 39, 369, 39),
    256: (194, 39, 360, 40),
}


def row_bytes(hidden: int, dtype: str) -> int:
    """Bytes of one token row: bf16 2·D; fp8 D + 4·⌈D/128⌉ (fp32 scale per 128 channels)."""
    if not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"hidden must be an int >= 1, got {hidden!r}")
    if dtype == "bf16":
        return 2 * hidden
    if dtype == "fp8":
        return hidden + 4 * math.ceil(hidden / 128)
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


@dataclass(frozen=True)
class Traffic:
    """Expected copies of one token's row per dispatch: kept on the rank, over NVLink, over RDMA."""

    local: float
    nvlink: float
    rdma: float

    @property
    def sent(self) -> float:
        """Copies that leave the GPU."""
        return self.nvlink + self.rdma

    @property
    def cross_node_fraction(self) -> float:
        """Share of the copies leaving the GPU that cross nodes."""
        return self.rdma / self.sent if self.sent else 0.0


def _check_topology(num_experts: int, top_k: int, ep_degree: int, gpus_per_node: int) -> tuple[int, int]:
    """(G' = GPUs per node actually used, N = nodes); ValueError naming the argument otherwise."""
    for name, value in (("num_experts", num_experts), ("top_k", top_k), ("ep_degree", ep_degree)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be an int >= 1, got {gpus_per_node!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k must be <= num_experts={num_experts}, got {top_k}")
    if num_experts % ep_degree:
        raise ValueError(f"num_experts={num_experts} must be divisible by ep_degree={ep_degree}")
    per_node = min(gpus_per_node, ep_degree)
    if ep_degree % per_node:
        raise ValueError(f"ep_degree={ep_degree} must be a multiple of gpus_per_node={gpus_per_node}")
    return per_node, ep_degree // per_node


def slot_traffic(num_experts: int, top_k: int, ep_degree: int, gpus_per_node: int) -> Traffic:
    """One row per routed slot, straight to the owner rank (module docstring)."""
    per_node, _ = _check_topology(num_experts, top_k, ep_degree, gpus_per_node)
    r = ep_degree
    return Traffic(local=top_k / r, nvlink=top_k * (per_node - 1) / r, rdma=top_k * (r - per_node) / r)


def _miss(pool: int, group: int, top_k: int) -> float:
    """P(none of top_k distinct experts drawn uniformly from `pool` falls in a given `group` of them)."""
    return math.comb(pool - group, top_k) / math.comb(pool, top_k)


def node_dedup_traffic(
    num_experts: int, top_k: int, ep_degree: int, gpus_per_node: int, max_nodes: int | None = None
) -> Traffic:
    """DeepEP-style: RDMA once per remote node touched, NVLink forwarding inside nodes (module docstring)."""
    per_node, nodes = _check_topology(num_experts, top_k, ep_degree, gpus_per_node)
    if max_nodes is not None and (not isinstance(max_nodes, int) or max_nodes < 1):
        raise ValueError(f"max_nodes must be None or an int >= 1, got {max_nodes!r}")
    allowed = nodes if max_nodes is None else min(max_nodes, nodes)
    pool = num_experts * allowed // nodes
    if top_k > pool:
        raise ValueError(f"top_k={top_k} exceeds the {pool} experts of max_nodes={max_nodes} nodes")
    n_nodes = allowed * (1 - _miss(pool, num_experts // nodes, top_k))
    n_ranks = allowed * per_node * (1 - _miss(pool, num_experts // ep_degree, top_k))
    r = ep_degree
    return Traffic(local=n_ranks / r, nvlink=n_ranks * (r - nodes) / r, rdma=n_nodes * (nodes - 1) / nodes)


def traffic(
    scheme: str,
    num_experts: int,
    top_k: int,
    ep_degree: int,
    gpus_per_node: int,
    max_nodes: int | None = None,
) -> Traffic:
    """Copies per token for `scheme` ("slot" or "node-dedup"; max_nodes only affects node-dedup)."""
    if scheme == "slot":
        return slot_traffic(num_experts, top_k, ep_degree, gpus_per_node)
    if scheme == "node-dedup":
        return node_dedup_traffic(num_experts, top_k, ep_degree, gpus_per_node, max_nodes)
    raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")


def transfer_time_s(
    copies: Traffic,
    bytes_per_row: int,
    tokens: int,
    nvlink_gbps: float,
    rdma_gbps: float,
    latency_us: float = 0.0,
) -> float:
    """max(NVLink bytes / NVLink GB/s, RDMA bytes / RDMA GB/s) + latency, for `tokens` tokens of one GPU."""
    nvlink_s = copies.nvlink * bytes_per_row * tokens / (nvlink_gbps * 1e9)
    rdma_s = copies.rdma * bytes_per_row * tokens / (rdma_gbps * 1e9)
    return max(nvlink_s, rdma_s) + latency_us * 1e-6


def expert_flops(tokens: int, top_k: int, hidden: int, expert_hidden: int) -> float:
    """SwiGLU FLOPs of T·k expert rows: 6·D·H each (three D×H matmuls, 2 FLOPs per multiply-add)."""
    return 6.0 * hidden * expert_hidden * tokens * top_k


# --------------------------------------------------------------------------- Monte-Carlo check
def simulate_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    nodes: int,
    max_nodes: int | None,
    generator: torch.Generator,
) -> torch.Tensor:
    """experts_TK: k distinct experts per token, uniform over all experts or over `max_nodes` random nodes."""
    scores_TE = torch.rand(num_tokens, num_experts, generator=generator)
    if max_nodes is not None and max_nodes < nodes:
        node_scores_TN = torch.rand(num_tokens, nodes, generator=generator)
        chosen_TM = node_scores_TN.topk(max_nodes, dim=1).indices
        allowed_TN = torch.zeros(num_tokens, nodes, dtype=torch.bool).scatter_(1, chosen_TM, True)
        allowed_TE = allowed_TN.repeat_interleave(num_experts // nodes, dim=1)
        scores_TE = scores_TE.masked_fill(~allowed_TE, -1.0)
    return scores_TE.topk(top_k, dim=1).indices


def measure_traffic(
    scheme: str,
    experts_TK: torch.Tensor,
    source_T: torch.Tensor,
    num_experts: int,
    ep_degree: int,
    gpus_per_node: int,
) -> Traffic:
    """Mean copies per token counted from explicit routing (experts_TK) and source ranks (source_T)."""
    per_node, nodes = _check_topology(num_experts, experts_TK.shape[1], ep_degree, gpus_per_node)
    dest_TK = experts_TK // (num_experts // ep_degree)
    src_T1 = source_T.unsqueeze(1)
    same_node_TK = dest_TK // per_node == src_T1 // per_node
    if scheme == "slot":
        local = (dest_TK == src_T1).sum(1)
        nvlink = (same_node_TK & (dest_TK != src_T1)).sum(1)
        rdma = (~same_node_TK).sum(1)
    elif scheme == "node-dedup":
        touched_TR = torch.zeros(dest_TK.shape[0], ep_degree, dtype=torch.bool).scatter_(1, dest_TK, True)
        touched_TNG = touched_TR.view(-1, nodes, per_node)
        node_touched_TN = touched_TNG.any(dim=2)
        src_node_T = source_T // per_node
        remote_TN = torch.ones_like(node_touched_TN).scatter_(1, src_node_T.unsqueeze(1), False)
        rdma = (node_touched_TN & remote_TN).sum(1)
        # NVLink: touched ranks other than the sender and the RDMA landing GPU (same local index) of each node
        landing_TNG = torch.zeros_like(touched_TNG)
        landing_TNG[:, :, :] = (torch.arange(per_node) == (source_T % per_node).unsqueeze(1)).unsqueeze(1)
        direct_TR = landing_TNG.view(-1, ep_degree)  # sender and landing GPUs: reached without NVLink
        local = touched_TR.gather(1, source_T.unsqueeze(1)).squeeze(1).long()
        nvlink = (touched_TR & ~direct_TR).sum(1)
    else:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    mean = lambda t: float(t.double().mean())  # noqa: E731
    return Traffic(local=mean(local), nvlink=mean(nvlink), rdma=mean(rdma))
