"""Monte-Carlo distribution tests of the real specdec.verify.rejection_sample, and mutation tests
that prove each check can fail.

Legend: B batch, K draft length (γ), V vocabulary, N samples.

Every check compares counts of what the real code emitted with an exact distribution:
- the target's own rows or joint (specdec.testing.target_sequence_distribution: no verifier involved),
- or the exact per-step law of Leviathan et al. 2023 (arXiv 2211.17192, Algorithm 1), enumerated by
  specdec.testing.expected_output_distribution and proven equal to the closed form and to the target
  to 1e-12 in tests/test_verify.py.
The same check then runs on test-local mutants (wrappers around the real code with one planted bug,
never a change to product code) and must reject each of them at the same N and seed.

False-alarm arithmetic (ALPHA, BETA and the sizing N are in tests/_stat_checks.py; DESIGN_TV is
``DESIGN.tv`` of each file) for the statistical suite of specdec.testing (this file,
test_generate_distribution.py, test_tree_distribution.py and the three calibration tests in
tests/test_testing_module.py):
- a check on correct code rejects with probability ALPHA = 1e-6 (the nominal G-test level; the
  measured far-tail rate is ≤ ~1.25 × nominal at our cell sizes, so budget 2e-6 per check);
- a mutation test misses its bug with probability ≤ BETA = 1e-6: N = required_sample_size(DESIGN_TV,
  cells, ALPHA, BETA) guarantees power 1 − BETA against *any* bias of total variation ≥ DESIGN_TV
  (worst direction: χ² non-centrality λ ≥ 4Nδ²). Every planted bug's TV is printed; the smallest
  measured is 0.029 (recovered-from-target seen through (x₀, x₁)), above DESIGN_TV = 0.02 here and
  0.03 in the loop tests, where the planted bug's TV is 0.09;
- each calibration test fails a correct implementation with probability < 1e-6 (binomial tails).
Counting checks (the ragged-prompt test makes two): 17 on correct code and 16 mutation or calibration
tests here and in the generate/calibration files, plus 6 Monte-Carlo checks and 1 mutation test of
tree verification (test_tree_distribution.py): 23 and 17; with the five generate checks of
tests/test_loop.py (two of them through the drafters' confidence stop), 28 and 17. By Bonferroni
(a union bound, no independence assumed) a CI run fails spuriously with probability
≤ 28 × 2e-6 + 17 × 1e-6 = 7.3e-5 < 1e-4. The budget holds up to 30 + 20 such tests.
Seeds are fixed, so each commit's result is reproducible; the probabilities are over seeds.

Every test prints its p-value and worst cells (``pytest -m statistical -rA`` or ``-s`` shows them).
"""

import pytest
import torch
from _stat_checks import Design

from specdec.sampling import SamplingParams, sample_from_probs
from specdec.testing import (
    GoodnessOfFit,
    MarkovModel,
    expected_output_distribution,
    marginalize,
    sample_output_distribution,
    target_sequence_distribution,
    with_generator,
)
from specdec.verify import VerifyResult
from specdec.verify import rejection_sample as keyed_rejection_sample

# The rule with each row's seed drawn from the generator it is handed (specdec.testing.with_generator),
# so the mutants below keep the generator signature of a third party's verifier.
rejection_sample = with_generator(keyed_rejection_sample)

pytestmark = pytest.mark.statistical

DESIGN = Design(tv=0.02)  # smallest total-variation bias every check is sized to catch
sample_size, check = DESIGN.sample_size, DESIGN.check


def expect(result: GoodnessOfFit, exact: bool) -> None:
    if exact:
        assert result.passed, f"the real code failed a distribution test:\n{result}"
    else:
        assert not result.passed, f"a planted bug went undetected:\n{result}"


# --- planted bugs (test-local wrappers around the real code) ---------------------------------------------


def _rejected_rows(num_accepted_B: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = (num_accepted_B < K).nonzero().flatten()
    return rows, num_accepted_B[rows]


def _draft_rows(draft_tokens_BK, draft_probs_BKV, rows, positions, V):
    if draft_probs_BKV is None:
        return torch.nn.functional.one_hot(draft_tokens_BK[rows, positions], V).float()
    return draft_probs_BKV[rows, positions].float()


def recovered_from_target(
    target_probs_BKV, draft_tokens_BK, draft_probs_BKV=None, *, generator=None, validate=True
):
    """Bug: the recovered token is drawn from the target row instead of norm(max(p − q, 0))."""
    tokens, n = rejection_sample(target_probs_BKV, draft_tokens_BK, draft_probs_BKV, generator=generator)
    rows, pos = _rejected_rows(n, draft_tokens_BK.shape[1])
    tokens[rows, pos] = sample_from_probs(target_probs_BKV[rows, pos], generator)
    return VerifyResult(tokens, n)


def bonus_dropped(target_probs_BKV, draft_tokens_BK, draft_probs_BKV=None, *, generator=None, validate=True):
    """Bug: when every draft is accepted, the bonus token is not emitted."""
    tokens, n = rejection_sample(target_probs_BKV, draft_tokens_BK, draft_probs_BKV, generator=generator)
    K = draft_tokens_BK.shape[1]
    tokens[n == K, K] = -1
    return VerifyResult(tokens, n)


def unnormalised_residual(
    target_probs_BKV, draft_tokens_BK, draft_probs_BKV=None, *, generator=None, validate=True
):
    """Bug: max(p − q, 0) is sampled by inverse CDF with a uniform on [0, 1) without dividing by its
    mass 1 − α; the missing mass falls on the last token id."""
    tokens, n = rejection_sample(target_probs_BKV, draft_tokens_BK, draft_probs_BKV, generator=generator)
    V = target_probs_BKV.shape[-1]
    rows, pos = _rejected_rows(n, draft_tokens_BK.shape[1])
    residual = (
        target_probs_BKV[rows, pos].float() - _draft_rows(draft_tokens_BK, draft_probs_BKV, rows, pos, V)
    ).clamp(min=0)
    u = torch.rand(rows.numel(), 1, generator=generator)
    tokens[rows, pos] = torch.searchsorted(residual.cumsum(-1), u, right=True).squeeze(-1).clamp(max=V - 1)
    return VerifyResult(tokens, n)


def ratio_before_top_p(target: MarkovModel, drafter: MarkovModel, sampling: SamplingParams):
    """Bug: the accept test uses p/q computed before top-p (temperature and top-k only); the recovered
    and bonus tokens are drawn from the processed (top-p) rows, as in the real code.

    The wrapper maps each processed row back to its pre-top-p row through a table over the toy
    models' contexts (order-1 models: one row per previous token), checked to be unambiguous."""
    before_top_p = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k)
    contexts = [(x,) for x in range(target.vocab_size)]

    def table(model):
        processed = model.next_token_probs(contexts, sampling).float()
        assert torch.unique(processed, dim=0).shape[0] == len(contexts), "ambiguous processed rows"
        return processed, model.next_token_probs(contexts, before_top_p).float()

    target_table, draft_table = table(target), table(drafter)

    def before(probs, tables):
        processed, raw = tables
        match = (probs.unsqueeze(-2) == processed).all(-1)
        assert (match.sum(-1) == 1).all(), "a row is not in the table"
        return raw[match.float().argmax(-1)]

    def verify(target_probs_BKV, draft_tokens_BK, draft_probs_BKV=None, *, generator=None, validate=True):
        B, K1, V = target_probs_BKV.shape
        K = K1 - 1
        _, n = rejection_sample(
            before(target_probs_BKV, target_table),
            draft_tokens_BK,
            before(draft_probs_BKV, draft_table),
            generator=generator,
        )
        rows = torch.arange(B)
        p_stop = target_probs_BKV[rows, n]
        residual = (p_stop - draft_probs_BKV[rows, n.clamp(max=K - 1)]).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_stop)
        y = sample_from_probs(torch.where((n < K).unsqueeze(-1), residual, p_stop), generator)
        tokens = torch.where(
            torch.arange(K1) < n.unsqueeze(1), torch.cat([draft_tokens_BK, draft_tokens_BK[:, :1]], 1), -1
        )
        tokens[rows, n] = y
        return VerifyResult(tokens, n)

    return verify


REAL = pytest.param(rejection_sample, True, id="real")


def mutant(fn) -> pytest.param:
    return pytest.param(fn, False, id=f"mutant:{fn.__name__}")


# --- the checks -----------------------------------------------------------------------------------------

MARKOV_5 = dict(target=MarkovModel.random(5, seed=31), drafter=MarkovModel.random(5, seed=32))


@pytest.mark.parametrize(
    "verify_fn, exact", [REAL, mutant(recovered_from_target), mutant(unnormalised_residual)]
)
def test_first_token_marginal(verify_fn, exact):
    context = (2,)
    p_V = MARKOV_5["target"].next_token_probs([context])[0]
    expected = {(y,): float(p) for y, p in enumerate(p_V)}
    counts = sample_output_distribution(
        **MARKOV_5, gamma=3, context=context, num_samples=sample_size(expected), verify_fn=verify_fn, seed=1
    )
    expect(check(marginalize(counts, lambda s: s[:1]), expected, "first token"), exact)


MARKOV_3 = dict(target=MarkovModel.random(3, seed=33), drafter=MarkovModel.random(3, seed=34))


@pytest.mark.parametrize(
    "verify_fn, exact",
    [REAL, mutant(recovered_from_target), mutant(bonus_dropped), mutant(unnormalised_residual)],
)
def test_one_step_output_law(verify_fn, exact):
    """Everything one verify call emits (1 .. γ+1 tokens) against the exact Algorithm-1 law: also the
    cross-check of the enumeration (probe) against the Monte-Carlo of the real code."""
    expected = expected_output_distribution(**MARKOV_3, gamma=2, context=(0,))
    counts = sample_output_distribution(
        **MARKOV_3, gamma=2, context=(0,), num_samples=sample_size(expected), verify_fn=verify_fn, seed=2
    )
    expect(check(counts, expected, "one step"), exact)


MARKOV_4 = dict(target=MarkovModel.random(4, seed=35), drafter=MarkovModel.random(4, seed=36))


@pytest.mark.parametrize("verify_fn, exact", [REAL, mutant(recovered_from_target)])
def test_joint_of_first_two_tokens_given_acceptance(verify_fn, exact):
    """(x₀, x₁) when x₀ was an accepted draft: P = min(p, q)(x₀) · P(x₁ | x₀ accepted), the second
    token following its own target row p(· | x₀). Rows whose first draft was rejected form one cell."""

    def key(s):
        return s[:2] if len(s) >= 2 else "first draft rejected"

    expected = marginalize(expected_output_distribution(**MARKOV_4, gamma=2, context=(1,)), key)
    counts = sample_output_distribution(
        **MARKOV_4, gamma=2, context=(1,), num_samples=sample_size(expected), verify_fn=verify_fn, seed=3
    )
    expect(check(marginalize(counts, key), expected, "(x0, x1) | x0 accepted"), exact)


@pytest.mark.parametrize("verify_fn, exact", [REAL, mutant(bonus_dropped)])
def test_bonus_token(verify_fn, exact):
    """(last draft, bonus) when all γ drafts were accepted: the bonus follows p(· | last draft).
    Rows with a rejection form one cell, so a missing bonus cannot hide as 'no samples'."""
    gamma = 2

    def key(s):
        return s[gamma - 1 :] if len(s) == gamma + 1 else "a draft was rejected"

    expected = marginalize(expected_output_distribution(**MARKOV_4, gamma=gamma, context=(3,)), key)
    counts = sample_output_distribution(
        **MARKOV_4, gamma=gamma, context=(3,), num_samples=sample_size(expected), verify_fn=verify_fn, seed=4
    )
    expect(check(marginalize(counts, key), expected, "bonus token"), exact)


@pytest.mark.parametrize(
    "verify_fn, exact", [REAL, mutant(recovered_from_target), mutant(unnormalised_residual)]
)
def test_point_mass_drafts(verify_fn, exact):
    """draft_probs=None (n-gram / greedy drafters): accepted with probability p(x), recovered from p
    with x removed."""
    expected = expected_output_distribution(**MARKOV_4, gamma=3, context=(0,), draft="point_mass")
    counts = sample_output_distribution(
        **MARKOV_4,
        gamma=3,
        context=(0,),
        draft="point_mass",
        num_samples=sample_size(expected),
        verify_fn=verify_fn,
        seed=5,
    )
    expect(check(counts, expected, "point-mass drafts"), exact)


SAMPLINGS = {
    "temperature": SamplingParams(temperature=0.6),
    "top_k": SamplingParams(top_k=2),
    "top_p": SamplingParams(top_p=0.75),
    "all": SamplingParams(temperature=1.4, top_k=4, top_p=0.85),
}
MARKOV_5B = dict(target=MarkovModel.random(5, seed=37), drafter=MarkovModel.random(5, seed=38))


@pytest.mark.parametrize(
    "name, planted",
    [(name, False) for name in SAMPLINGS] + [("top_p", True), ("all", True)],
    ids=[*SAMPLINGS, "mutant:ratio_before_top_p-top_p", "mutant:ratio_before_top_p-all"],
)
def test_temperature_top_k_top_p_on_both_sides(name, planted):
    """Three-token streams with both models' logits processed by logits_to_probs, against the
    target's processed joint (zeros from top-k / top-p must stay zeros)."""
    sampling = SAMPLINGS[name]
    verify_fn = ratio_before_top_p(**MARKOV_5B, sampling=sampling) if planted else rejection_sample
    expected = target_sequence_distribution(
        MARKOV_5B["target"], num_tokens=3, context=(4,), sampling=sampling
    )
    counts = sample_output_distribution(
        **MARKOV_5B,
        gamma=2,
        context=(4,),
        num_tokens=3,
        sampling=sampling,
        num_samples=sample_size(expected),
        verify_fn=verify_fn,
        seed=6,
    )
    expect(check(counts, expected, f"stream, {sampling}"), not planted)


@pytest.mark.parametrize("verify_fn, exact", [REAL, mutant(recovered_from_target)])
def test_stream_of_27_sequences(verify_fn, exact):
    """γ = 2, V = 3, Markov draft and target: the first three tokens over all 27 sequences."""
    expected = target_sequence_distribution(MARKOV_3["target"], num_tokens=3, context=(2,))
    assert len(expected) == 27
    counts = sample_output_distribution(
        **MARKOV_3,
        gamma=2,
        context=(2,),
        num_tokens=3,
        num_samples=sample_size(expected),
        verify_fn=verify_fn,
        seed=7,
    )
    expect(check(counts, expected, "27 sequences"), exact)


def test_batch_rows_are_independent_with_ragged_acceptance():
    """One verify call over 2N rows of two different contexts (different acceptance rates): the
    joint of the two rows' outputs in each pair is the product of their exact one-step laws."""
    target, drafter = MarkovModel.random(3, seed=39), MarkovModel.random(3, seed=40)
    contexts = [(0,), (2,)]
    law_a, law_b = (expected_output_distribution(target, drafter, gamma=1, context=c) for c in contexts)
    expected = {(a, b): pa * pb for a, pa in law_a.items() for b, pb in law_b.items()}
    N = sample_size(expected)
    g = torch.Generator().manual_seed(8)
    kind = torch.arange(2 * N) % 2
    p_first = target.next_token_probs(contexts).float()[kind]
    q = drafter.next_token_probs(contexts).float()[kind]
    x = sample_from_probs(q, g)
    p_next = target.next_token_probs([(v,) for v in range(3)]).float()[x]
    tokens, n = rejection_sample(
        torch.stack([p_first, p_next], 1), x.unsqueeze(1), q.unsqueeze(1), generator=g
    )
    ragged = (n[0::2] != n[1::2]).float().mean().item()
    print(f"pairs with different acceptance: {ragged:.3f}")
    assert ragged > 0.1
    rows = [tuple(t for t in row if t >= 0) for row in tokens.tolist()]
    counts: dict = {}
    for a, b in zip(rows[0::2], rows[1::2], strict=True):
        counts[a, b] = counts.get((a, b), 0) + 1
    expect(check(counts, expected, "batch pairs"), True)
