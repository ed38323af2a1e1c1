"""``ep-scaling-model``: a MODEL of expert-parallel all-to-all bytes and time for EP degree 8 to 64.

Not a measurement: bytes are counted (:mod:`experiments.theory.ep_scaling`), times are bytes divided by
assumed link bandwidths, compute is FLOPs divided by an assumed throughput. The setting follows the DeepEP
tables (DeepSeek-V3 shapes: 4096 tokens per rank, hidden 7168, top-8 of 256 experts, FP8 or BF16
dispatch, BF16 combine, 8 GPUs per node, ~160 GB/s NVLink and ~50 GB/s RDMA per GPU), for two schemes:
``slot`` (one row per routed slot, what ``moe.parallel`` does) and ``node-dedup`` (DeepEP normal kernels
with DeepSeek-V3's node-limited routing, at most 4 nodes per token).

Two checks keep the model honest: each run also routes random tokens and counts the copies explicitly
(Monte-Carlo against the closed forms), and ``deepep-check`` divides our byte count for DeepEP's published
low-latency setting by their published latencies, to compare with their published bandwidths.

Legend: T tokens, K experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from experiments.config import validate_config
from experiments.experiment import Experiment
from experiments.runner import RunContext
from experiments.store import RunRecord
from experiments.sweep import Sweep
from experiments.theory.ep_scaling import (
    DEEPEP_LOW_LATENCY,
    DTYPES,
    SCHEMES,
    expert_flops,
    measure_traffic,
    row_bytes,
    simulate_routing,
    traffic,
    transfer_time_s,
)
from specdec.summary import Figure, Summary, Table, series_from_points, table_from_rows

__all__ = ["EPScalingConfig", "DeepEPCheckConfig", "plan", "run_ep_scaling", "run_deepep_check", "EXPERIMENT"]


@dataclass(frozen=True, kw_only=True)
class EPScalingConfig:
    """One EP degree, scheme and dispatch dtype; the rest is the assumed hardware and model shape."""

    ep_degree: int
    scheme: str = "slot"
    dispatch_dtype: str = "fp8"
    combine_dtype: str = "bf16"
    gpus_per_node: int = 8
    tokens_per_rank: int = 4096
    hidden: int = 7168
    expert_hidden: int = 2048
    num_experts: int = 256
    top_k: int = 8
    max_nodes: int | None = 4
    nvlink_gbps: float = 160.0
    rdma_gbps: float = 50.0
    latency_us: float = 0.0
    gpu_tflops: float = 989.0
    mfu: float = 0.5
    mc_tokens: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        validate_config(self)
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
        for name in ("dispatch_dtype", "combine_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {DTYPES}, got {getattr(self, name)!r}")
        for name in ("nvlink_gbps", "rdma_gbps", "gpu_tflops", "mfu", "tokens_per_rank", "mc_tokens"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        traffic(self.scheme, self.num_experts, self.top_k, self.ep_degree, self.gpus_per_node, self.max_nodes)


@dataclass(frozen=True, kw_only=True)
class DeepEPCheckConfig:
    """DeepEP's published low-latency setting at one EP degree (slot counting: every copy, pure RDMA)."""

    ep_degree: int
    tokens_per_rank: int = 128
    hidden: int = 7168
    top_k: int = 8

    def __post_init__(self) -> None:
        validate_config(self)
        if self.ep_degree not in DEEPEP_LOW_LATENCY:
            raise ValueError(f"ep_degree must be one of {sorted(DEEPEP_LOW_LATENCY)}, got {self.ep_degree}")


def plan(*, smoke: bool = False) -> list[Sweep]:
    """EP 8-64 x scheme x dispatch dtype; and the DeepEP byte-count check."""
    base = EPScalingConfig(ep_degree=8, mc_tokens=1024 if smoke else 8192)
    scaling = Sweep(
        base,
        {
            "ep_degree": [8, 16] if smoke else [8, 16, 32, 64],
            "scheme": list(SCHEMES),
            "dispatch_dtype": ["fp8"] if smoke else list(DTYPES),
        },
    )
    check = Sweep(
        DeepEPCheckConfig(ep_degree=8), {"ep_degree": [8, 64] if smoke else sorted(DEEPEP_LOW_LATENCY)}
    )
    return [scaling, check]


def run_ep_scaling(config: EPScalingConfig, ctx: RunContext) -> dict:
    """Closed-form copies, bytes and times; plus a Monte-Carlo count of the copies."""
    c = config
    model = traffic(c.scheme, c.num_experts, c.top_k, c.ep_degree, c.gpus_per_node, c.max_nodes)
    per_node = min(c.gpus_per_node, c.ep_degree)
    nodes = c.ep_degree // per_node
    generator = torch.Generator().manual_seed(c.seed)
    experts_TK = simulate_routing(
        c.mc_tokens,
        c.num_experts,
        c.top_k,
        nodes,
        c.max_nodes if c.scheme == "node-dedup" else None,
        generator,
    )
    source_T = torch.randint(0, c.ep_degree, (c.mc_tokens,), generator=generator)
    counted = measure_traffic(c.scheme, experts_TK, source_T, c.num_experts, c.ep_degree, c.gpus_per_node)
    dispatch_row, combine_row = row_bytes(c.hidden, c.dispatch_dtype), row_bytes(c.hidden, c.combine_dtype)
    args = (c.tokens_per_rank, c.nvlink_gbps, c.rdma_gbps, c.latency_us)
    dispatch_s = transfer_time_s(model, dispatch_row, *args)
    combine_s = transfer_time_s(model, combine_row, *args)
    expert_s = expert_flops(c.tokens_per_rank, c.top_k, c.hidden, c.expert_hidden) / (
        c.gpu_tflops * 1e12 * c.mfu
    )
    layer_s = dispatch_s + expert_s + combine_s
    result = {
        "nodes": nodes,
        "copies_local": model.local,
        "copies_nvlink": model.nvlink,
        "copies_rdma": model.rdma,
        "counted_nvlink": counted.nvlink,
        "counted_rdma": counted.rdma,
        "counted_over_model": counted.sent / model.sent if model.sent else 1.0,
        "dispatch_row_bytes": dispatch_row,
        "combine_row_bytes": combine_row,
        "dispatch_bytes_per_token": model.sent * dispatch_row,
        "combine_bytes_per_token": model.sent * combine_row,
        "rdma_bytes_per_token": model.rdma * (dispatch_row + combine_row),
        "cross_node_fraction": model.cross_node_fraction,
        "dispatch_ms": dispatch_s * 1e3,
        "combine_ms": combine_s * 1e3,
        "expert_ms": expert_s * 1e3,
        "layer_ms": layer_s * 1e3,
        "comm_share": (dispatch_s + combine_s) / layer_s,
    }
    ctx.log(result, step=0)
    return result


def run_deepep_check(config: DeepEPCheckConfig, ctx: RunContext) -> dict:
    """Our byte count for DeepEP's low-latency setting divided by their latency, beside their bandwidth."""
    c = config
    dispatch_lat, dispatch_gbps, combine_lat, combine_gbps = DEEPEP_LOW_LATENCY[c.ep_degree]
    dispatch_bytes = c.tokens_per_rank * c.top_k * row_bytes(c.hidden, "fp8")
    combine_bytes = c.tokens_per_rank * c.top_k * row_bytes(c.hidden, "bf16")
    result = {
        "dispatch_bytes": dispatch_bytes,
        "combine_bytes": combine_bytes,
        "dispatch_latency_us": dispatch_lat,
        "combine_latency_us": combine_lat,
        "dispatch_published_gbps": dispatch_gbps,
        "combine_published_gbps": combine_gbps,
        "dispatch_implied_gbps": dispatch_bytes / (dispatch_lat * 1e-6) / 1e9,
        "combine_implied_gbps": combine_bytes / (combine_lat * 1e-6) / 1e9,
    }
    ctx.log(result, step=0)
    return result


def summarize(records: Sequence[RunRecord]) -> Summary:
    """The model table, the DeepEP check table and the time-against-EP figure."""
    scaling = sorted(
        (r for r in records if isinstance(r.config, EPScalingConfig)),
        key=lambda r: (r.config.ep_degree, r.config.scheme, r.config.dispatch_dtype),
    )
    checks = sorted(
        (r for r in records if isinstance(r.config, DeepEPCheckConfig)), key=lambda r: r.config.ep_degree
    )
    return Summary(
        title="Expert parallelism: a communication model",
        tables=(_scaling_table(scaling), _check_table(checks)),
        figures=(_time_figure(scaling),),
        notes="A model: bytes are counted, times are bytes over assumed bandwidths; no GPU was used.",
    )


def _scaling_table(scaling: Sequence[RunRecord]) -> Table:
    """One row per (EP degree, scheme, dispatch dtype): bytes, cross-node share, modelled times."""
    rows = [
        {
            "ep": r.config.ep_degree,
            "nodes": r.result["nodes"],
            "scheme": r.config.scheme,
            "dtype": r.config.dispatch_dtype,
            "kb_token": r.result["dispatch_bytes_per_token"] / 1e3,
            "cross": 100 * r.result["cross_node_fraction"],
            "mc": r.result["counted_over_model"],
            "dispatch": r.result["dispatch_ms"],
            "combine": r.result["combine_ms"],
            "expert": r.result["expert_ms"],
            "layer": r.result["layer_ms"],
            "share": 100 * r.result["comm_share"],
        }
        for r in scaling
    ]
    first = scaling[0].config if scaling else EPScalingConfig(ep_degree=8)
    caption = (
        "\\textbf{A model, not a measurement.} All-to-all traffic and time of one MoE layer forward "
        f"under expert parallelism: {first.tokens_per_rank} tokens per rank, hidden {first.hidden}, "
        f"top-{first.top_k} of {first.num_experts} experts (expert hidden {first.expert_hidden}), "
        f"{first.gpus_per_node} GPUs per node, assumed {first.nvlink_gbps:g} GB/s NVLink and "
        f"{first.rdma_gbps:g} GB/s RDMA per GPU, experts at {first.mfu:g} of {first.gpu_tflops:g} TFLOP/s, "
        "no overlap, no latency term. \\emph{slot}: one row per routed slot to its owner rank (our "
        "\\texttt{moe.parallel}); \\emph{node-dedup}: DeepEP-style, one RDMA copy per remote node, "
        f"node-limited routing ($\\le {first.max_nodes}$ nodes per token). Dispatch in the dtype shown "
        "(fp8: $D + 4\\lceil D/128\\rceil$ bytes per row), combine in bf16. KB/token: dispatch bytes per "
        "token over NVLink and RDMA (with DeepEP's NVLink forwarding), which is also each GPU's send volume "
        "divided by its tokens; cross-node: the RDMA share of them; MC/model: copies counted on random "
        "routing over the closed form."
    )
    return table_from_rows(
        "ep-scaling",
        caption,
        [
            ("ep", "EP", "d"),
            ("nodes", "nodes", "d"),
            ("scheme", "scheme", ""),
            ("dtype", "dispatch", ""),
            ("kb_token", "KB/token", ".1f"),
            ("cross", "cross-node \\%", ".1f"),
            ("mc", "MC/model", ".3f"),
            ("dispatch", "dispatch ms", ".2f"),
            ("combine", "combine ms", ".2f"),
            ("expert", "experts ms", ".2f"),
            ("layer", "layer ms", ".2f"),
            ("share", "comm \\%", ".0f"),
        ],
        rows,
    )


def _check_table(checks: Sequence[RunRecord]) -> Table:
    """Our byte count against DeepEP's published latency and bandwidth, per EP degree."""
    check_rows = [
        {
            "ep": r.config.ep_degree,
            "d_lat": r.result["dispatch_latency_us"],
            "d_pub": r.result["dispatch_published_gbps"],
            "d_ours": r.result["dispatch_implied_gbps"],
            "c_lat": r.result["combine_latency_us"],
            "c_pub": r.result["combine_published_gbps"],
            "c_ours": r.result["combine_implied_gbps"],
        }
        for r in checks
    ]
    return table_from_rows(
        "deepep-check",
        "Byte accounting against DeepEP's published low-latency kernels (H800, CX7 400 Gb/s; 128 tokens, "
        "hidden 7168, top-8, fp8 dispatch, bf16 combine): their latency and bandwidth, and our slot byte "
        "count ($128 \\cdot 8 \\cdot$ row bytes) divided by their latency. Agreement means their bandwidth "
        "counts every (token, expert) copy, as the \\emph{slot} scheme does. Published numbers from DeepEP's "
        "docs/legacy.md; nothing here was run on a GPU.",
        [
            ("ep", "EP", "d"),
            ("d_lat", "dispatch $\\mu$s", ".0f"),
            ("d_pub", "published GB/s", ".0f"),
            ("d_ours", "bytes/latency", ".1f"),
            ("c_lat", "combine $\\mu$s", ".0f"),
            ("c_pub", "published GB/s", ".0f"),
            ("c_ours", "bytes/latency", ".1f"),
        ],
        check_rows,
    )


def _all_to_all_ms(run: RunRecord) -> float:
    return run.result["dispatch_ms"] + run.result["combine_ms"]


def _time_figure(scaling: Sequence[RunRecord]) -> Figure:
    """Dispatch + combine time against the EP degree per scheme and dtype, beside the expert GEMMs."""
    series = []
    for scheme in SCHEMES:
        for dtype in DTYPES:
            runs = [r for r in scaling if r.config.scheme == scheme and r.config.dispatch_dtype == dtype]
            if runs:
                series.append(
                    series_from_points(
                        [(r.config.ep_degree, _all_to_all_ms(r)) for r in runs],
                        label=f"{scheme}, {dtype} dispatch: dispatch + combine",
                        style="line+markers" if dtype == "fp8" else "dashed",
                        group=scheme,
                    )
                )
    expert_runs = [r for r in scaling if r.config.scheme == SCHEMES[0] and r.config.dispatch_dtype == "fp8"]
    if expert_runs:
        series.append(
            series_from_points(
                [(r.config.ep_degree, r.result["expert_ms"]) for r in expert_runs],
                label="expert GEMMs",
                style="step",
                group="experts",
            )
        )
    return Figure(
        name="ep-layer-time",
        caption="\\textbf{Model, not measurement:} all-to-all time (dispatch + combine) of one MoE layer "
        "forward against the EP degree, beside the expert GEMM time, in the setting of the table.",
        xlabel="EP degree (GPUs)",
        ylabel="modelled time per layer forward (ms)",
        series=tuple(series),
        ymin=0.0,
    )


EXPERIMENT = Experiment(
    name="ep-scaling-model",
    description="MODEL of expert-parallel all-to-all bytes per token and layer time for EP 8-64 "
    "(NVLink + RDMA, DeepEP setting), with a Monte-Carlo and a DeepEP byte-count check",
    plan=plan,
    runners={EPScalingConfig: run_ep_scaling, DeepEPCheckConfig: run_deepep_check},
    summarize=summarize,
)
