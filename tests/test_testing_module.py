"""Tests of specdec.testing itself: the probe can fail, the goodness-of-fit test is calibrated, the
power helper is honest, the toy models obey the engine protocols.

Legend: B batch, K draft length (γ), V vocabulary.

The Monte-Carlo calibration tests are marked ``statistical``; they count in the suite's false-alarm
budget (tests/statistical/test_verify_distribution.py explains it): each is built so that a correct
implementation fails it with probability < 1e-6.
"""

import functools
from collections import Counter

import numpy as np
import pytest
import torch

from specdec.protocols import DecodeState, Drafter, Target
from specdec.sampling import SamplingParams, sample_from_probs
from specdec.testing import (
    MarkovDrafter,
    MarkovModel,
    MarkovTarget,
    PositionalModel,
    ProbeError,
    assert_same_distribution,
    detection_power,
    expected_output_distribution,
    goodness_of_fit,
    marginalize,
    required_sample_size,
    sample_output_distribution,
    target_sequence_distribution,
    total_variation,
    verifier_step_law,
)
from specdec.verify import rejection_sample

pytestmark = pytest.mark.usefixtures("one_thread")


def _max_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


# --- a probe-able verifier with switchable bugs (test-local, written like specdec.verify) -------------


def reference_verify(target_probs_BKV, draft_tokens_BK, draft_probs_BKV=None, *, generator=None, bug=None):
    """A second, plain implementation of chain rejection sampling, with optional planted bugs."""
    B, K1, V = target_probs_BKV.shape
    K = K1 - 1
    rows_B = torch.arange(B)
    u_BK = torch.rand((B, K), generator=generator)
    if bug == "upside_down":  # accept iff u > 1 - p/q: the right probability, not the form u < t
        u_BK = 1.0 - u_BK
    p_at_BK = target_probs_BKV[:, :K].gather(-1, draft_tokens_BK.unsqueeze(-1)).squeeze(-1)
    if draft_probs_BKV is None:
        draft_probs_BKV = torch.nn.functional.one_hot(draft_tokens_BK, V).to(target_probs_BKV.dtype)
    q_at_BK = draft_probs_BKV.gather(-1, draft_tokens_BK.unsqueeze(-1)).squeeze(-1)
    if bug == "ratio_inverted":  # accept with min(1, q/p)
        accepted_BK = (u_BK * p_at_BK < q_at_BK) & (p_at_BK > 0)
    else:
        accepted_BK = (u_BK * q_at_BK < p_at_BK) & (q_at_BK > 0)
    n_B = accepted_BK.long().cumprod(-1).sum(-1)
    p_stop_BV = target_probs_BKV[rows_B, n_B]
    if bug == "bonus_from_last_draft_position":
        p_stop_BV = target_probs_BKV[rows_B, n_B.clamp(max=max(K - 1, 0))]
    residual_BV = (p_stop_BV - draft_probs_BKV[rows_B, n_B.clamp(max=max(K - 1, 0))]).clamp(min=0)
    if bug == "recovered_from_target":
        residual_BV = p_stop_BV
    empty_B = residual_BV.sum(-1) <= 0
    residual_BV = torch.where(empty_B.unsqueeze(-1), p_stop_BV, residual_BV)
    stop_BV = torch.where((n_B < K).unsqueeze(-1), residual_BV, p_stop_BV)
    y_B = sample_from_probs(stop_BV, generator)
    tokens_BK1 = torch.full((B, K1), -1, dtype=torch.long)
    tokens_BK1[:, :K] = torch.where(torch.arange(K) < n_B.unsqueeze(1), draft_tokens_BK, -1)
    tokens_BK1[rows_B, n_B] = y_B
    if bug == "bonus_dropped":
        tokens_BK1[n_B == K, K] = -1
    return tokens_BK1, n_B


def _buggy(bug):
    def verify(*args, **kwargs):
        return reference_verify(*args, bug=bug, **kwargs)

    return verify


MODELS = dict(target=MarkovModel.random(3, order=1, seed=21), drafter=MarkovModel.random(3, order=1, seed=22))


def test_probe_reads_the_same_law_from_two_implementations():
    kw = dict(gamma=2, context=(1,))
    real = expected_output_distribution(**MODELS, **kw)
    ours = expected_output_distribution(**MODELS, **kw, verify_fn=_buggy(None))
    assert _max_diff(real, ours) < 1e-12
    stream = expected_output_distribution(**MODELS, **kw, num_tokens=3, verify_fn=_buggy(None))
    assert (
        _max_diff(stream, target_sequence_distribution(MODELS["target"], num_tokens=3, context=(1,))) < 1e-12
    )


@pytest.mark.parametrize("bug", ["recovered_from_target", "ratio_inverted", "bonus_from_last_draft_position"])
def test_exact_check_fails_on_planted_bugs(bug):
    joint = target_sequence_distribution(MODELS["target"], num_tokens=3, context=(1,))
    stream = expected_output_distribution(
        **MODELS, gamma=2, context=(1,), num_tokens=3, verify_fn=_buggy(bug)
    )
    assert total_variation(stream, joint) > 1e-3


def test_dropping_the_bonus_is_seen_per_step_not_in_the_stream():
    kw = dict(gamma=2, context=(1,))
    real = expected_output_distribution(**MODELS, **kw)
    dropped = expected_output_distribution(**MODELS, **kw, verify_fn=_buggy("bonus_dropped"))
    assert total_variation(real, dropped) > 0.1
    assert max(len(s) for s in dropped) == 2
    # A loop that drops the bonus only wastes it: the stream still follows the target exactly,
    # which is why the statistical suite tests the per-step law as well as the stream.
    stream = expected_output_distribution(**MODELS, **kw, num_tokens=3, verify_fn=_buggy("bonus_dropped"))
    assert (
        _max_diff(stream, target_sequence_distribution(MODELS["target"], num_tokens=3, context=(1,))) < 1e-12
    )


def test_probe_refuses_verifiers_it_cannot_evaluate():
    p = torch.full((1, 2, 3), 1 / 3, dtype=torch.float64)
    x = torch.zeros((1, 1), dtype=torch.long)
    with pytest.raises(ProbeError):
        verifier_step_law(p, x, verify_fn=functools.partial(rejection_sample, validate=True))

    def draws_twice(target_probs_BKV, draft_tokens_BK, draft_probs_BKV=None, *, generator=None):
        out = reference_verify(target_probs_BKV, draft_tokens_BK, draft_probs_BKV, generator=generator)
        sample_from_probs(target_probs_BKV[:, 0], generator)
        return out

    with pytest.raises(ProbeError, match="sample_from_probs 2 times"):
        verifier_step_law(p, x, verify_fn=draws_twice)

    with pytest.raises(ProbeError, match="not a threshold"):
        p = torch.tensor([[[0.2, 0.5, 0.3], [1 / 3] * 3]], dtype=torch.float64)
        verifier_step_law(
            p, x, torch.full((1, 1, 3), 1 / 3, dtype=torch.float64), verify_fn=_buggy("upside_down")
        )


def test_verifier_step_law_paths_sum_to_one_and_dedup_rows():
    p = torch.softmax(
        torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64), -1
    )
    q = torch.softmax(
        torch.randn(4, 2, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64), -1
    )
    x = torch.tensor([[0, 1], [2, 3], [0, 1], [4, 4]])
    p[2], q[2] = p[0], q[0]  # rows 0 and 2 identical
    laws = verifier_step_law(p, x, q)
    assert len(laws) == 4
    for law in laws:
        assert sum(o.probability for o in law) == pytest.approx(1.0, abs=1e-12)
        for o in law:
            assert sum(o.emitted().values()) == pytest.approx(o.probability, abs=1e-12)
    assert laws[0] is laws[2]


# --- goodness of fit ---------------------------------------------------------------------------------


def test_zero_probability_cells_fail_with_a_single_sample():
    expected = {"a": 0.5, "b": 0.5, "c": 0.0}
    r = goodness_of_fit(Counter(a=5000, b=5000, c=1), expected)
    assert not r.passed and r.p_value == 0.0 and r.impossible[0].outcome == "c"
    r = goodness_of_fit(Counter(a=5000, b=5000, d=1), expected)  # an outcome expected never names
    assert not r.passed and r.impossible[0].outcome == "d"
    with pytest.raises(AssertionError, match="zero-probability cells"):
        assert_same_distribution(Counter(a=10, b=10, c=1), expected)


def test_small_cells_are_pooled_and_the_report_names_the_worst_cells():
    expected = {i: 0.92 / 5 for i in range(5)} | {10 + i: 0.08 / 20 for i in range(20)}
    counts = Counter({i: 184 for i in range(5)}) + Counter({10 + i: 4 for i in range(20)})
    r = goodness_of_fit(counts, expected)
    assert r.num_pooled == 20 and r.dof == 5 and r.passed
    biased = counts + Counter({3: 116})
    with pytest.raises(AssertionError) as err:
        assert_same_distribution(biased, expected, alpha=1e-6, label="demo")
    report = str(err.value)
    assert "[demo] FAIL" in report and "p = " in report and "3: 300 / " in report


def test_goodness_of_fit_accepts_sequences_and_both_methods():
    probs = [0.2, 0.3, 0.5]
    for method in ("g", "pearson"):
        r = goodness_of_fit([200, 300, 500], probs, method=method)
        assert r.p_value == pytest.approx(1.0) and r.statistic == pytest.approx(0.0, abs=1e-9)
    assert goodness_of_fit([1000], [1.0]).p_value == 1.0  # one cell: nothing to test


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(counts=[1, 2], expected=[0.5, 0.6]), "sum to 1"),
        (dict(counts=[1, 2], expected=[1.5, -0.5]), "non-negative"),
        (dict(counts=[0, 0], expected=[0.5, 0.5]), "no samples"),
        (dict(counts=[1, -2], expected=[0.5, 0.5]), "non-negative integers"),
        (dict(counts=[1, 2], expected=[0.5, 0.5], alpha=0.0), "alpha"),
        (dict(counts=[1, 2], expected=[0.5, 0.5], method="ks"), "method"),
        (dict(counts=[1, 2], expected=[0.5, 0.5], min_expected=0), "min_expected"),
    ],
)
def test_goodness_of_fit_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        goodness_of_fit(**kwargs)


@pytest.mark.statistical
@pytest.mark.parametrize("method", ["g", "pearson"])
def test_false_alarm_rate_is_calibrated(method):
    """2000 null replicates at alpha = 0.05: rejections ~ Binomial(2000, 0.05) = 100 ± 9.7; the
    band [45, 160] is exceeded with probability < 1e-6 by a calibrated test."""
    rng = np.random.default_rng(1234)
    probs = rng.dirichlet(np.full(12, 0.7))
    draws = rng.multinomial(3000, probs, size=2000)
    rejections = sum(
        not goodness_of_fit(list(d), list(probs), alpha=0.05, method=method).passed for d in draws
    )
    print(f"{method}: {rejections} / 2000 rejections at alpha = 0.05")
    assert 45 <= rejections <= 160


@pytest.mark.statistical
def test_power_helper_sample_size_detects_the_worst_direction():
    """At N = required_sample_size(δ=0.05, C=8, α=1e-3, β=0.1) the rejection rate against a bias of
    TV exactly δ in the worst direction is ≈ 0.9; with 600 replicates, < 0.8 has probability < 1e-6."""
    C, delta, alpha, beta = 8, 0.05, 1e-3, 0.1
    N = required_sample_size(delta, num_cells=C, alpha=alpha, beta=beta)
    p0 = np.full(C, 1 / C)
    p1 = p0 * (1 + 2 * delta * np.array([1, -1] * (C // 2)))
    assert 0.5 * np.abs(p1 - p0).sum() == pytest.approx(delta)
    draws = np.random.default_rng(99).multinomial(N, p1, size=600)
    rate = np.mean([not goodness_of_fit(list(d), list(p0), alpha=alpha).passed for d in draws])
    print(f"N = {N}: power {rate:.3f} (target >= {1 - beta})")
    assert rate >= 0.8
    assert detection_power(delta, N, num_cells=C, alpha=alpha) >= 1 - beta


def test_power_helper_is_monotone_and_validates():
    n = required_sample_size(0.02, num_cells=30, alpha=1e-6, beta=1e-6)
    assert required_sample_size(0.04, num_cells=30, alpha=1e-6, beta=1e-6) < n
    assert required_sample_size(0.02, num_cells=60, alpha=1e-6, beta=1e-6) > n
    assert required_sample_size(0.02, num_cells=30, alpha=1e-3, beta=1e-6) < n
    assert (
        detection_power(0.02, n, num_cells=30) >= 1 - 1e-6 > detection_power(0.02, int(0.8 * n), num_cells=30)
    )
    for bad in (
        dict(tv_distance=0.0),
        dict(tv_distance=1.5),
        dict(num_cells=1),
        dict(alpha=1.0),
        dict(beta=0.0),
    ):
        args = dict(tv_distance=0.1, num_cells=4, alpha=0.01, beta=0.1) | bad
        with pytest.raises(ValueError):
            required_sample_size(args.pop("tv_distance"), **args)


def test_marginalize_and_total_variation():
    dist = {(0, 1): 0.25, (0, 2): 0.25, (1,): 0.5}
    assert marginalize(dist, lambda s: s[0]) == {0: 0.5, 1: 0.5}
    counts = Counter({(0, 1): 3, (1,): 1})
    assert marginalize(counts, len) == Counter({2: 3, 1: 1})
    assert total_variation(dist, {(1,): 1.0}) == pytest.approx(0.5)
    assert total_variation(counts, {(0, 1): 0.75, (1,): 0.25}) == pytest.approx(0.0)


# --- toy models and Monte-Carlo -----------------------------------------------------------------------


def test_markov_models_implement_the_engine_protocols():
    model = MarkovModel.random(4, order=2, seed=0, eos_token_ids=(3,))
    assert isinstance(model.as_target(), Target)
    assert isinstance(model.as_drafter(), Drafter)
    probs = model.next_token_probs([(1, 2), (), (2,)], SamplingParams(top_k=2))
    assert probs.dtype == torch.float64 and ((probs > 0).sum(-1) == 2).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, dtype=torch.float64), rtol=0, atol=1e-15)
    with pytest.raises(ValueError):
        MarkovModel(torch.zeros(4, 5))  # must be [V+1]*order + [V]
    with pytest.raises(ValueError):
        model.next_token_probs([(7,)])
    with pytest.raises(ValueError):
        PositionalModel(torch.tensor([0.5, 0.6]))
    with pytest.raises(ValueError):
        PositionalModel(torch.tensor([0.5, 0.5])).next_token_probs([()], SamplingParams(top_k=1))


def test_markov_target_reads_context_from_its_cache_and_checks_the_protocol():
    model = MarkovModel.random(4, order=2, seed=1)
    target = MarkovTarget(model)
    target.reset(2, 16)
    prompt = torch.tensor([[1, 2, 3], [0, 0, 1]])
    out = target.forward(prompt, torch.zeros(2, dtype=torch.long), logits_index_BN=torch.tensor([[2], [2]]))
    assert out.logits_BTV.shape == (2, 1, 4)
    torch.testing.assert_close(out.logits_BTV[:, 0], model.logits_for(torch.tensor([[2, 3], [0, 1]])))
    target.rollback(torch.tensor([3, 3]))
    # block at slot 3: position 0 sees (slot 2 from the cache, its own token)
    block = target.forward(torch.tensor([[0, 1], [2, 2]]), torch.tensor([3, 3]))
    torch.testing.assert_close(block.logits_BTV[:, 0], model.logits_for(torch.tensor([[3, 0], [1, 2]])))
    torch.testing.assert_close(block.logits_BTV[:, 1], model.logits_for(torch.tensor([[0, 1], [2, 2]])))
    target.rollback(torch.tensor([4, 3]))
    with pytest.raises(RuntimeError, match="protocol violation"):
        target.forward(torch.tensor([[0], [0]]), torch.tensor([4, 4]))  # row 1 starts past its cache
    with pytest.raises(RuntimeError, match="protocol violation"):
        target.rollback(torch.tensor([9, 3]))


def test_markov_drafter_proposals():
    model = MarkovModel.random(5, order=1, seed=2)
    state = DecodeState(
        tokens_BL=torch.tensor([[1, 4, 0, 0], [2, 0, 0, 0]]),
        prompt_lengths_B=torch.tensor([2, 1]),
        lengths_B=torch.tensor([2, 1]),
        finished_B=torch.zeros(2, dtype=torch.bool),
        sampling=SamplingParams(temperature=0.5, top_k=3),
    )
    greedy = MarkovDrafter(model, point_mass=True).propose(state, 3)
    assert greedy.probs_BKV is None and greedy.tokens_BK.shape == (2, 3)
    first = model.next_token_probs([(4,), (2,)], state.sampling).argmax(-1)
    assert greedy.tokens_BK[:, 0].tolist() == first.tolist()
    sampled = MarkovDrafter(model).propose(state, 2, torch.Generator().manual_seed(0))
    assert sampled.probs_BKV.shape == (2, 2, 5) and sampled.probs_BKV.dtype == torch.float32
    assert ((sampled.probs_BKV > 0).sum(-1) == 3).all()
    assert sampled.probs_BKV.gather(-1, sampled.tokens_BK.unsqueeze(-1)).gt(0).all()
    empty = MarkovDrafter(model).propose(state, 0)
    assert empty.tokens_BK.shape == (2, 0) and empty.probs_BKV.shape == (2, 0, 5)


def test_sample_output_distribution_is_seeded_and_validates():
    kw = dict(**MODELS, gamma=2, context=(0,), num_samples=3000, num_tokens=3)
    a = sample_output_distribution(**kw, seed=5)
    b = sample_output_distribution(**kw, seed=5, batch_size=1000)
    assert sum(a.values()) == 3000 and all(len(s) == 3 for s in a)
    assert a == sample_output_distribution(**kw, seed=5)
    assert sum(b.values()) == 3000
    with pytest.raises(ValueError, match="num_samples"):
        sample_output_distribution(**MODELS, gamma=1, num_samples=0)
    with pytest.raises(ValueError, match="draft"):
        sample_output_distribution(**MODELS, gamma=1, num_samples=10, draft="greedy")
    with pytest.raises(ValueError, match="needs num_tokens"):
        sample_output_distribution(**MODELS, gamma=1, num_samples=10, via="generate")
    with pytest.raises(ValueError, match="always verifies"):
        sample_output_distribution(
            **MODELS, gamma=1, num_samples=10, num_tokens=2, via="generate", verify_fn=_buggy(None)
        )


def test_sample_output_distribution_cuts_at_eos():
    target = MarkovModel.random(4, order=1, seed=3, eos_token_ids=(3,))
    counts = sample_output_distribution(
        target,
        MarkovModel.random(4, seed=4),
        gamma=3,
        context=(0,),
        num_samples=2000,
        num_tokens=4,
        eos_token_ids=(3,),
    )
    assert all(3 not in s[:-1] for s in counts) and any(s[-1] == 3 and len(s) < 4 for s in counts)


def test_enumeration_validates_its_arguments():
    target, drafter = MODELS["target"], MODELS["drafter"]
    with pytest.raises(ValueError, match="gamma"):
        expected_output_distribution(target, drafter, gamma=-1)
    with pytest.raises(ValueError, match="draft"):
        expected_output_distribution(target, drafter, gamma=1, draft="greedy")
    with pytest.raises(ValueError, match="vocab mismatch"):
        expected_output_distribution(target, MarkovModel.random(4), gamma=1)
    with pytest.raises(ValueError, match="num_tokens"):
        expected_output_distribution(target, drafter, gamma=1, num_tokens=0)
    with pytest.raises(ValueError, match="num_tokens"):
        target_sequence_distribution(target, num_tokens=0)
    with pytest.raises(ValueError, match="draft_tokens_BK must have shape"):
        verifier_step_law(
            torch.full((1, 3, 3), 1 / 3, dtype=torch.float64), torch.zeros((1, 1), dtype=torch.long)
        )
