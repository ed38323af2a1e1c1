"""Byte arithmetic of the expert-parallel communication model (experiments.theory.ep_scaling).

Legend: E experts, k experts per token, R ranks (EP degree), G GPUs per node, N nodes, M allowed nodes.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch

from experiments.theory.ep_scaling import (
    DEEPEP_LOW_LATENCY,
    expert_flops,
    measure_traffic,
    node_dedup_traffic,
    row_bytes,
    slot_traffic,
    traffic,
    transfer_time_s,
)


def test_row_bytes():
    assert row_bytes(7168, "bf16") == 14336
    assert row_bytes(7168, "fp8") == 7168 + 4 * 56 == 7392  # one fp32 scale per 128 channels
    assert row_bytes(100, "fp8") == 104  # a partial block still has its scale
    with pytest.raises(ValueError, match="dtype"):
        row_bytes(128, "fp16")


def _enumerate(scheme, num_experts, top_k, ep_degree, gpus_per_node, routings):
    """Exact mean copies over every (routing, source rank) pair, each equally likely."""
    experts_TK = torch.tensor([list(r) for r in routings for _ in range(ep_degree)])
    source_T = torch.arange(ep_degree).repeat(len(routings))
    return measure_traffic(scheme, experts_TK, source_T, num_experts, ep_degree, gpus_per_node)


def test_hand_worked_case_two_nodes():
    # E=8, k=2, R=4 ranks on N=2 nodes of G=2: rank r holds experts 2r, 2r+1; node n holds 4n .. 4n+3.
    slot = slot_traffic(8, 2, 4, 2)
    # each of the 2 slots: own rank 1/4, the node's other GPU 1/4, the other node 2/4
    assert (slot.local, slot.nvlink, slot.rdma) == (0.5, 0.5, 1.0)
    assert slot.cross_node_fraction == pytest.approx(2 / 3)
    dedup = node_dedup_traffic(8, 2, 4, 2)
    # 28 expert pairs: 6 inside each node, 16 across. The other node is touched by 6 + 16 = 22 of them.
    assert dedup.rdma == pytest.approx(float(Fraction(22, 28)))
    # NVLink reaches the node's other GPU and the remote GPU that is not the RDMA landing GPU: each is
    # touched by 28 - C(6, 2) = 13 pairs, so 2 * 13/28 copies.
    assert dedup.nvlink == pytest.approx(float(Fraction(26, 28)))
    assert dedup.local == pytest.approx(float(Fraction(13, 28)))
    pairs = list(itertools.combinations(range(8), 2))
    for scheme, model in (("slot", slot), ("node-dedup", dedup)):
        counted = _enumerate(scheme, 8, 2, 4, 2, pairs)
        for field in ("local", "nvlink", "rdma"):
            assert getattr(counted, field) == pytest.approx(getattr(model, field), abs=1e-12), (scheme, field)


def test_hand_worked_case_node_limited():
    # E=8, k=2, R=8 ranks (one expert each) on N=4 nodes of G=2, tokens limited to M=2 nodes.
    model = node_dedup_traffic(8, 2, 8, 2, max_nodes=2)
    # 2 nodes chosen, then 2 of their 4 experts: both on one node with prob 2/6, so 5/3 nodes touched,
    # 3/4 of them remote; exactly 2 ranks touched, (8 - 4)/8 of them over NVLink.
    assert model.rdma == pytest.approx(5 / 4)
    assert model.nvlink == pytest.approx(1.0)
    assert model.local == pytest.approx(2 / 8)
    routings = []
    for nodes in itertools.combinations(range(4), 2):
        experts = [e for n in nodes for e in (2 * n, 2 * n + 1)]
        routings += list(itertools.combinations(experts, 2))
    counted = _enumerate("node-dedup", 8, 2, 8, 2, routings)
    assert (counted.local, counted.nvlink, counted.rdma) == pytest.approx(
        (model.local, model.nvlink, model.rdma)
    )
    # slot traffic does not depend on the node limit (each slot's rank is still uniform)
    counted_slot = _enumerate("slot", 8, 2, 8, 2, routings)
    slot = slot_traffic(8, 2, 8, 2)
    assert (counted_slot.nvlink, counted_slot.rdma) == pytest.approx((slot.nvlink, slot.rdma)) == (0.25, 1.5)


def test_transfer_time_and_flops_by_hand():
    copies = slot_traffic(8, 2, 4, 2)  # 0.5 NVLink, 1.0 RDMA copies per token
    fp8 = row_bytes(128, "fp8")  # 132 bytes
    # RDMA: 1000 * 1.0 * 132 B / 50 GB/s = 2.64 us; NVLink: 1000 * 0.5 * 132 B / 160 GB/s = 0.41 us
    assert transfer_time_s(copies, fp8, 1000, 160.0, 50.0) == pytest.approx(2.64e-6)
    assert transfer_time_s(copies, fp8, 1000, 160.0, 50.0, latency_us=5.0) == pytest.approx(7.64e-6)
    assert transfer_time_s(copies, fp8, 1000, 1.0, 50.0) == pytest.approx(66e-6)  # slow NVLink dominates
    assert expert_flops(4096, 8, 7168, 2048) == 6 * 7168 * 2048 * 4096 * 8


def test_one_node_sends_nothing_over_rdma():
    for scheme in ("slot", "node-dedup"):
        assert traffic(scheme, 256, 8, 8, 8, 4).rdma == 0
    assert slot_traffic(256, 8, 8, 8).nvlink == 7.0


def test_our_byte_count_matches_deepep_published_bandwidth():
    # DeepEP low latency: bandwidth = (tokens * top-k copies * row bytes) / latency, within 2.5 %.
    for ep, (d_us, d_gbps, c_us, c_gbps) in DEEPEP_LOW_LATENCY.items():
        dispatch = 128 * 8 * row_bytes(7168, "fp8") / (d_us * 1e-6) / 1e9
        combine = 128 * 8 * row_bytes(7168, "bf16") / (c_us * 1e-6) / 1e9
        assert dispatch == pytest.approx(d_gbps, rel=0.025), ep
        assert combine == pytest.approx(c_gbps, rel=0.025), ep


def test_bad_topologies_raise():
    with pytest.raises(ValueError, match="divisible"):
        slot_traffic(100, 8, 64, 8)
    with pytest.raises(ValueError, match="multiple of gpus_per_node"):
        slot_traffic(96, 8, 12, 8)
    with pytest.raises(ValueError, match="scheme"):
        traffic("ring", 256, 8, 16, 8)
    with pytest.raises(ValueError, match="top_k"):
        node_dedup_traffic(16, 8, 16, 2, max_nodes=1)
