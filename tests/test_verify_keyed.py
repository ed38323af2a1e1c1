"""The keyed rules: rejection_sample (exact) and gumbel (drafter-invariant), and their plugins.

Legend: B batch (requests), K draft length, N tree nodes, V vocabulary, L tokens per request.
"""

from __future__ import annotations

import pytest
import torch

import specdec
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.testing import MarkovModel, keyed_randomness
from specdec.verify import greedy_verify, rejection_sample
from specdec.verify.contract import GreedyVerifyRule, TreeVerifyRule
from specdec.verify.exact import ExactVerify
from specdec.verify.gumbel import GumbelVerify, gumbel_verify, gumbel_verify_tree
from specdec.verify.noise import PositionNoise, draft_keyed, sample_keyed
from specdec.verify.registry import make_verify_rule, verify_chain
from specdec.verify.token_tree import TokenTree, TreeProposal

pytestmark = pytest.mark.usefixtures("one_thread")

V = 7
TARGET = MarkovModel.random(V, seed=71, scale=1.0)
DRAFTER = MarkovModel.random(V, seed=72, scale=1.0)
SAMPLING = SamplingParams(temperature=0.8, top_k=5)


def _table(model: MarkovModel, sampling: SamplingParams = SAMPLING) -> torch.Tensor:
    """float32 ``[V, V]``: the processed row after each previous token (order-1 toys)."""
    return model.next_token_probs([(x,) for x in range(V)], sampling).float()


P, Q = _table(TARGET), _table(DRAFTER)


def _block(last_B: torch.Tensor, draft_tokens_BK: torch.Tensor):
    """Target rows for a chain after ``last``: ``[B, K+1, V]``; drafter rows ``[B, K, V]``."""
    context_BK1 = torch.cat([last_B.unsqueeze(1), draft_tokens_BK], dim=1)
    return P[context_BK1], Q[context_BK1[:, :-1]]


def plain_keyed(noise: PositionNoise, L: int, last: int = 0) -> torch.Tensor:
    """``[B, L]``: plain decoding with sample_keyed, position p = p-th new token."""
    B = noise.num_rows
    last_B = torch.full((B,), last, dtype=torch.long)
    out = []
    for p in range(L):
        last_B = sample_keyed(P[last_B], noise, torch.full((B,), p))
        out.append(last_B)
    return torch.stack(out, 1)


def speculative(noise: PositionNoise, L: int, rule, drafter: str, gen: torch.Generator, last: int = 0):
    """Speculative decoding of every row with its own random depth each step (rows verified one
    depth-group at a time, so batch composition changes every step). Returns ``[B, L]`` and the
    acceptance rate (accepted / drafted)."""
    B = noise.num_rows
    out = torch.full((B, L + 8), -1, dtype=torch.long)
    n_B = torch.zeros(B, dtype=torch.long)
    last_B = torch.full((B,), last, dtype=torch.long)
    drafted = accepted = 0
    while int(n_B.min()) < L:
        depth_B = torch.randint(0, 6, (B,), generator=gen)
        for K in depth_B.unique().tolist():
            rows = ((depth_B == K) & (n_B < L)).nonzero().flatten()
            if rows.numel() == 0:
                continue
            sub, n_R, prev_R = noise.select(rows), n_B[rows], last_B[rows]
            drafts = []
            for k in range(K):
                if drafter == "random":  # anything at all: uniform garbage tokens
                    x_R = torch.randint(0, V, (rows.numel(),), generator=gen)
                elif drafter == "coupled":
                    x_R = draft_keyed(Q[prev_R], sub, n_R + k)
                else:
                    x_R = sample_keyed(Q[prev_R], sub, n_R + k, stream="draft")
                drafts.append(x_R)
                prev_R = x_R
            draft_tokens_RK = (
                torch.stack(drafts, 1) if K else torch.zeros((rows.numel(), 0), dtype=torch.long)
            )
            target_probs_RKV, draft_probs_RKV = _block(last_B[rows], draft_tokens_RK)
            if drafter == "random":
                draft_probs_RKV = None  # point masses
            positions_RK = n_R.unsqueeze(1) + torch.arange(K + 1)
            tokens_RK, num_accepted_R = rule(
                target_probs_RKV, draft_tokens_RK, draft_probs_RKV, noise=sub, positions_BK=positions_RK
            )
            drafted += K * rows.numel()
            accepted += int(num_accepted_R.sum())
            for i, r in enumerate(rows.tolist()):
                m = int(num_accepted_R[i]) + 1
                out[r, n_B[r] : n_B[r] + m] = tokens_RK[i, :m]
                last_B[r] = tokens_RK[i, m - 1]
                n_B[r] += m
    return out[:, :L], accepted / max(drafted, 1)


@pytest.mark.parametrize("drafter", ["random", "independent", "coupled"])
def test_gumbel_output_is_plain_keyed_decoding_for_any_drafter_and_depth(drafter):
    """Drafter invariance (arXiv 2408.07978): token for token, every request's output equals plain
    decoding with the same seed, for random drafts, independent and coupled sampling drafters, at
    random depths per row and step."""
    noise = PositionNoise([5, 2**64 - 1, 0, 77, 123456789, 42, 9, 10])
    L = 24
    plain = plain_keyed(noise, L)
    out, alpha = speculative(noise, L, gumbel_verify, drafter, torch.Generator().manual_seed(3))
    assert torch.equal(out, plain)
    print(f"gumbel, {drafter} drafts: acceptance {alpha:.3f}")


def test_exact_keyed_output_depends_on_seed_and_proposals_only():
    """The keyed exact rule: the same seeds and proposals give the same tokens whatever the batch
    (alone, reordered, beside other rows), and the output changes with the proposals (unlike gumbel)."""
    g = torch.Generator().manual_seed(0)
    B, K = 12, 4
    last_B = torch.randint(0, V, (B,), generator=g)
    drafts_BK = torch.randint(0, V, (B, K), generator=g)
    target_probs, draft_probs = _block(last_B, drafts_BK)
    noise = PositionNoise(list(range(100, 100 + B)))
    positions_BK = torch.randint(0, 1000, (B, 1), generator=g) + torch.arange(K + 1)
    for rule in (rejection_sample, gumbel_verify):
        tokens, n = rule(target_probs, drafts_BK, draft_probs, noise=noise, positions_BK=positions_BK)
        again = rule(target_probs, drafts_BK, draft_probs, noise=noise, positions_BK=positions_BK)
        assert torch.equal(again.tokens, tokens) and torch.equal(again.num_accepted, n)
        for b in range(B):
            alone = rule(
                target_probs[b : b + 1],
                drafts_BK[b : b + 1],
                draft_probs[b : b + 1],
                noise=noise.select([b]),
                positions_BK=positions_BK[b : b + 1],
            )
            assert torch.equal(alone.tokens[0], tokens[b])
        order = torch.randperm(B, generator=g)
        shuffled = rule(
            target_probs[order],
            drafts_BK[order],
            draft_probs[order],
            noise=noise.select(order),
            positions_BK=positions_BK[order],
        )
        assert torch.equal(shuffled.tokens, tokens[order])
    # exact: the first draft of a row gets the same acceptance uniform whatever its other drafts.
    noise1 = PositionNoise([7] * 400)
    first = torch.randint(0, V, (400, 1), generator=g)
    t1, d1 = _block(torch.zeros(400, dtype=torch.long), first)
    u = noise1.uniform_BK(torch.zeros(400, 1, dtype=torch.long), "accept")
    _, n1 = rejection_sample(t1, first, d1, noise=noise1, positions_BK=torch.zeros(400, 2, dtype=torch.long))
    target_at, draft_at = (probs[:, 0].gather(1, first).squeeze(1) for probs in (t1, d1))
    assert torch.equal(n1 == 1, (u[:, 0] * draft_at < target_at) & (draft_at > 0))


def test_exact_keyed_follows_rejection_samplings_rules_on_edge_cases():
    """Point-mass drafts equal to a one-hot target are always accepted and the bonus is the target's
    argmax; a draft the drafter gives no mass is always rejected; draft == target accepts surely; the
    greedy fast path equals the rule on one-hot rows."""
    B, K = 64, 3
    noise = PositionNoise(list(range(B)))
    positions_BK = torch.arange(K + 1).repeat(B, 1)
    logits = torch.randn(B, K + 1, V, generator=torch.Generator().manual_seed(1))
    one_hot = logits_to_probs(logits, 0.0)
    argmax = logits.argmax(-1)
    res = rejection_sample(one_hot, argmax[:, :K], None, noise=noise, positions_BK=positions_BK)
    assert bool((res.num_accepted == K).all()) and torch.equal(res.tokens, argmax)
    drafts = torch.randint(0, V, (B, K), generator=torch.Generator().manual_seed(2))
    greedy = greedy_verify(logits, drafts)
    for rule in (rejection_sample, gumbel_verify):
        res = rule(one_hot, drafts, None, noise=noise, positions_BK=positions_BK)
        assert torch.equal(res.tokens, greedy.tokens) and torch.equal(res.num_accepted, greedy.num_accepted)
    probs = logits_to_probs(logits, 1.0)
    same = rejection_sample(probs, drafts, probs[:, :K], noise=noise, positions_BK=positions_BK)
    assert bool((same.num_accepted == K).all())
    no_mass = probs[:, :K].clone()
    no_mass[torch.arange(B), 0, drafts[:, 0]] = 0.0
    no_mass = no_mass / no_mass.sum(-1, keepdim=True)
    rejected = rejection_sample(probs, drafts, no_mass, noise=noise, positions_BK=positions_BK)
    assert bool((rejected.num_accepted == 0).all())


def _tree_run(
    noise: PositionNoise, L: int, tree: TokenTree, gen: torch.Generator, coupled: bool
) -> torch.Tensor:
    """Speculative decoding with token trees verified by gumbel_verify_tree; node tokens are random,
    or (coupled) the first child of each node is the drafter's keyed sample."""
    B, N = noise.num_rows, tree.num_nodes
    depth_N = torch.tensor(tree.depth)
    out = torch.full((B, L + tree.max_depth + 1), -1, dtype=torch.long)
    n_B = torch.zeros(B, dtype=torch.long)
    last_B = torch.zeros(B, dtype=torch.long)
    while int(n_B.min()) < L:
        tokens_BN = torch.randint(0, V, (B, N), generator=gen)
        tokens_BN[:, 0] = last_B
        if coupled:
            for i in range(1, N):
                parent = tree.parents[i]
                if tree.children[parent][0] == i:
                    tokens_BN[:, i] = draft_keyed(Q[tokens_BN[:, parent]], noise, n_B + depth_N[parent])
        positions_BN = n_B.unsqueeze(1) + depth_N
        res = gumbel_verify_tree(P[tokens_BN], tree, tokens_BN, noise=noise, positions_BN=positions_BN)
        for b in range(B):
            if n_B[b] >= L:
                continue
            m = int(res.num_accepted[b]) + 1
            out[b, n_B[b] : n_B[b] + m] = res.tokens[b, :m]
            path = res.path_nodes[b, : m - 1]
            assert torch.equal(tokens_BN[b, path], res.tokens[b, : m - 1]), (
                "path nodes carry the accepted tokens"
            )
            last_B[b] = res.tokens[b, m - 1]
            n_B[b] += m
    return out[:, :L]


@pytest.mark.parametrize("coupled", [False, True])
def test_gumbel_tree_output_is_plain_keyed_decoding(coupled):
    noise = PositionNoise(list(range(300, 306)))
    tree = TokenTree.from_branching([3, 2, 2])
    out = _tree_run(noise, 20, tree, torch.Generator().manual_seed(4), coupled)
    assert torch.equal(out, plain_keyed(noise, 20))


def test_rules_are_plugins():
    """``gumbel`` is registered, lossless, a tree and greedy rule; without noise a sampled call is refused
    with a message naming noise=; greedy needs none; ExactVerify is keyed rejection sampling."""
    rule = make_verify_rule("gumbel")
    assert isinstance(rule, GumbelVerify) and rule.lossless
    assert isinstance(rule, TreeVerifyRule) and isinstance(rule, GreedyVerifyRule)
    with pytest.raises(ValueError, match="takes no options"):
        make_verify_rule("gumbel", {"lenience": 0.5})
    B, K = 4, 2
    logits = torch.randn(B, K + 1, V, generator=torch.Generator().manual_seed(5))
    drafts = torch.randint(0, V, (B, K), generator=torch.Generator().manual_seed(6))
    probs = logits_to_probs(logits, SAMPLING.temperature, SAMPLING.top_k)
    with pytest.raises(ValueError, match="noise="):
        rule(probs, drafts, None, target_logits_BKV=logits, sampling=SAMPLING)
    greedy = SamplingParams(temperature=0.0)
    expected = greedy_verify(logits, drafts)
    got = verify_chain(rule, logits, drafts, None, sampling=greedy)
    assert torch.equal(got.tokens, expected.tokens)
    noise, positions = PositionNoise([1, 2, 3, 4]), torch.arange(K + 1).repeat(B, 1)
    keyed = rule(
        probs, drafts, None, target_logits_BKV=logits, sampling=SAMPLING, noise=noise, positions_BK=positions
    )
    assert torch.equal(keyed.tokens, gumbel_verify(probs, drafts, noise=noise, positions_BK=positions).tokens)

    exact = ExactVerify()
    plain = exact(
        probs,
        drafts,
        None,
        target_logits_BKV=logits,
        sampling=SAMPLING,
        **keyed_randomness(torch.Generator().manual_seed(9), positions),
    )
    reference = rejection_sample(
        probs, drafts, None, **keyed_randomness(torch.Generator().manual_seed(9), positions)
    )
    assert torch.equal(plain.tokens, reference.tokens)
    keyed = exact(
        probs, drafts, None, target_logits_BKV=logits, sampling=SAMPLING, noise=noise, positions_BK=positions
    )
    assert torch.equal(
        keyed.tokens, rejection_sample(probs, drafts, noise=noise, positions_BK=positions).tokens
    )
    with pytest.raises(ValueError, match="noise="):
        exact(probs, drafts, None, target_logits_BKV=logits, sampling=SAMPLING, noise=noise)
    assert torch.equal(exact.verify_greedy(logits, drafts, None).tokens, expected.tokens)
    tree = TokenTree.from_branching([2, 2])
    proposal = TreeProposal(
        tree, torch.randint(0, V, (B, tree.num_nodes), generator=torch.Generator().manual_seed(7))
    )
    tree_logits = torch.randn(B, tree.num_nodes, V, generator=torch.Generator().manual_seed(8))
    with pytest.raises(ValueError, match="positions_BK"):
        exact.verify_tree(tree_logits, proposal, sampling=SAMPLING, noise=PositionNoise([1, 2, 3, 4]))
    node_positions = torch.tensor(tree.depth).repeat(B, 1)
    # keyed tree rejection sampling: a row's result depends on its own seed and positions only
    keyed_tree = exact.verify_tree(
        tree_logits, proposal, sampling=SAMPLING, noise=noise, positions_BK=node_positions
    )
    for b in range(B):
        alone = exact.verify_tree(
            tree_logits[b : b + 1],
            TreeProposal(tree, proposal.tokens_BN[b : b + 1]),
            sampling=SAMPLING,
            noise=noise.select([b]),
            positions_BK=node_positions[b : b + 1],
        )
        assert torch.equal(alone.tokens, keyed_tree.tokens[b : b + 1])
    tree_result = rule.verify_tree(
        tree_logits, proposal, sampling=SAMPLING, noise=noise, positions_BK=node_positions
    )
    assert tree_result.tokens.shape == (B, tree.max_depth + 1)


def test_generate_accepts_gumbel_in_greedy_runs():
    """Through today's loop (which passes no noise): a greedy run with verify="gumbel" equals "exact"."""
    target = TARGET.as_target()
    kwargs = dict(drafter=DRAFTER.as_drafter(), max_new_tokens=8, temperature=0.0, gamma=3, ignore_eos=True)
    gumbel = specdec.generate(target, [[1, 2], [3]], verify="gumbel", **kwargs)
    exact = specdec.generate(TARGET.as_target(), [[1, 2], [3]], verify="exact", **kwargs)
    assert gumbel.token_ids == exact.token_ids


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(noise=PositionNoise([1])), "noise has 1 rows"),
        (dict(positions_BK=torch.zeros(2, 2, dtype=torch.long)), "positions_BK must be a tensor"),
        (dict(positions_BK=torch.full((2, 3), -1)), "must be >= 0"),
        (dict(positions_BK=torch.zeros(2, 3)), "integer tensor"),
        (dict(noise="seed"), "PositionNoise"),
    ],
)
def test_bad_keyed_input_raises_value_error_naming_it(kwargs, match):
    probs = torch.full((2, 3, V), 1 / V)
    drafts = torch.zeros(2, 2, dtype=torch.long)
    args = dict(noise=PositionNoise([1, 2]), positions_BK=torch.zeros(2, 3, dtype=torch.long)) | kwargs
    for rule in (rejection_sample, gumbel_verify):
        with pytest.raises(ValueError, match=match):
            rule(probs, drafts, None, **args)
