"""Expert parallelism without spawning: the global capacity rule, the row reordering, a 1-rank group.

Legend: T tokens, K slots per token, E experts, R ranks, L local experts.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import moe
from moe.parallel import (
    ExpertParallelMoE,
    _expert_major_order,
    expert_parallel,
    global_keep_mask,
    sync_gradients,
)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_global_keep_mask_equals_keep_mask_on_the_concatenation(top_k):
    gen = torch.Generator().manual_seed(top_k)
    num_experts = 6
    for trial in range(20):
        world = 1 + trial % 4
        sizes = torch.randint(0, 9, (world,), generator=gen).tolist()
        sizes[trial % world] = 0 if trial % 3 == 0 else sizes[trial % world]  # ranks without tokens
        total = sum(sizes)
        # skewed routing: expert ids drawn from a few experts, distinct per token
        scores = torch.rand(total, num_experts, generator=gen) * torch.tensor([4.0, 3, 1, 1, 0.5, 0.1])
        experts_TK = scores.topk(top_k, dim=1).indices
        chunks = experts_TK.split(sizes)
        counts_RKE = torch.stack(
            [
                torch.stack([torch.bincount(c[:, k], minlength=num_experts) for k in range(top_k)])
                for c in chunks
            ]
        )
        for capacity in (1, 2, 3, 5, 100):
            expected = moe.keep_mask(experts_TK, num_experts, capacity)
            got = torch.cat([global_keep_mask(c, counts_RKE, r, capacity) for r, c in enumerate(chunks)])
            assert torch.equal(got, expected), (sizes, capacity)
            if capacity < total * top_k / num_experts:
                assert not bool(expected.all())  # the case drops something


def test_expert_major_order_matches_a_loop():
    counts_RL = torch.tensor([[2, 0, 1], [0, 0, 3], [1, 4, 0]])
    rows = []  # received rows are (rank, local expert)-major; name each row (r, l, i)
    for r in range(3):
        for l in range(3):
            rows += [(r, l, i) for i in range(int(counts_RL[r, l]))]
    order = _expert_major_order(counts_RL, len(rows)).tolist()
    reordered = [rows[i] for i in order]
    assert reordered == sorted(rows, key=lambda row: (row[1], row[0], row[2]))


def test_expert_parallel_needs_an_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(ValueError, match="init_process_group"):
        expert_parallel(moe.MoE(8, 16, 4))


@pytest.fixture
def one_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


class _TaggedMoE(moe.MoE):
    """A user subclass: expert_parallel keeps its class in the MRO."""

    tag = "mine"


def test_one_rank_group_is_the_plain_layer(one_rank_group):
    torch.manual_seed(0)
    layer = _TaggedMoE(8, 16, 4, top_k=2, capacity_factor=1.0, num_shared_experts=1)
    plain = copy.deepcopy(layer)
    ep = expert_parallel(layer)
    assert ep is layer and isinstance(ep, ExpertParallelMoE) and ep.tag == "mine"
    assert ep.expert_range == range(0, 4) and "ep_rank=0/1" in repr(ep)
    x = torch.randn(2, 9, 8)
    x_ep = x.clone().requires_grad_()
    x_plain = x.clone().requires_grad_()
    ep(x_ep).square().sum().backward()
    plain(x_plain).square().sum().backward()
    torch.testing.assert_close(ep(x), plain(x), rtol=0, atol=1e-6)
    torch.testing.assert_close(x_ep.grad, x_plain.grad, rtol=0, atol=1e-6)
    assert ep.last_global_drop_fraction == plain.last_drop_fraction > 0
    sync_gradients(ep)
    for (name, p), q in zip(ep.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)
    empty = torch.zeros(0, 8, requires_grad=True)
    y = ep(empty)
    assert y.shape == (0, 8) and ep.last_drop_fraction == 0.0
    y.sum().backward()
    assert ep.last_all_to_all.send_rows == (0,) and ep.last_all_to_all.dispatch_bytes == 0
