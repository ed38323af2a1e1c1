"""A verification rule owns its greedy path and its tree policy (the blocks only call it).

Legend: B batch, K draft length, N tree nodes, V vocabulary.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from _stat_checks import assert_tokens_follow
from _tiny import TableTarget, random_table
from _tree_toys import TreeMarkovDrafter, TreeMarkovTarget, tree_randomness

import specdec
import specdec.verify.registry as verify_rules
from specdec.sampling import SamplingParams
from specdec.testing import MarkovModel
from specdec.verify import VerifyResult, greedy_verify
from specdec.verify.contract import GreedyVerifyRule, TreeVerifyRule
from specdec.verify.exact import ExactVerify
from specdec.verify.lenient import (
    LenientVerify,
    lenient_sample,
    lenient_tree_greedy,
    lenient_tree_sample,
)
from specdec.verify.registry import verify_chain, verify_tree
from specdec.verify.rule import Rule
from specdec.verify.token_tree import TokenTree, TreeProposal
from specdec.verify.tree import tree_rejection_sample

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0.0)
PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


class CountingExact(ExactVerify):
    """The exact rule, counting the calls it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __call__(self, *args, **kwargs) -> VerifyResult:
        self.calls += 1
        return super().__call__(*args, **kwargs)


class RejectEverything(ExactVerify):
    """A (greedy-only) rule that rejects every draft: the recovered token is the target's argmax."""

    def __call__(self, target_probs_BKV, draft_tokens_BK, draft_probs_BKV, **kwargs) -> VerifyResult:
        B, K1, _ = target_probs_BKV.shape
        tokens_BK1 = torch.full((B, K1), -1, dtype=torch.long)
        tokens_BK1[:, 0] = target_probs_BKV[:, 0].argmax(dim=-1)
        return VerifyResult(tokens_BK1, torch.zeros(B, dtype=torch.long))


class ChainOnly:
    """A lossless rule without a tree policy."""

    lossless = True

    def __call__(self, target_probs_BKV, draft_tokens_BK, draft_probs_BKV, **kwargs) -> VerifyResult:
        return ExactVerify()(target_probs_BKV, draft_tokens_BK, draft_probs_BKV, **kwargs)

    def __repr__(self) -> str:
        return "ChainOnly()"


def _greedy_run(verify, **kw):
    target = TableTarget(random_table(13, seed=4))
    options = dict(drafter="ngram", gamma=3, max_new_tokens=24, temperature=0.0, ignore_eos=True)
    return specdec.generate(target, [[1, 2, 3, 1, 2, 3, 1, 2]], verify=verify, **{**options, **kw})


# --- chains: the greedy fast path is the rule's --------------------------------------------------------


def test_a_subclass_that_overrides_call_is_called_in_greedy_runs():
    exact = _greedy_run("exact")
    counting = CountingExact()
    counted = _greedy_run(counting)
    assert counting.calls > 0  # once per speculative step (the isinstance shortcut skipped it)
    assert counted.token_ids == exact.token_ids
    rejecting = _greedy_run(RejectEverything())
    assert rejecting.token_ids == exact.token_ids  # still greedy text: the recovered token is the argmax
    assert exact.metrics.num_accepted > 0 and rejecting.metrics.num_accepted == 0  # its result was used


def test_exact_greedy_fast_path_needs_no_probabilities(monkeypatch):
    """The exact rule answers greedy point-mass chains from the logits: no [B, K+1, V] one-hot."""
    g = torch.Generator().manual_seed(0)
    logits_BKV = torch.randn(4, 4, 9, generator=g)
    tokens_BK = torch.where(torch.rand(4, 3, generator=g) < 0.6, logits_BKV[:, :3].argmax(-1), 0)

    def no_probs(*args, **kwargs):
        raise AssertionError("sampling_probs called on the greedy fast path")

    monkeypatch.setattr(verify_rules, "sampling_probs", no_probs)
    got = verify_chain(ExactVerify(), logits_BKV, tokens_BK, None, sampling=GREEDY)
    want = greedy_verify(logits_BKV, tokens_BK)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.num_accepted, want.num_accepted)
    with pytest.raises(AssertionError, match="sampling_probs"):  # a subclass's own rule runs instead
        verify_chain(CountingExact(), logits_BKV, tokens_BK, None, sampling=GREEDY)


def test_verify_greedy_contract():
    g = torch.Generator().manual_seed(1)
    logits_BKV = torch.randn(3, 3, 7, generator=g)
    tokens_BK = torch.randint(0, 7, (3, 2), generator=g)
    draft_BKV = torch.softmax(torch.randn(3, 2, 7, generator=g), -1)
    exact = ExactVerify()
    assert isinstance(exact, GreedyVerifyRule) and isinstance(exact, TreeVerifyRule)
    assert exact.verify_greedy(logits_BKV, tokens_BK, None).tokens.equal(
        greedy_verify(logits_BKV, tokens_BK).tokens
    )
    assert exact.verify_greedy(logits_BKV, tokens_BK, draft_BKV) is None  # then __call__ on one-hots
    assert CountingExact().verify_greedy(logits_BKV, tokens_BK, None) is None

    class OwnFastPath(CountingExact):
        def verify_greedy(self, target_logits_BKV, draft_tokens_BK, draft_probs_BKV):
            return greedy_verify(target_logits_BKV, draft_tokens_BK)

    own = OwnFastPath()
    verify_chain(own, logits_BKV, tokens_BK, None, sampling=GREEDY)
    assert own.calls == 0  # a rule that overrides both keeps its own fast path
    # With draft probabilities, the exact rule is called on one-hot targets: same tokens as the argmax.
    counting = CountingExact()
    with_probs = verify_chain(counting, logits_BKV, tokens_BK, draft_BKV, sampling=GREEDY)
    assert counting.calls == 1
    assert torch.equal(with_probs.tokens, greedy_verify(logits_BKV, tokens_BK).tokens)


# --- trees: the tree policy is the rule's ----------------------------------------------------------


def _tree_run(verify, *, temperature: float, drafter_seed: int = 4, mode: str = "without", **kw):
    model = MarkovModel.random(7, order=2, seed=3)
    tree = TokenTree.from_paths(PATHS)
    drafter = TreeMarkovDrafter(MarkovModel.random(7, order=2, seed=drafter_seed), tree, mode=mode)
    return specdec.generate(
        TreeMarkovTarget(model),
        [[1, 2, 3], [4], [5, 6]],
        drafter=drafter,
        max_new_tokens=20,
        temperature=temperature,
        gamma=3,
        seed=None if temperature == 0 else 9,
        ignore_eos=True,
        verify=verify,
        **kw,
    )


def test_a_rule_without_a_tree_policy_is_refused_by_name():
    with pytest.raises(ValueError, match=r"verification rule ChainOnly\(\) has no tree policy"):
        _tree_run(ChainOnly(), temperature=0.0)
    proposal = TreeProposal(TokenTree.chain(1), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="no verify_tree method"):
        verify_tree(ChainOnly(), torch.zeros(1, 2, 5), proposal, sampling=GREEDY)


def test_the_lossy_lenient_rule_runs_on_a_tree_drafter():
    # Greedy, the drafter is the target's own top-k: the argmax child is always taken, as exact greedy.
    plain = _tree_run("exact", temperature=0.0, drafter_seed=3, mode="top")
    loose = _tree_run(LenientVerify(lenience=0.05), temperature=0.0, drafter_seed=3, mode="top")
    assert loose.token_ids == plain.token_ids
    # Greedy with another model's tree: more accepted than under exact greedy verification.
    exact = _tree_run("exact", temperature=0.0, mode="top")
    lenient = _tree_run(LenientVerify(lenience=0.05), temperature=0.0, mode="top")
    assert lenient.metrics.acceptance_rate > exact.metrics.acceptance_rate
    assert all(len(row) == 20 for row in lenient.token_ids)
    # Sampled: seeded, and l = 1 is the exact rule token for token (both draw the same keyed noise).
    runs = [_tree_run("lenient", temperature=1.0, verify_options={"lenience": 0.1}) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].metrics.acceptance_rate > _tree_run(ExactVerify(), temperature=1.0).metrics.acceptance_rate
    same = _tree_run("lenient", temperature=1.0, verify_options={"lenience": 1.0})
    assert same.token_ids == _tree_run(ExactVerify(), temperature=1.0).token_ids


def test_a_new_rule_is_one_class_on_the_shared_walks():
    """A rule that only sets the acceptance hook (``draft_scale``) verifies chains and trees through the
    shared walks: at 0.1 it is the lenient rule's sampled policy token for token."""

    class Scaled(Rule):
        name = "scaled"
        lossless = False
        draft_scale = 0.1

    tree_runs = [_tree_run(rule, temperature=1.0) for rule in (Scaled(), LenientVerify(lenience=0.1))]
    assert tree_runs[0].token_ids == tree_runs[1].token_ids
    chain = dict(drafter="ngram", gamma=3, max_new_tokens=24, temperature=0.8, seed=11, ignore_eos=True)
    target = TableTarget(random_table(13, seed=4))
    chain_runs = [
        specdec.generate(target, [[1, 2, 3, 1, 2, 3, 1, 2]], verify=rule, **chain)
        for rule in (Scaled(), LenientVerify(lenience=0.1))
    ]
    assert chain_runs[0].token_ids == chain_runs[1].token_ids
    assert chain_runs[0].metrics.num_accepted > 0


@pytest.mark.parametrize("kind", ["with", "without", "point"])
def test_the_lenient_tree_walk_at_l_1_is_the_exact_tree_rule(kind):
    g = torch.Generator().manual_seed(7)
    tree = TokenTree.from_paths(PATHS)
    B, N, V = 64, tree.num_nodes, 6
    target = torch.softmax(torch.randn(B, N, V, generator=g) * 2, -1)
    draft = None if kind == "point" else torch.softmax(torch.randn(B, N, V, generator=g) * 2, -1)
    tokens = torch.randint(0, V, (B, N), generator=g)
    replacement = kind == "with"
    exact = tree_rejection_sample(
        target,
        tree,
        tokens,
        draft,
        replacement=replacement,
        **tree_randomness(torch.Generator().manual_seed(3), tree, B),
    )
    walk = lenient_tree_sample(
        target,
        tree,
        tokens,
        draft,
        lenience=1.0,
        replacement=replacement,
        **tree_randomness(torch.Generator().manual_seed(3), tree, B),
    )
    for a, b in zip(exact, walk, strict=True):
        assert torch.equal(a, b)


def test_lenient_tree_greedy_on_a_chain_is_the_chain_rule():
    g = torch.Generator().manual_seed(5)
    B, K, V = 32, 4, 9
    logits = torch.randn(B, K + 1, V, generator=g)
    # Drafts: the argmax or the runner-up, so both sides of the threshold occur.
    top2 = logits[:, :K].topk(2, dim=-1).indices
    tokens_BK = torch.where(torch.rand(B, K, generator=g) < 0.5, top2[..., 0], top2[..., 1])
    tokens_BN = torch.cat([torch.zeros(B, 1, dtype=torch.long), tokens_BK], dim=1)
    one_hot = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    for lenience in (0.9, 0.5, 0.2):
        chain = lenient_sample(
            one_hot, tokens_BK, None, lenience=lenience, target_logits_BKV=logits, greedy=True
        )
        tree = lenient_tree_greedy(logits, TokenTree.chain(K), tokens_BN, lenience=lenience)
        assert torch.equal(chain.num_accepted, tree.num_accepted), lenience
        assert torch.equal(chain.tokens, tree.tokens), lenience
        assert 0 < int(tree.num_accepted.sum()) < B * K


def test_lenient_tree_greedy_takes_the_most_likely_passing_child():
    # Root's raw distribution: p = softmax(log([0.5, 0.3, 0.2])); children drafted 2, 1 (in that order).
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]]))
    tree = TokenTree.from_paths([(0,), (1,)])
    tokens = torch.tensor([[0, 2, 1]])
    out = lenient_tree_greedy(logits, tree, tokens, lenience=0.3)  # both pass (0.3, 0.2 ≥ 0.15): take 1
    assert out.path_nodes[0].tolist() == [2, -1] and out.tokens[0].tolist() == [1, 0]
    out = lenient_tree_greedy(logits, tree, tokens, lenience=0.5)  # only 0.3 ≥ 0.25 passes
    assert out.path_nodes[0].tolist() == [2, -1]
    out = lenient_tree_greedy(logits, tree, tokens, lenience=0.7)  # none passes: the argmax, 0
    assert out.num_accepted.tolist() == [0] and out.tokens[0].tolist() == [0, -1]
    with pytest.raises(ValueError, match="lenience"):
        lenient_tree_greedy(logits, tree, tokens, lenience=0.0)
    with pytest.raises(ValueError, match="tree has 3 nodes"):
        lenient_tree_sample(logits[:, :2].softmax(-1), tree, tokens[:, :2], lenience=0.5)


def _node_law(target, draft, k: int, lenience: float, replacement: bool) -> torch.Tensor:
    """Exact law of the token a node emits with k candidates drawn from ``draft`` (enumerated)."""
    V = target.shape[0]
    law = torch.zeros(V, dtype=torch.float64)

    def walk(residual, q, depth, weight):
        if depth == k:
            law.add_(weight * residual)
            return
        for c in range(V):
            if q[c] == 0:
                continue
            accept = min(1.0, float(residual[c] / (lenience * q[c])))
            law[c] += weight * q[c] * accept
            if accept < 1:
                nxt = (residual - lenience * q).clamp(min=0)
                nxt = nxt / nxt.sum() if nxt.sum() > 0 else residual
                q_next = q if replacement else q.clone().index_fill_(0, torch.tensor([c]), 0.0)
                q_next = q_next / q_next.sum() if q_next.sum() > 0 else q_next
                walk(nxt, q_next, depth + 1, weight * q[c] * (1 - accept))

    walk(target, draft, 0, 1.0)
    return law


@pytest.mark.statistical
@pytest.mark.parametrize("replacement", [True, False])
def test_lenient_tree_node_law_and_the_target_over_l_bound(replacement):
    """Monte-Carlo of the first emitted token of a node with 3 candidates against the enumerated law;
    the guarantee P(x) ≤ target(x)/l; the rule is lossy. G-test with false-alarm rate 1e-6."""
    V, B, k, lenience = 5, 120_000, 3, 0.5
    g = torch.Generator().manual_seed(11 + replacement)
    target = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, -1)
    draft = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2.5, -1)
    tree = TokenTree.from_paths([(i,) for i in range(k)])
    kids = torch.multinomial(draft.float().expand(B, V), k, replacement=replacement, generator=g)
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), kids], dim=1)
    target_BNV = target.float().expand(B, k + 1, V)
    draft_BNV = draft.float().expand(B, k + 1, V)
    out = lenient_tree_sample(
        target_BNV,
        tree,
        tokens,
        draft_BNV,
        lenience=lenience,
        replacement=replacement,
        **tree_randomness(g, tree, B),
    )
    law = _node_law(target, draft, k, lenience, replacement)
    assert abs(float(law.sum()) - 1) < 1e-9
    assert torch.all(law <= target / lenience + 1e-12)  # rare tokens stay rare
    assert not torch.allclose(law, target, atol=1e-2)  # and the rule is lossy
    assert_tokens_follow(out.tokens[:, 0], law, f"replacement={replacement}")


def test_lenient_node_law_bound_holds_for_many_random_cases():
    """The module doc's induction, checked on the enumerated law: P(x) ≤ target(x)/l."""
    g = torch.Generator().manual_seed(0)
    for trial, (k, lenience, replacement) in enumerate(
        itertools.product((1, 2, 3), (0.8, 0.3, 0.05), (True, False))
    ):
        V = 4
        target = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * (1 + trial % 3), -1)
        draft = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, -1)
        law = _node_law(target, draft, k, lenience, replacement)
        assert abs(float(law.sum()) - 1) < 1e-9 and torch.all(law <= target / lenience + 1e-12), trial
