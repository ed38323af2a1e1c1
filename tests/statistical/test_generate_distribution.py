"""Distribution tests of the whole specdec.generate loop on tiny Markov "models".

Legend: B batch (one independent sample per row), V vocabulary.

The target is an order-2 Markov model behind the Target protocol (specdec.testing.MarkovTarget): its
next-token row depends on the last *two* tokens, the earlier one read from its own positional cache,
and it raises on protocol violations. A loop that feeds a block at the wrong position, rolls the
cache back to the wrong length or commits the wrong tokens therefore changes the distribution (or
fails loudly). The drafter is a different, order-1 Markov model behind the Drafter protocol. Each row
of one generate call is one sample of a complete continuation (cut at EOS or max_new_tokens), checked
against the target's own joint over all continuations (enumerated by the chain rule, no verifier).

False-alarm arithmetic: see tests/statistical/test_verify_distribution.py (same ALPHA = BETA = 1e-6
per check; these checks count in the same suite budget). The loop is slower per sample than a bare
verify call, so these checks are sized for DESIGN_TV = 0.03.
"""

import pytest
from _stat_checks import Design

import specdec.verify.rule
from specdec import generate
from specdec.testing import (
    MarkovModel,
    sample_output_distribution,
    target_sequence_distribution,
)
from specdec.verify import VerifyResult, rejection_sample
from specdec.verify.noise import sample_keyed

pytestmark = pytest.mark.statistical

DESIGN = Design(tv=0.03)
sample_size, check = DESIGN.sample_size, DESIGN.check
EOS = 3

TARGET = MarkovModel.random(4, order=2, seed=51, eos_token_ids=(EOS,))
DRAFTER = MarkovModel.random(4, order=1, seed=52)


CASES = {
    "sampled-drafter": dict(drafter=DRAFTER, draft="sample", gamma=2, sampling={}),
    "none-drafter": dict(drafter="none", draft="sample", gamma=2, sampling={}),
    "point-mass-drafter+filters": dict(
        drafter=DRAFTER, draft="point_mass", gamma=3, sampling=dict(temperature=1.5, top_k=3, top_p=0.9)
    ),
    "adaptive-gamma": dict(drafter=DRAFTER, draft="sample", gamma="auto", sampling=dict(temperature=1.2)),
}


@pytest.mark.slow  # 5-7 s a case on 2 cores
@pytest.mark.parametrize("case", list(CASES))
def test_generate_continuations_follow_the_target(case):
    from specdec.sampling import SamplingParams

    c = CASES[case]
    sampling = SamplingParams(**c["sampling"])
    prompt, max_new_tokens = (1, 2), 3
    expected = target_sequence_distribution(
        TARGET, num_tokens=max_new_tokens, context=prompt, sampling=sampling, eos_token_ids=(EOS,)
    )
    counts = sample_output_distribution(
        TARGET,
        c["drafter"],
        gamma=c["gamma"],
        context=prompt,
        num_tokens=max_new_tokens,
        draft=c["draft"],
        sampling=sampling,
        eos_token_ids=(EOS,),
        num_samples=sample_size(expected),
        via="generate",
        seed=11,
    )
    assert check(counts, expected, f"generate, {case}").passed


@pytest.mark.slow  # about 11 s on 2 cores
def test_generate_with_ragged_prompts_in_one_batch():
    """Rows with prompts of different lengths share one batch (ragged prefill and acceptance): each
    prompt's continuations follow the target given that prompt."""
    prompts = [(1, 2), (2, 0, 1, 1)]
    expected = [
        target_sequence_distribution(TARGET, num_tokens=3, context=p, eos_token_ids=(EOS,)) for p in prompts
    ]
    N = max(sample_size(e) for e in expected)
    out = generate(
        TARGET.as_target(),
        [list(prompts[b % 2]) for b in range(2 * N)],
        drafter=DRAFTER.as_drafter(),
        max_new_tokens=3,
        gamma=2,
        seed=12,
        eos_token_ids=[EOS],
    )
    for which, exp in enumerate(expected):
        counts: dict = {}
        for row in out.token_ids[which::2]:
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
        assert check(counts, exp, f"ragged prompts, prompt {prompts[which]}").passed


def _recovered_from_target(
    target_probs_BKV,
    draft_tokens_BK,
    draft_probs_BKV=None,
    *,
    noise,
    positions_BK,
    draft_scale=1.0,
    validate=True,
):
    """Planted bug: the recovered token is drawn from the target row instead of the residual."""
    tokens, n = rejection_sample(
        target_probs_BKV,
        draft_tokens_BK,
        draft_probs_BKV,
        noise=noise,
        positions_BK=positions_BK,
        draft_scale=draft_scale,
    )
    rows = (n < draft_tokens_BK.shape[1]).nonzero().flatten()
    tokens[rows, n[rows]] = sample_keyed(
        target_probs_BKV[rows, n[rows]], noise.select(rows), positions_BK[rows, n[rows]], stream="residual"
    )
    return VerifyResult(tokens, n)


@pytest.mark.slow  # about 6 s on 2 cores
def test_generate_check_rejects_a_planted_verifier_bug(monkeypatch):
    """The loop check can fail: with the engine's verifier swapped for a mutant (test-local patch of
    the name the engine's default keyed ``exact`` rule calls, product code untouched) the same check
    at the same N rejects."""
    monkeypatch.setattr(specdec.verify.rule, "rejection_sample", _recovered_from_target)
    c = CASES["sampled-drafter"]
    expected = target_sequence_distribution(TARGET, num_tokens=3, context=(1, 2), eos_token_ids=(EOS,))
    counts = sample_output_distribution(
        TARGET,
        c["drafter"],
        gamma=c["gamma"],
        context=(1, 2),
        num_tokens=3,
        eos_token_ids=(EOS,),
        num_samples=sample_size(expected),
        via="generate",
        seed=11,
    )
    assert not check(counts, expected, "generate, mutant: recovered_from_target").passed
