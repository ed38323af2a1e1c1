"""Host discipline of an engine step: at most one device-to-host read per decode step, and the
accelerator's code paths give the host paths' tokens.

What the CPU can prove: inside :func:`specdec.host_sync.accelerator_paths` the engine, the rules and
the keyed noise run the code they run on an accelerator, and :func:`specdec.host_sync.count_host_syncs`
counts every host read (``.item()``, ``.tolist()``, ``.numpy()``, ``bool()``, a move to the CPU, a
boolean-mask index, ``nonzero``, ...) of a value computed from the target's forward: logits, features
and the proposals an EAGLE-style drafter makes from them. Each such read is a synchronisation on an
accelerator. What it cannot prove: a read of a tensor the code made from host values and moved to
the device (a synchronisation there too; ``count_host_syncs`` on CUDA counts those, and
``python -m experiments.gpu_check`` runs it), or the cost of host-to-device copies. Reads inside the
target's own methods (its checks of its inputs, ``specdec/targets/``) are counted apart
(``HostSyncs.outside_target``).

Legend: B rows, K draft depth, N tree nodes, V vocabulary, D hidden size.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from _tiny import byte_tokenizer, save_tiny_checkpoint

from specdec.engine import Engine
from specdec.engine.request import RequestStatus
from specdec.engine.transfer import HostTransfer
from specdec.host_sync import accelerator_paths, avoids_host, count_host_syncs
from specdec.protocols import Proposal
from specdec.sampling import sample_from_probs
from specdec.targets.llama import LlamaTarget
from specdec.verify.token_tree import TokenTree, TreeProposal

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 3, [20, 21, 22] * 6, [5, 6, 7] * 3]
N = 12  # new tokens per request


class FeatureDrafter:
    """An EAGLE-style drafter: it drafts from the target's last feature, where the target runs (a
    fixed random head ``W [D, V]`` on the feature's device), and proposes probabilities with its
    tokens; a token tree (deterministic top-2 candidates) where the engine says trees pay. Its
    proposals derive from the forward, so every host read of them counts."""

    def __init__(self, *, trees: bool = False) -> None:
        self.trees = trees
        self.trees_made = 0
        self.feat_1D: torch.Tensor | None = None
        self.head_DV: torch.Tensor | None = None

    def _remember(self, hidden_1TD: torch.Tensor, at: int) -> None:
        self.feat_1D = hidden_1TD[:, at]
        if self.head_DV is None:
            g = torch.Generator().manual_seed(7)
            D = hidden_1TD.shape[-1]
            self.head_DV = (torch.randn((D, 259), generator=g) * 4.0).to(hidden_1TD.device)

    def begin(self, state: Any, target_out: Any) -> None:
        self._remember(target_out.hidden_BTD, -1)

    def propose(self, state: Any, gamma: int, generator: torch.Generator | None = None) -> Proposal:
        probs_1V = torch.softmax(self.feat_1D @ self.head_DV, dim=-1)
        if self.trees and getattr(state, "tree_ok", False) and gamma >= 2:
            tree = TokenTree.from_branching([2, 1])  # root; two candidates; one below the first
            top_2 = probs_1V.topk(2, dim=-1).indices[0]
            tokens_1N = torch.stack([top_2[0], top_2[0], top_2[1], top_2[0]])[None]
            main_1K = tokens_1N[:, list(tree.main_path)]
            self.trees_made += 1
            return Proposal(main_1K, None, TreeProposal(tree, tokens_1N))
        probs_1KV = probs_1V[:, None].expand(1, gamma, -1).contiguous()
        tokens_1K = sample_from_probs(probs_1KV, generator, validate=False)
        return Proposal(tokens_1K, probs_1KV)

    def observe(self, state: Any, num_accepted_B: torch.Tensor, target_out: Any) -> None:
        self._remember(target_out.hidden_BTD, int(num_accepted_B[0]))


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> LlamaTarget:
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("host") / "tiny", tokenizer=byte_tokenizer())
    return LlamaTarget.from_pretrained(path)


def run(
    target: Any, drafter: Any, temperature: float, verify: str = "exact", *, prompts=PROMPTS, counted: bool
) -> tuple[dict[int, list[int]], list[tuple[bool, Any]]]:
    """Every prompt through one engine (the second request a step late); per request its tokens, and
    per step (steady: every request decoding, none prefilling) the reads counted."""
    engine = Engine(
        target, drafter=drafter, gamma=3, max_num_seqs=4, max_model_len=96, measure_cost=False, verify=verify
    )
    ids = {}
    steps = []
    with count_host_syncs(target) as syncs:
        for step in range(200):
            if step < len(prompts):  # staggered arrivals
                ids[engine.add_request(prompts[step], max_new_tokens=N, temperature=temperature, seed=step,
                                       ignore_eos=True)] = step  # fmt: skip
            if not engine.has_unfinished():
                break
            steady = not engine.waiting and all(r.status is RequestStatus.DECODE for r in engine.running)
            n0, t0 = syncs.count, syncs.outside_target
            outputs = engine.step()
            steps.append((steady, (syncs.outside_target - t0, syncs.count - n0, syncs.reads[n0:])))
            for o in outputs:
                if o.finished:
                    ids[o.request_id] = (ids[o.request_id], o.token_ids)
    assert not counted or steps
    return {k: v for k, v in ids.values()}, steps


CASES = [
    ("none", 0.0, "exact"),
    ("none", 0.8, "exact"),
    ("ngram", 0.0, "exact"),
    ("ngram", 0.8, "exact"),
    ("ngram", 0.8, "gumbel"),
    ("feature", 0.0, "exact"),
    ("feature", 0.8, "exact"),
    ("feature", 0.8, "gumbel"),
]


@pytest.mark.parametrize("drafter,temperature,verify", CASES)
def test_one_host_read_per_decode_step_and_the_host_paths_tokens(target, drafter, temperature, verify):
    make = (lambda: FeatureDrafter()) if drafter == "feature" else (lambda: drafter)
    host, _ = run(target, make(), temperature, verify, counted=False)
    with accelerator_paths():
        device, steps = run(target, make(), temperature, verify, counted=True)
    assert device == host, "the accelerator's paths changed a request's tokens"
    steady = [reads for is_steady, reads in steps if is_steady]
    assert len(steady) >= 3
    engine_reads = [r[0] for r in steady]
    assert max(engine_reads) <= 1, f"engine reads per steady step {engine_reads}: {steady}"
    assert min(engine_reads) == 1  # the committed tokens: the count sees the one read it allows


def test_a_token_tree_step_reads_the_host_once(target):
    """One request (trees only at one row): a tree from the device each step, greedy and sampled,
    under both keyed rules; the tokens equal the host paths'."""
    for temperature, verify in ((0.0, "exact"), (0.8, "exact"), (0.8, "gumbel")):
        host, _ = run(
            target, FeatureDrafter(trees=True), temperature, verify, prompts=PROMPTS[:1], counted=False
        )
        drafter = FeatureDrafter(trees=True)
        with accelerator_paths():
            device, steps = run(target, drafter, temperature, verify, prompts=PROMPTS[:1], counted=True)
        assert device == host
        assert drafter.trees_made >= 3
        steady = [r[0] for s, r in steps if s]
        assert steady and max(steady) <= 1 and min(steady) == 1, (temperature, verify, steps)


def test_the_count_sees_the_host_paths_reads(target):
    """Outside ``accelerator_paths`` the CPU fast paths read the logits on the host (numpy checks and
    argmax): the counter reports them, so a read added to the accelerator's paths would show."""
    _, steps = run(target, "ngram", 0.0, counted=True)
    steady = [r[0] for s, r in steps if s]
    assert min(steady) >= 2


def _failed(engine, steps=5):
    """The output of the engine's one request once it fails (it fails alone: step() does not raise)."""
    for _ in range(steps):
        for out in engine.step():
            if out.finished:
                return out
    raise AssertionError("the request did not finish")


def test_bad_proposal_on_the_device_fails_its_request_with_the_host_check_after_the_read(target):
    class BadIds(FeatureDrafter):
        def propose(self, state, gamma, generator=None):
            p = super().propose(state, gamma, generator)
            return Proposal(p.tokens_BK + 10_000, p.probs_BKV)  # ids past the vocabulary

    for paths in (False, True):
        engine = Engine(
            target, drafter=BadIds(), gamma=3, max_num_seqs=2, max_model_len=96, measure_cost=False
        )
        engine.add_request(PROMPTS[0], max_new_tokens=N, temperature=0.8, seed=1)
        with accelerator_paths() if paths else _nothing():
            out = _failed(engine)
        assert out.finish_reason == "error"
        assert re.search(r"tokens_BK must hold token ids in \[0, V=259\)", out.error), out.error
        assert not engine.has_unfinished()


def test_non_finite_logits_on_the_device_fail_their_request_with_the_host_check(target):
    engine = Engine(target, drafter="none", gamma=3, max_num_seqs=2, max_model_len=96, measure_cost=False)
    engine.add_request(PROMPTS[1], max_new_tokens=N, temperature=0.0)
    engine.step()  # prefilled
    forward = target.forward

    def poisoned(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits_BTV[0, -1, 3] = float("nan")
        return out

    target.forward = poisoned
    try:
        with accelerator_paths():
            (out,) = engine.step()
    finally:
        del target.forward
    assert out.finished and out.finish_reason == "error"
    assert "non-finite logits" in out.error, out.error


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_host_transfer_brings_every_part_back_exactly():
    t = HostTransfer("cpu")
    ints = torch.tensor([[3, -1], [2**40, 0]])
    flags = torch.tensor([True, False, True])
    floats = torch.tensor([-0.0, 1e-30, float("-inf"), 0.1], dtype=torch.float32)
    doubles = torch.tensor([np.pi, -2.5e300], dtype=torch.float64)
    for name, part in (("ints", ints), ("flags", flags), ("floats", floats), ("doubles", doubles)):
        t.add(name, part)
    with accelerator_paths():
        got = t.fetch()
    assert np.array_equal(got["ints"], ints.numpy()) and got["ints"].shape == (2, 2)
    assert got["flags"].dtype == bool and got["flags"].tolist() == [True, False, True]
    assert np.array_equal(got["floats"], floats.double().numpy())
    assert np.signbit(got["floats"][0])  # bit-exact: -0.0 stays negative
    assert np.array_equal(got["doubles"], doubles.numpy())
    with pytest.raises(ValueError, match="already in this transfer"):
        t.add("ints", ints)


def test_avoids_host_follows_the_device_and_the_forced_paths():
    x = torch.zeros(2)
    assert not avoids_host(x) and not avoids_host("cpu")
    assert avoids_host(torch.device("cuda")) and avoids_host("meta")
    with accelerator_paths():
        assert avoids_host(x)
    assert not avoids_host(x)


def test_on_cuda_the_counter_counts_the_sync_debug_warnings(monkeypatch):
    """The CUDA mode (``torch.cuda.set_sync_debug_mode("warn")``) with the driver's calls stubbed: each
    synchronising-call warning counts once, other warnings pass through, the mode is restored."""
    import warnings

    modes = ["off"]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: modes.append(mode))
    with pytest.warns(UserWarning, match="unrelated"):
        with count_host_syncs(device="cuda") as syncs:
            assert modes[-1] == "warn"
            for _ in range(3):
                warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
            warnings.warn("unrelated", UserWarning, stacklevel=1)
    assert syncs.count == 3 and modes[-1] == 0
    with pytest.raises(ValueError, match="needs target="):
        with count_host_syncs(device="cpu"):
            pass
