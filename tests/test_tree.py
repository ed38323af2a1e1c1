"""Token trees and tree verification: structure, edge cases, greedy, and the loop integration.

(The distribution tests are in tests/statistical/test_tree_distribution.py.)
"""

from __future__ import annotations

import pytest
import torch
from _tree_toys import TreeMarkovDrafter, TreeMarkovTarget, tree_randomness

import specdec
from specdec.testing import MarkovModel
from specdec.verify.token_tree import PRESET_TREES, TokenTree
from specdec.verify.tree import tree_greedy_verify, tree_rejection_sample

PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def test_tree_structure():
    t = TokenTree.from_paths(PATHS)
    assert t.parents == (-1, 0, 0, 0, 1, 1, 2, 4)
    assert t.depth == (0, 1, 1, 1, 2, 2, 2, 3)
    assert t.children[0] == (1, 2, 3) and t.children[1] == (4, 5) and t.children[7] == ()
    assert t.main_path == (1, 4, 7)
    m = t.ancestor_mask()
    assert m[7].tolist() == [True, True, False, False, True, False, False, True]
    assert m.diagonal().all() and not m.triu(1).any()
    assert t.children_table().tolist()[1] == [4, 5, -1]
    assert TokenTree.chain(3).parents == (-1, 0, 1, 2)
    assert TokenTree.from_branching([3, 2, 1]).num_nodes == 7
    for preset in PRESET_TREES.values():
        TokenTree.from_paths(preset)


def test_truncate_keeps_a_valid_prefix():
    t = TokenTree.from_paths(PATHS)
    assert t.truncate(1).parents == (-1, 0, 0, 0)
    assert t.truncate(5, 5).parents == (-1, 0, 0, 0, 1)
    assert t.truncate(0).num_nodes == 1
    assert t.truncate(9) is t


@pytest.mark.parametrize(
    "paths, message",
    [
        ([(0, 0)], "no parent"),
        ([(0,), (2,)], "rank 2 needs rank 1"),
        ([()], "non-empty"),
        ([(0,), (-1,)], ">= 0"),
    ],
)
def test_bad_paths_raise(paths, message):
    with pytest.raises(ValueError, match=message):
        TokenTree.from_paths(paths)
    with pytest.raises(ValueError, match="earlier node"):
        TokenTree((-1, 2, 0))


def _random_case(seed: int, B: int = 5, V: int = 6):
    g = torch.Generator().manual_seed(seed)
    tree = TokenTree.from_paths(PATHS)
    N = tree.num_nodes
    target = torch.softmax(torch.randn(B, N, V, generator=g) * 2, -1)
    draft = torch.softmax(torch.randn(B, N, V, generator=g) * 2, -1)
    tokens = torch.randint(0, V, (B, N), generator=g)
    return tree, target, draft, tokens


def test_greedy_fast_path_equals_rejection_sampling_with_one_hot_targets():
    for seed in range(20):
        tree, target, _, _ = _random_case(seed)
        argmax = target.argmax(-1)
        one_hot = torch.zeros_like(target).scatter_(-1, argmax.unsqueeze(-1), 1.0)
        # Candidates: distinct top tokens of some distribution, so matches happen at all depths.
        g = torch.Generator().manual_seed(100 + seed)
        tokens = torch.where(torch.rand(argmax.shape, generator=g) < 0.5, argmax, (argmax + 1) % 6)
        # Distinct siblings: the rank-1 candidate differs from rank 0 (a top-k drafter's output).
        for kids in tree.children:
            for j, c in enumerate(kids):
                if j > 0:
                    tokens[:, c] = (tokens[:, kids[0]] + j) % 6
        fast = tree_greedy_verify(argmax, tree, tokens)
        slow = tree_rejection_sample(one_hot, tree, tokens, None, **tree_randomness(g, tree, tokens.shape[0]))
        assert torch.equal(fast.tokens, slow.tokens) and torch.equal(fast.num_accepted, slow.num_accepted)
        assert torch.equal(fast.path_nodes, slow.path_nodes)
        # Every accepted token is the target's argmax after its parent.
        for b in range(argmax.shape[0]):
            node = 0
            for d in range(int(fast.num_accepted[b])):
                nxt = int(fast.path_nodes[b, d])
                assert tree.parents[nxt] == node and int(tokens[b, nxt]) == int(argmax[b, node])
                node = nxt
            assert int(fast.tokens[b, fast.num_accepted[b]]) == int(argmax[b, node])


def test_output_layout_and_path_consistency():
    tree, target, draft, tokens = _random_case(3, B=64)
    r = tree_rejection_sample(
        target,
        tree,
        tokens,
        draft,
        **tree_randomness(torch.Generator().manual_seed(0), tree, tokens.shape[0]),
    )
    A = tree.max_depth + 1
    assert r.tokens.shape == (64, A) and r.path_nodes.shape == (64, A)
    for b in range(64):
        a = int(r.num_accepted[b])
        assert (r.tokens[b, : a + 1] >= 0).all() and (r.tokens[b, a + 1 :] == -1).all()
        assert (r.path_nodes[b, :a] >= 0).all() and (r.path_nodes[b, a:] == -1).all()
        node = 0
        for d in range(a):
            c = int(r.path_nodes[b, d])
            assert tree.parents[c] == node and int(tokens[b, c]) == int(r.tokens[b, d])
            node = c


def test_equal_target_and_draft_accept_the_first_candidate():
    tree, target, _, tokens = _random_case(4)
    r = tree_rejection_sample(
        target,
        tree,
        tokens,
        target.clone(),
        **tree_randomness(torch.Generator().manual_seed(1), tree, tokens.shape[0]),
    )
    assert (r.path_nodes[:, : tree.max_depth] == torch.tensor(tree.main_path)).all()
    assert (r.num_accepted == tree.max_depth).all()


def test_zero_draft_probability_is_rejected_and_residual_skips_rejected_point_masses():
    tree = TokenTree.from_paths([(0,), (1,)])
    target = torch.tensor([[[0.5, 0.3, 0.2, 0.0]] * 3])
    draft = torch.tensor([[[0.0, 1.0, 0.0, 0.0]] * 3])
    tokens = torch.tensor([[0, 0, 2]])  # candidate 0 has draft prob 0, candidate 2 too (exhausted draft)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        r = tree_rejection_sample(target, tree, tokens, draft, **tree_randomness(g, tree, tokens.shape[0]))
        assert int(r.num_accepted[0]) == 0  # both candidates have draft probability 0
    # Point-mass candidates 0 and 1: a recovered token is never a rejected candidate.
    tokens = torch.tensor([[0, 0, 1]])
    seen = set()
    for _ in range(300):
        r = tree_rejection_sample(target, tree, tokens, None, **tree_randomness(g, tree, tokens.shape[0]))
        if int(r.num_accepted[0]) == 0:
            seen.add(int(r.tokens[0, 0]))
    assert seen == {2}


def test_bad_input_raises():
    tree, target, draft, tokens = _random_case(5)
    with pytest.raises(ValueError, match="tree has 8 nodes"):
        tree_rejection_sample(target[:, :3], tree, tokens, None)
    with pytest.raises(ValueError, match="tokens_BN must lie"):
        tree_rejection_sample(target, tree, tokens + 100, None)
    with pytest.raises(ValueError, match="draft_probs_BNV must be"):
        tree_rejection_sample(target, tree, tokens, draft[:, :, :3])
    with pytest.raises(ValueError, match="non-negative"):
        tree_rejection_sample(-target, tree, tokens, None)


def _assert_greedy_tree_matches_plain(
    model: MarkovModel, tree: TokenTree, mode: str, prompts: list[list[int]], max_new_tokens: int
) -> None:
    """Greedy tree decoding (drafts from ``model`` itself, candidates picked by ``mode``) emits what
    plain greedy decoding emits, and accepts a whole depth-3 path (3 drafts + bonus) every step."""
    ref = specdec.generate(
        TreeMarkovTarget(model),
        prompts,
        drafter="none",
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        ignore_eos=True,
    )
    out = specdec.generate(
        TreeMarkovTarget(model),
        prompts,
        drafter=TreeMarkovDrafter(model, tree, mode=mode),
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        gamma=3,
        ignore_eos=True,
    )
    assert out.token_ids == ref.token_ids
    assert out.metrics.mean_accepted_tokens > 3.5


def test_loop_with_trees_greedy_and_seeded():
    """Through specdec.generate: greedy equals plain decoding, drafts from the target's own model are
    accepted deep into the tree, and a seed fixes the sampled tokens."""
    model = MarkovModel.random(7, order=2, seed=3)
    tree = TokenTree.from_paths(PATHS)
    prompts = [[1, 2, 3], [4], [5, 6]]
    _assert_greedy_tree_matches_plain(model, tree, "top", prompts, 20)  # the draft is the target
    other = MarkovModel.random(7, order=2, seed=4)
    runs = [
        specdec.generate(
            TreeMarkovTarget(model),
            prompts,
            drafter=TreeMarkovDrafter(other, tree),
            max_new_tokens=20,
            temperature=1.0,
            gamma=3,
            seed=9,
            ignore_eos=True,
        )
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].metrics.num_accepted > 0


def test_non_first_candidates_are_accepted_and_compacted():
    """A drafter whose first candidate is always wrong: greedy still matches plain decoding through the
    rank-1 candidates, so the accepted path is scattered in the block and the cache compaction is used."""
    model = MarkovModel.random(7, order=2, seed=5)
    tree = TokenTree.from_paths([(0,), (1,), (1, 0), (1, 1), (1, 1, 0), (1, 1, 1)])
    prompts = [[1, 2], [3]]
    _assert_greedy_tree_matches_plain(model, tree, "second", prompts, 24)  # the whole rank-1 path
