"""Expert parallelism on gloo CPU ranks against the single-process moe.MoE (fp32, <= 1e-5).

One spawn of 4 processes (spawning dominates the cost) runs every case on three expert-parallel groups:
ranks [0, 2] (2 ranks, not the default group), [1, 2, 3] (3 ranks) and [0, 1, 2, 3] (4 ranks). Every case
builds the same seeded layer on every rank, runs the unsharded layer on all ranks' tokens concatenated in
group-rank order (the reference), and the expert-parallel copy on each rank's share; the workers write the
measured differences to JSON and the tests below assert on them.

Legend: T tokens, D model dim, E experts, K slots per token, R ranks.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  imported before init_process_group (see experiments/moe_ep_demo.py)
import torch.distributed as dist
import torch.multiprocessing as mp

import moe
from moe.parallel import expert_parallel, sync_gradients

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # 4 gloo ranks, ~18 s

WORLD = 4
GROUPS = {"ep2": [0, 2], "ep3": [1, 2, 3], "ep4": [0, 1, 2, 3]}
DIM, HIDDEN, EXPERTS = 16, 24, 12  # 12 experts: 6, 4 and 3 per rank
TOL = 1e-5


@dataclass(frozen=True)
class Case:
    """One equivalence check: a layer config, tokens per rank (by group size), and how to set the router."""

    options: dict
    tokens: dict[int, list[int]]
    router: str = "random"  # "random", "zero" (ties: experts 0..K-1), "last" (every token to expert E-1)
    seed: int = 0
    average: bool = False  # sync_gradients(average=...)


CASES = {
    # softmax top-2 with a gated shared expert and both router losses; one rank gets a 3-D input.
    "dropless": Case(
        options=dict(top_k=2, num_shared_experts=1, shared_expert_gate=True, z_loss_coef=1e-3),
        tokens={2: [6, 5], 3: [6, 1, 5], 4: [6, 1, 5, 4]},
    ),
    # A rank with no tokens ([0, D] input) still serves its experts and joins both all-to-alls.
    "empty-rank": Case(options=dict(top_k=2), tokens={2: [7, 0], 3: [0, 4, 3], 4: [3, 0, 5, 0]}, seed=1),
    # Switch top-1 where every token picks the last expert: one rank receives everything, one token alone.
    "skew-last": Case(
        options=dict(top_k=1, router="switch"),
        tokens={2: [1, 6], 3: [5, 1, 4], 4: [1, 3, 0, 6]},
        router="last",
    ),
    # Zero router: every token's top-2 is experts 0 and 1, both on rank 0.
    "skew-first": Case(
        options=dict(top_k=2), tokens={2: [5, 4], 3: [3, 6, 2], 4: [2, 5, 1, 3]}, router="zero"
    ),
    # DeepSeek-V3 sigmoid routing with a (replicated) selection bias and a routed scaling factor.
    "sigmoid-bias": Case(
        options=dict(top_k=3, router=moe.SigmoidBiasRouter.Config(routed_scaling_factor=2.5)),
        tokens={2: [8, 3], 3: [4, 4, 4], 4: [2, 7, 3, 5]},
        seed=2,
        average=True,
    ),
    # Global capacity: C from all ranks' tokens, (k, t) priority over the concatenation; an empty rank too.
    "capacity": Case(
        options=dict(top_k=2, capacity_factor=0.5), tokens={2: [9, 6], 3: [9, 0, 7], 4: [9, 0, 4, 7]}, seed=3
    ),
    # Capacity with all tokens on one expert pair: almost everything dropped.
    "capacity-skew": Case(
        options=dict(top_k=2, capacity_factor=1.0),
        tokens={2: [6, 6], 3: [2, 5, 4], 4: [4, 1, 6, 2]},
        router="zero",
    ),
}


def _maxabs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


def _make_layer(case: Case) -> moe.MoE:
    torch.manual_seed(case.seed)
    layer = moe.MoE(DIM, HIDDEN, EXPERTS, **case.options)
    with torch.no_grad():
        if case.router in ("zero", "last"):
            layer.router.weight.zero_()
        if case.router == "last":
            layer.router.weight[-1, 0] = 5.0  # logit 5 * x[:, 0] > 0 = every other logit
        if hasattr(layer.router, "expert_bias"):
            layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, EXPERTS))
    return layer.train()


def _run_case(case: Case, group: dist.ProcessGroup) -> tuple[dict, dict]:
    """(metrics, tensors) of one case on this rank."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    counts = case.tokens[world]
    lo, hi = sum(counts[:rank]), sum(counts[: rank + 1])
    gen = torch.Generator().manual_seed(100 + case.seed)
    x_all = torch.randn(sum(counts), DIM, generator=gen)
    g_all = torch.randn(sum(counts), DIM, generator=gen)
    if case.router == "last":
        x_all[:, 0] = x_all[:, 0].abs() + 0.5

    ref = _make_layer(case)
    ep = copy.deepcopy(ref)
    local_ref = copy.deepcopy(ref)
    x_ref = x_all.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * g_all).sum().backward()

    expert_parallel(ep, group)
    x = x_all[lo:hi].clone().requires_grad_()
    x_in = x.view(1, -1, DIM) if rank == 0 else x  # leading dims are flattened like the plain layer
    y = ep(x_in)
    assert y.shape == x_in.shape
    (y.view(-1, DIM) * g_all[lo:hi]).sum().backward()

    experts = ep.expert_range
    m: dict[str, float | bool | int] = {
        "tokens": hi - lo,
        "out": _maxabs(y.view(-1, DIM), y_ref[lo:hi].detach()),
        "dx": _maxabs(x.grad, x_ref.grad[lo:hi]),
        "dw_gate_up": _maxabs(
            ep.experts.w_gate_up.grad, ref.experts.w_gate_up.grad[experts.start : experts.stop]
        ),
        "dw_down": _maxabs(ep.experts.w_down.grad, ref.experts.w_down.grad[experts.start : experts.stop]),
        "weights_sliced": bool(
            torch.equal(ep.experts.w_down.detach(), ref.experts.w_down.detach()[experts.start : experts.stop])
        ),
    }
    # Router / shared grads are local contributions; all-reduced they are the reference's (/R with average).
    expert_grads = [p.grad.clone() for p in ep.experts.parameters()]
    sync_gradients(ep, group, average=case.average)
    scale = world if case.average else 1
    replicated = [(n, p) for n, p in ep.named_parameters() if not n.startswith("experts.")]
    ref_params = dict(ref.named_parameters())
    m["d_replicated"] = max(_maxabs(p.grad * scale, ref_params[n].grad) for n, p in replicated)
    m["replicated_names"] = len(replicated)
    m["d_experts_after_sync"] = max(
        _maxabs(p.grad * scale, g) for p, g in zip(ep.experts.parameters(), expert_grads, strict=True)
    )
    # Statistics: routed / kept counts summed over ranks are the reference's; drop fraction is global.
    for name in ("expert_counts", "routed_counts"):
        total = getattr(ep, name).clone()
        dist.all_reduce(total, group=group)
        m[f"{name}_equal"] = bool(torch.equal(total, getattr(ref, name)))
    dropped = torch.tensor([ep.dropped_slots])
    dist.all_reduce(dropped, group=group)
    m["dropped"], m["ref_dropped"] = int(dropped), ref.dropped_slots
    m["global_drop_fraction"], m["ref_drop_fraction"] = ep.last_global_drop_fraction, ref.last_drop_fraction
    # Router losses are per rank: those of the unsharded layer on this rank's tokens (dropless cases).
    if hi > lo and case.options.get("capacity_factor") is None:
        local_ref(x_all[lo:hi])
        m["d_aux_loss"] = abs(float(ep.last_aux_loss) - float(local_ref.last_aux_loss))
        if local_ref.last_z_loss is not None:
            m["d_z_loss"] = abs(float(ep.last_z_loss) - float(local_ref.last_z_loss))
    # All-to-all accounting: rows sent = kept slots; rows to other ranks = slots of experts held elsewhere.
    stats = ep.last_all_to_all
    kept_E = ep.last_tokens_per_expert
    mine = kept_E[experts.start : experts.stop].sum()
    m["a2a_rows_ok"] = sum(stats.send_rows) == int(kept_E.sum()) and stats.send_rows[rank] == int(mine)
    m["a2a_bytes_ok"] = stats.dispatch_bytes == int(kept_E.sum() - mine) * DIM * 4
    received = torch.tensor(stats.recv_rows)
    dist.all_reduce(received, group=group)
    m["a2a_recv_total"], m["a2a_kept_total"] = int(received.sum()), int(ref.expert_counts.sum())
    tensors = {"y": y.detach().clone(), "dx": x.grad.clone(), "dw": [g.clone() for g in expert_grads]}
    return m, tensors


def _check_errors(group: dist.ProcessGroup, world: int) -> dict[str, bool]:
    """Bad input raises ValueError (every rank reaches the same verdict)."""
    results = {}

    def raises(fn, match: str) -> bool:
        try:
            fn()
        except ValueError as err:
            return match in str(err)
        return False

    results["uneven_experts"] = raises(lambda: expert_parallel(moe.MoE(DIM, HIDDEN, 10), group), "divisible")
    results["expert_choice"] = raises(
        lambda: expert_parallel(moe.MoE(DIM, HIDDEN, EXPERTS, router="expert_choice"), group), "expert_choice"
    )
    torch.manual_seed(1000 + dist.get_rank())  # different weights on every rank
    results["weights_differ"] = raises(
        lambda: expert_parallel(moe.MoE(DIM, HIDDEN, EXPERTS), group), "differ"
    )
    torch.manual_seed(0)
    twice = expert_parallel(moe.MoE(DIM, HIDDEN, EXPERTS), group)
    results["twice"] = raises(lambda: expert_parallel(twice, group), "already")
    results["not_moe"] = raises(lambda: expert_parallel(torch.nn.Linear(2, 2), group), "moe.MoE")
    return results


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    results: dict[str, dict] = {}
    try:
        for gname, members in GROUPS.items():
            group = dist.new_group(members)  # collective over the default group: every rank calls it
            if rank not in members:
                continue
            for cname, case in CASES.items():
                results[f"{gname}/{cname}"], tensors = _run_case(case, group)
                if cname == "dropless":  # determinism: the same case again, bitwise
                    _, again = _run_case(case, group)
                    results[f"{gname}/determinism"] = {
                        "equal": all(
                            torch.equal(a, b)
                            for key in tensors
                            for a, b in zip(
                                tensors[key] if key == "dw" else [tensors[key]],
                                again[key] if key == "dw" else [again[key]],
                                strict=True,
                            )
                        )
                    }
            if gname == "ep4":
                results["ep4/errors"] = _check_errors(group, len(members))
        dist.barrier()
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    """{"group/case": [metrics of each member rank]}, from one spawn of 4 gloo ranks."""
    out = tmp_path_factory.mktemp("ep")
    start = time.monotonic()
    ctx = mp.start_processes(
        _worker, args=(WORLD, str(out / "store"), str(out)), nprocs=WORLD, join=False, start_method="spawn"
    )
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() - start > 300:
                for p in ctx.processes:
                    p.kill()
                pytest.fail("expert-parallel workers did not finish in 300 s")
    except mp.ProcessRaisedException:
        errors = "\n".join(f"--- {p.name}:\n{p.read_text()}" for p in sorted(out.glob("rank*.err")))
        pytest.fail(f"an expert-parallel worker failed:\n{errors}")
    merged: dict[str, list[dict]] = {}
    for rank in range(WORLD):
        for key, metrics in json.loads((out / f"rank{rank}.json").read_text()).items():
            merged.setdefault(key, []).append(metrics)
    print(f"\n4-rank spawn with all cases: {time.monotonic() - start:.1f} s (pid {os.getpid()})")
    return merged


def _cases(results, case):
    found = {k: v for k, v in results.items() if k.endswith(f"/{case}")}
    assert set(found) == {f"{g}/{case}" for g in GROUPS}, sorted(results)
    for key, per_rank in found.items():
        assert len(per_rank) == len(GROUPS[key.split("/")[0]]), key
    return found


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_backward_match_the_unsharded_layer(results, case):
    for key, per_rank in _cases(results, case).items():
        for rank, m in enumerate(per_rank):
            where = f"{key} rank {rank}: {m}"
            assert m["weights_sliced"], where
            for metric in ("out", "dx", "dw_gate_up", "dw_down", "d_replicated", "d_experts_after_sync"):
                assert m[metric] <= TOL, where
            assert m["replicated_names"] >= 1, where
            assert m["expert_counts_equal"] and m["routed_counts_equal"], where
            for metric in ("d_aux_loss", "d_z_loss"):
                assert m.get(metric, 0.0) <= 1e-6, where


def test_cases_cover_empty_single_and_one_expert_ranks(results):
    tokens = {k: [m["tokens"] for m in v] for k, v in results.items() if "tokens" in v[0]}
    assert all(0 in tokens[f"{g}/empty-rank"] for g in GROUPS)
    assert all(1 in tokens[f"{g}/skew-last"] for g in GROUPS)
    # skew-last: every kept slot goes to the last expert, so only the last rank receives rows.
    for m in results["ep3/skew-last"]:
        assert m["a2a_recv_total"] == m["a2a_kept_total"] == sum(CASES["skew-last"].tokens[3])


def test_capacity_dropping_is_global(results):
    for case in ("capacity", "capacity-skew"):
        for key, per_rank in _cases(results, case).items():
            first = per_rank[0]
            assert first["ref_drop_fraction"] > 0, key  # the case really drops
            for m in per_rank:
                assert m["dropped"] == m["ref_dropped"], key
                assert m["global_drop_fraction"] == pytest.approx(m["ref_drop_fraction"], abs=1e-12), key


def test_all_to_all_accounting(results):
    for key, per_rank in results.items():
        if "a2a_rows_ok" not in per_rank[0]:
            continue
        for m in per_rank:
            assert m["a2a_rows_ok"] and m["a2a_bytes_ok"], key
            assert m["a2a_recv_total"] == m["a2a_kept_total"], key


def test_determinism_across_runs(results):
    for key, per_rank in _cases(results, "determinism").items():
        assert all(m["equal"] for m in per_rank), key


def test_bad_input_raises_value_error(results):
    per_rank = results["ep4/errors"]
    assert len(per_rank) == WORLD
    for checks in per_rank:
        assert checks == {k: True for k in checks} and len(checks) == 5, checks
