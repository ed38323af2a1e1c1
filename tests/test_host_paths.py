"""The accelerator's code paths of the keyed noise and the verification rules give the host paths'
numbers and tokens, and the verify-cost grid synchronises before it reads a clock.

On this CPU the accelerator's paths run inside :func:`specdec.host_sync.accelerator_paths`; where CUDA
is present the same checks run on it too (``device`` ``cuda``), against the CPU's results.

Legend: B rows, K draft depth, N tree nodes, V vocabulary.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from specdec.engine import cost_model
from specdec.host_sync import accelerator_paths
from specdec.sampling import logits_to_probs
from specdec.testing import with_generator
from specdec.verify import rejection_sample
from specdec.verify.gumbel import gumbel_verify, gumbel_verify_tree
from specdec.verify.noise import PositionNoise, sample_keyed
from specdec.verify.token_tree import TokenTree
from specdec.verify.tree import tree_greedy_verify, tree_greedy_walk, tree_rejection_sample

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
B, K, V = 7, 4, 50
SEEDS = [3, 2**63 + 5, 0, 17, 2**64 - 1, 99, 123456789]


def paths(device: str):
    """The accelerator's paths: forced on the CPU, natural on CUDA."""
    return accelerator_paths() if device == "cpu" else contextlib.nullcontext()


def to(device: str, *tensors: Any) -> list[Any]:
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in tensors]


def inputs(seed: int, *, sharp: float = 1.5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target_probs = torch.softmax(torch.randn((B, K + 1, V), generator=g) * sharp, dim=-1)
    draft_probs = torch.softmax(torch.randn((B, K, V), generator=g) * sharp, dim=-1)
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, V), 1, generator=g).reshape(B, K)
    # half the rows draft the target's likeliest tokens, so runs of acceptances happen
    draft_tokens[::2] = target_probs[::2, :K].argmax(-1)
    positions = torch.arange(K + 1) + torch.randint(0, 1000, (B, 1), generator=g)
    return {"target": target_probs, "draft": draft_probs, "tokens": draft_tokens, "positions": positions}


@pytest.mark.parametrize("device", DEVICES)
def test_keyed_noise_on_the_device_is_the_cpus_bit_for_bit(device):
    positions = torch.randint(0, 10**6, (B, 3))
    cpu = PositionNoise(SEEDS)
    there = PositionNoise(SEEDS, device=device)
    for stream in ("sample", "accept", "residual", "draft", "tree"):
        assert torch.equal(there.keys(positions.to(device), stream).cpu(), cpu.keys(positions, stream))
        assert torch.equal(
            there.uniform_BKV(positions.to(device), V, stream).cpu(), cpu.uniform_BKV(positions, V, stream)
        )
        assert torch.equal(
            there.uniform_BK(positions.to(device), stream).cpu(), cpu.uniform_BK(positions, stream)
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("point_mass", [False, True])
def test_keyed_exact_decides_as_on_the_cpu(device, point_mass):
    for seed in range(6):
        x = inputs(seed)
        draft = None if point_mass else x["draft"]
        ref = rejection_sample(
            x["target"], x["tokens"], draft, noise=PositionNoise(SEEDS), positions_BK=x["positions"]
        )
        with paths(device):
            t, tok, d, pos = to(device, x["target"], x["tokens"], draft, x["positions"])
            got = rejection_sample(
                t, tok, d, noise=PositionNoise(SEEDS, device=device), positions_BK=pos, validate=False
            )
        assert torch.equal(got.tokens.cpu(), ref.tokens) and torch.equal(
            got.num_accepted.cpu(), ref.num_accepted
        )


@pytest.mark.parametrize("device", DEVICES)
def test_gumbel_all_positions_equals_the_loop_to_the_first_mismatch(device):
    accepted = 0
    for seed in range(8):
        x = inputs(seed, sharp=4.0)
        noise = PositionNoise(SEEDS)
        # drafts equal to the keyed samples in places, so rows accept runs of them
        y = sample_keyed(x["target"], noise, x["positions"])
        tokens = torch.where(
            torch.rand((B, K), generator=torch.Generator().manual_seed(seed)) < 0.7, y[:, :K], x["tokens"]
        )
        ref = gumbel_verify(x["target"], tokens, None, noise=noise, positions_BK=x["positions"])
        with paths(device):
            t, tok, pos = to(device, x["target"], tokens, x["positions"])
            got = gumbel_verify(
                t, tok, None, noise=PositionNoise(SEEDS, device=device), positions_BK=pos, validate=False
            )
        assert torch.equal(got.tokens.cpu(), ref.tokens) and torch.equal(
            got.num_accepted.cpu(), ref.num_accepted
        )
        accepted += int(ref.num_accepted.sum())
    assert accepted > B  # the runs were there to compare


def tree_inputs(seed: int) -> tuple[TokenTree, dict[str, torch.Tensor]]:
    tree = TokenTree.from_branching([3, 2, 1])
    n = tree.num_nodes
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn((B, n, V), generator=g) * 3.0, dim=-1)
    draft = torch.softmax(torch.randn((B, n, V), generator=g) * 3.0, dim=-1)
    tokens = torch.randint(0, V, (B, n), generator=g)
    # the first candidate of each node is the target's likeliest token at its parent, in most rows
    for child in range(1, n):
        parent = tree.parents[child]
        if tree.children[parent][0] == child:
            tokens[:-2, child] = target[:-2, parent].argmax(-1)
    depth = torch.tensor(tree.depth)
    positions = depth + torch.randint(0, 1000, (B, 1), generator=g)
    return tree, {"target": target, "draft": draft, "tokens": tokens, "positions": positions}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_probs", [False, True])
def test_tree_rejection_sampling_keyed_decides_as_on_the_cpu(device, with_probs):
    for seed in range(5):
        tree, x = tree_inputs(seed)
        draft = x["draft"] if with_probs else None
        ref = tree_rejection_sample(
            x["target"], tree, x["tokens"], draft, noise=PositionNoise(SEEDS), positions_BN=x["positions"]
        )
        with paths(device):
            t, tok, d, pos = to(device, x["target"], x["tokens"], draft, x["positions"])
            got = tree_rejection_sample(
                t, tree, tok, d, noise=PositionNoise(SEEDS, device=device), positions_BN=pos, validate=False
            )
        for a, b in zip(got, ref, strict=True):
            assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("device", DEVICES)
def test_tree_gumbel_and_greedy_walks_decide_as_on_the_cpu(device):
    deep = 0
    for seed in range(5):
        tree, x = tree_inputs(seed)
        ref = gumbel_verify_tree(
            x["target"], tree, x["tokens"], noise=PositionNoise(SEEDS), positions_BN=x["positions"]
        )
        argmax = x["target"].argmax(-1)
        ref_greedy = tree_greedy_verify(argmax, tree, x["tokens"])
        with paths(device):
            t, tok, pos, am = to(device, x["target"], x["tokens"], x["positions"], argmax)
            got = gumbel_verify_tree(
                t, tree, tok, noise=PositionNoise(SEEDS, device=device), positions_BN=pos, validate=False
            )
            got_greedy = tree_greedy_verify(am, tree, tok)
        for a, b in (*zip(got, ref, strict=True), *zip(got_greedy, ref_greedy, strict=True)):
            assert torch.equal(a.cpu(), b)
        deep += int(ref_greedy.num_accepted.sum())
    assert deep > B
    walked = tree_greedy_walk(argmax, tree, x["tokens"])  # called directly on the CPU as well
    assert all(torch.equal(a, b) for a, b in zip(walked, ref_greedy, strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_a_sparse_distribution_takes_the_dense_pass_with_the_same_tokens(device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn((B, V), generator=g) * 2
    probs = logits_to_probs(logits, 0.9, top_k=5)  # 10 % non-zero: the host takes the sparse pass
    positions = torch.randint(0, 10**6, (B,), generator=g)
    ref = sample_keyed(probs, PositionNoise(SEEDS), positions)
    with paths(device):
        p, pos = to(device, logits, positions)
        there = logits_to_probs(p, 0.9, top_k=5, validate=False)
        got = sample_keyed(there, PositionNoise(SEEDS, device=device), pos, validate=False)
    assert torch.equal(got.cpu(), ref)


def test_a_cpu_generator_draws_the_same_numbers_for_the_rule_on_any_device():
    x = inputs(1)
    rule = with_generator(rejection_sample)  # each row's seed drawn from the (CPU) generator
    ref = rule(x["target"], x["tokens"], x["draft"], generator=torch.Generator().manual_seed(5))
    for device in DEVICES:
        with paths(device):
            t, tok, d = to(device, x["target"], x["tokens"], x["draft"])
            got = rule(t, tok, d, generator=torch.Generator().manual_seed(5), validate=False)
        assert torch.equal(got.tokens.cpu(), ref.tokens)


class _ClockedTarget:
    """A target that says it lives on an accelerator and records its calls in one timeline."""

    vocab_size = 40

    def __init__(self, events: list[str], device: str) -> None:
        self.events = events
        self.device = torch.device(device)

    def forward(self, tokens_BT, start_B, rows_B=None):
        self.events.append("forward")

    def rollback(self, lengths_B, rows_B=None):
        self.events.append("rollback")


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_verify_cost_grid_synchronises_before_every_clock_read(monkeypatch, device):
    events: list[str] = []
    clock = iter(range(10**6))

    def perf_counter() -> float:
        events.append("clock")
        return float(next(clock))

    monkeypatch.setattr(cost_model.time, "perf_counter", perf_counter)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: events.append("sync"))
    cost_model.measure_verify_cost(_ClockedTarget(events, device), max_rows=2, tokens=(1, 2), repeats=1)
    timed = [i for i, e in enumerate(events) if e == "forward"][1:]  # the first fills the context
    assert len(timed) >= 4 * cost_model.MIN_CALLS
    for i in timed:
        if device == "cuda":
            assert events[i - 2 : i] == ["sync", "clock"] and events[i + 1 : i + 3] == ["sync", "clock"]
        else:  # nothing to wait for on the CPU
            assert events[i - 1] == "clock" and events[i + 1] == "clock" and "sync" not in events
