"""Tests of specdec.verify.rejection_sample: every branch, greedy, validation, and exact distributions.

Legend: B batch, K draft length (γ), V vocabulary.

The exact checks evaluate the real rejection_sample by probing (specdec.testing.verifier_step_law
runs it on chosen uniforms and records the distribution it samples the stop token from), in float64,
and compare with the target's distribution to 1e-12. The Monte-Carlo twins are in tests/statistical/.
"""

import itertools
import math

import pytest
import torch

from specdec.sampling import logits_to_probs
from specdec.testing import (
    MarkovModel,
    PositionalModel,
    expected_num_accepted_distribution,
    expected_output_distribution,
    target_sequence_distribution,
    verifier_step_law,
    with_generator,
)
from specdec.verify import VerifyResult, greedy_verify
from specdec.verify import rejection_sample as keyed_rejection_sample

# The rule with each row's seed drawn from the generator a test passes (specdec.testing.with_generator).
rejection_sample = with_generator(keyed_rejection_sample)

EXACT = 1e-12


pytestmark = pytest.mark.usefixtures("one_thread")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _one_hot(ids, V: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.as_tensor(ids), V).float()


def _random_probs(shape, seed: int) -> torch.Tensor:
    return torch.softmax(torch.randn(shape, generator=_gen(seed)) * 2, dim=-1)


def _drafts_from(draft_probs_BKV: torch.Tensor, seed: int) -> torch.Tensor:
    """One draft token per row and position, sampled from ``draft_probs_BKV``."""
    B, K, V = draft_probs_BKV.shape
    return torch.multinomial(draft_probs_BKV.reshape(-1, V), 1, generator=_gen(seed)).reshape(B, K)


def _random_chain(B: int, K: int, V: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random target probs [B, K+1, V], draft probs [B, K, V] and drafts sampled from them (seeds
    ``seed``, ``seed + 1``, ``seed + 2``)."""
    draft_probs = _random_probs((B, K, V), seed + 1)
    return _random_probs((B, K + 1, V), seed), draft_probs, _drafts_from(draft_probs, seed + 2)


def _max_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


# --- branches ----------------------------------------------------------------------------------------


def test_all_accepted_plus_bonus():
    B, K, V = 3, 4, 6
    draft_probs = _random_probs((B, K, V), 0)
    bonus = torch.tensor([5, 0, 2])
    target_probs = torch.cat([draft_probs, _one_hot(bonus, V).unsqueeze(1)], dim=1)  # p == q: always accepted
    draft_tokens = _drafts_from(draft_probs, 1)
    for seed in range(5):
        out = rejection_sample(target_probs, draft_tokens, draft_probs, generator=_gen(seed))
        assert isinstance(out, VerifyResult)
        tokens, num_accepted = out  # unpacks like a tuple
        assert tokens.dtype == torch.long and num_accepted.dtype == torch.long
        assert tokens.shape == (B, K + 1) and num_accepted.shape == (B,)
        assert num_accepted.tolist() == [K] * B
        assert torch.equal(tokens[:, :K], draft_tokens)
        assert tokens[:, K].tolist() == bonus.tolist()  # bonus drawn from the target's last row


def test_first_rejected_gives_recovered_token_then_padding():
    V = 5
    target_probs = torch.stack([_one_hot(3, V), _one_hot(1, V), _one_hot(4, V)]).unsqueeze(0)
    draft_tokens = torch.tensor([[2, 1]])  # target gives token 2 no mass: rejected at position 0
    draft_probs = _random_probs((1, 2, V), 2)
    for seed in range(5):
        tokens, num_accepted = rejection_sample(target_probs, draft_tokens, draft_probs, generator=_gen(seed))
        assert num_accepted.tolist() == [0]
        assert tokens.tolist() == [[3, -1, -1]]  # recovered from norm(max(p - q, 0)) = token 3


def test_empty_draft_samples_one_token_from_the_target():
    V = 4
    target_probs = _one_hot([[2], [0]], V)  # [B=2, K+1=1, V]
    for draft_probs in (torch.zeros(2, 0, V), None):
        tokens, num_accepted = rejection_sample(
            target_probs, torch.zeros(2, 0, dtype=torch.long), draft_probs
        )
        assert tokens.tolist() == [[2], [0]]
        assert num_accepted.tolist() == [0, 0]


def test_batch_with_ragged_acceptance():
    V = 5
    rows = []
    # row 0: p == q everywhere -> all accepted, bonus 4
    # row 1: position 1 has target(x) = 0 -> 1 accepted, recovered at 1
    # row 2: position 0 has target(x) = 0 -> 0 accepted
    draft_tokens = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    draft_probs = _one_hot(draft_tokens, V)
    rows.append(torch.cat([draft_probs[0], _one_hot([4], V)]))
    rows.append(torch.stack([_one_hot(1, V), _one_hot(0, V), _one_hot(3, V), _one_hot(4, V)]))
    rows.append(torch.stack([_one_hot(4, V), _one_hot(2, V), _one_hot(3, V), _one_hot(4, V)]))
    target_probs = torch.stack(rows)
    for probs in (draft_probs, None):
        tokens, num_accepted = rejection_sample(target_probs, draft_tokens, probs, generator=_gen(0))
        assert num_accepted.tolist() == [3, 1, 0]
        assert tokens.tolist() == [[1, 2, 3, 4], [1, 0, -1, -1], [4, -1, -1, -1]]


def test_p_equal_q_accepts_everything_without_nan():
    B, K, V = 64, 3, 50
    probs = _random_probs((B, K + 1, V), 3)
    probs[:, :, ::7] = 0.0  # zeros in both
    probs = probs / probs.sum(-1, keepdim=True)
    draft_tokens = _drafts_from(probs[:, :K], 4)
    tokens, num_accepted = rejection_sample(probs, draft_tokens, probs[:, :K].clone(), generator=_gen(5))
    assert (num_accepted == K).all()
    assert (tokens >= 0).all() and (tokens < V).all()


def test_zero_probability_draft_token_is_always_rejected():
    V = 4
    target_probs = torch.stack([_one_hot(1, V), _one_hot(2, V)]).unsqueeze(0)  # target(1) = 1 at position 0
    draft_probs = torch.tensor([[[0.5, 0.0, 0.5, 0.0]]])  # the drafter gives its own token no mass
    for seed in range(20):
        tokens, num_accepted = rejection_sample(
            target_probs, torch.tensor([[1]]), draft_probs, generator=_gen(seed)
        )
        assert num_accepted.tolist() == [0]
        assert tokens.tolist() == [[1, -1]]  # recovered from max(p - q, 0), all on token 1


def test_residual_with_zero_mass_falls_back_to_the_target():
    # p == q and the draft token has no mass in either: rejected, and max(p - q, 0) is all zero.
    V = 4
    p = torch.tensor([0.25, 0.0, 0.5, 0.25], dtype=torch.float64)
    target_probs = torch.stack([p, p]).unsqueeze(0)
    draft_probs = p.reshape(1, 1, V).clone()
    draft_tokens = torch.tensor([[1]])
    tokens, num_accepted = rejection_sample(target_probs, draft_tokens, draft_probs, generator=_gen(0))
    assert num_accepted.tolist() == [0] and tokens[0, 0].item() in (0, 2, 3)
    (outcome,) = verifier_step_law(target_probs, draft_tokens, draft_probs)[0]
    assert outcome.probability == 1.0 and outcome.tokens == (None,)
    torch.testing.assert_close(outcome.stop_probs, p, rtol=0, atol=EXACT)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_greedy_reduces_to_exact_argmax_matching(with_draft_probs):
    B, K, V = 200, 4, 7
    g = _gen(6)
    target_logits = torch.randn(B, K + 1, V, generator=g)
    # drafts agree with the target's argmax at random positions
    draft_logits = torch.where(
        torch.rand(B, K, 1, generator=g) < 0.7, target_logits[:, :K], torch.randn(B, K, V, generator=g)
    )
    target_probs = logits_to_probs(target_logits, temperature=0.0)
    draft_probs = logits_to_probs(draft_logits, temperature=0.0)
    draft_tokens = draft_probs.argmax(-1)
    tokens, num_accepted = rejection_sample(
        target_probs, draft_tokens, draft_probs if with_draft_probs else None, generator=_gen(7)
    )
    greedy = target_logits.argmax(-1)
    for b in range(B):
        n = 0
        while n < K and draft_tokens[b, n] == greedy[b, n]:
            n += 1
        assert num_accepted[b].item() == n
        assert tokens[b, : n + 1].tolist() == greedy[b, : n + 1].tolist()
        assert (tokens[b, n + 1 :] == -1).all()
    assert len(set(num_accepted.tolist())) > 2  # the case mix covers several acceptance lengths


@pytest.mark.parametrize("K", [0, 1, 4])
def test_greedy_verify_equals_rejection_sample_on_one_hot_targets(K):
    """The loop's temperature-0 fast path returns exactly what the exact rule returns."""
    B, V = 300, 6
    g = _gen(11)
    # integer-valued logits: many ties, which both must break towards the lowest id
    target_logits = torch.randint(0, 3, (B, K + 1, V), generator=g).float()
    argmax = logits_to_probs(target_logits, temperature=0.0).argmax(-1)
    draft_tokens = torch.where(
        torch.rand(B, K, generator=g) < 0.6, argmax[:, :K], torch.randint(0, V, (B, K), generator=g)
    )
    want = rejection_sample(
        logits_to_probs(target_logits, temperature=0.0), draft_tokens, None, generator=_gen(3)
    )
    got = greedy_verify(target_logits, draft_tokens.int())
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.num_accepted, want.num_accepted)
    assert got.tokens.dtype == torch.long and got.num_accepted.dtype == torch.long
    if K:
        assert len(set(want.num_accepted.tolist())) == K + 1  # every acceptance length occurs


def test_greedy_verify_rejects_bad_shapes():
    with pytest.raises(ValueError, match="draft_tokens_BK"):
        greedy_verify(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="target_logits_BKV"):
        greedy_verify(torch.zeros(2, 5), torch.zeros(2, 1, dtype=torch.long))


def test_seeded_determinism():
    B, K, V = 32, 3, 10
    target_probs, draft_probs, draft_tokens = _random_chain(B, K, V, 8)
    a = rejection_sample(target_probs, draft_tokens, draft_probs, generator=_gen(123))
    b = rejection_sample(target_probs, draft_tokens, draft_probs, generator=_gen(123))
    c = rejection_sample(target_probs, draft_tokens, draft_probs, generator=_gen(124))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    assert not torch.equal(a.tokens, c.tokens)


def test_validate_false_skips_checks_and_gives_the_same_result():
    B, K, V = 16, 2, 8
    target_probs, draft_probs, draft_tokens = _random_chain(B, K, V, 11)
    a = rejection_sample(target_probs, draft_tokens, draft_probs, generator=_gen(1))
    b = rejection_sample(target_probs, draft_tokens, draft_probs, generator=_gen(1), validate=False)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    unnormalised = target_probs * 1.5
    with pytest.raises(ValueError, match="normalised"):
        rejection_sample(unnormalised, draft_tokens, draft_probs)
    rejection_sample(unnormalised, draft_tokens, draft_probs, validate=False)  # not checked


def test_int32_draft_tokens_and_float64_inputs():
    V = 5
    p = _random_probs((2, 3, V), 14).double()
    q = _random_probs((2, 2, V), 15).double()
    tokens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    out = rejection_sample(p, tokens, q, generator=_gen(0))
    assert out.tokens.dtype == torch.long
    # float64 inputs are computed in float64: the acceptance threshold is p/q to float64 precision.
    law = verifier_step_law(p[:1, :2], tokens[:1, :1].long(), q[:1, :1])[0]
    accept = sum(o.probability for o in law if o.num_accepted == 1)
    assert accept == pytest.approx(min(1.0, float(p[0, 0, 0] / q[0, 0, 0])), rel=0, abs=EXACT)


# --- validation ----------------------------------------------------------------------------------------

B_, K_, V_ = 2, 3, 5
_P = _random_probs((B_, K_ + 1, V_), 20)
_Q = _random_probs((B_, K_, V_), 21)
_X = torch.zeros(B_, K_, dtype=torch.long)


def _with(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


@pytest.mark.parametrize(
    "args, match",
    [
        ((_P[0], _X, _Q), "target_probs_BKV must be a tensor of shape"),
        (("not a tensor", _X, _Q), "target_probs_BKV must be a tensor of shape"),
        ((_P, _X[0], _Q), "draft_tokens_BK must be a tensor of shape"),
        ((_P, _X[:1], _Q), "batch mismatch"),
        ((_P[:, :3], _X, _Q), "draft length mismatch"),
        ((_P[..., :0], _X, _Q[..., :0]), "V >= 1"),
        ((_P, _X.float(), _Q), "draft_tokens_BK must be an integer tensor"),
        ((_P, _X.to("meta"), _Q), "draft_tokens_BK is on meta"),
        ((_P, _with(_X, (0, 1), -1), _Q), r"draft_tokens_BK must lie in \[0, V=5\)"),
        ((_P, _with(_X, (1, 2), 5), _Q), r"draft_tokens_BK must lie in \[0, V=5\)"),
        ((_P.long(), _X, _Q), "target_probs_BKV must be a floating-point tensor"),
        ((_with(_P, (0, 0, 0), float("nan")), _X, _Q), "target_probs_BKV contains NaN"),
        ((_with(_P, (1, 2, 3), -0.1), _X, _Q), "target_probs_BKV contains negative"),
        ((_P * 1.01, _X, _Q), "target_probs_BKV must be normalised"),
        ((_P, _X, _Q[0]), "draft_probs_BKV must be None or a tensor of shape"),
        ((_P, _X, _Q[:, :2]), r"draft_probs_BKV must have shape \[B=2, K=3, V\]"),
        ((_P, _X, _random_probs((B_, K_, V_ + 1), 22)), "vocab mismatch"),
        ((_P, _X, _Q.to("meta")), "draft_probs_BKV is on meta"),
        ((_P, _X, _with(_Q, (0, 0, 0), float("nan"))), "draft_probs_BKV contains NaN"),
        ((_P, _X, _with(_Q, (0, 0, 0), -1e-3)), "draft_probs_BKV contains negative"),
        ((_P, _X, _Q * 0.9), "draft_probs_BKV must be normalised"),
        ((_P, _X, _Q.long()), "draft_probs_BKV must be a floating-point tensor"),
    ],
)
def test_bad_inputs_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        rejection_sample(*args)


# --- exact distributions (enumeration through the real code, float64, no sampling) ----------------------


def _filtered_probs(V: int, seed: int, temperature: float, top_k, top_p) -> torch.Tensor:
    logits = torch.randn(V, generator=_gen(seed)) * 1.5
    probs = logits_to_probs(logits, temperature, top_k, top_p).double()
    return probs / probs.sum()  # normalised in float64


FILTERS = [(1.0, None, None), (0.7, 3, None), (1.3, None, 0.7), (1.0, 4, 0.8)]


def _algorithm_1_step(p_KV: torch.Tensor, q_KV: torch.Tensor) -> dict:
    """Leviathan et al. (arXiv 2211.17192) per-step law for i.i.d.-by-position rows, written out:
    P(x_0..x_{n-1}, y) = Π_k min(p_k, q_k)(x_k) · [max(p_n − q_n, 0)(y) if n < K else p_K(y)]."""
    K, V = q_KV.shape
    out = {}
    for n in range(K + 1):
        stop = (p_KV[n] - q_KV[n]).clamp(min=0) if n < K else p_KV[K]
        for prefix in itertools.product(range(V), repeat=n):
            head = math.prod(float(torch.minimum(p_KV[k], q_KV[k])[x]) for k, x in enumerate(prefix))
            for y in range(V):
                if head * float(stop[y]) > 0:
                    out[prefix + (y,)] = head * float(stop[y])
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("target_filter", FILTERS)
@pytest.mark.parametrize("draft_filter", FILTERS[::2])
def test_exact_emitted_distribution_equals_target(seed, target_filter, draft_filter):
    V, K = 6, 2
    p_V = _filtered_probs(V, 100 + seed, *target_filter)
    q_V = _filtered_probs(V, 200 + seed, *draft_filter)
    target, drafter = PositionalModel(p_V), PositionalModel(q_V)
    step = expected_output_distribution(target, drafter, gamma=K)
    # one step: the per-step law of Algorithm 1, and a first token distributed as the target
    assert _max_diff(step, _algorithm_1_step(p_V.expand(K + 1, V), q_V.expand(K, V))) < EXACT
    first = {}
    for seq, prob in step.items():
        first[seq[0]] = first.get(seq[0], 0.0) + prob
    assert max(abs(first.get(y, 0.0) - float(p_V[y])) for y in range(V)) < EXACT
    # the stream of K+1 tokens (continued over as many steps as needed): the target's joint
    stream = expected_output_distribution(target, drafter, gamma=K, num_tokens=K + 1)
    assert _max_diff(stream, target_sequence_distribution(target, num_tokens=K + 1)) < EXACT


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_exact_point_mass_drafts(seed):
    V, K = 4, 2
    p_KV = torch.stack([_filtered_probs(V, 300 + seed + k, *FILTERS[k % 4]) for k in range(K + 2)])
    q_KV = torch.stack([_filtered_probs(V, 400 + seed + k, 1.0, None, None) for k in range(K + 1)])
    target, drafter = PositionalModel(p_KV), PositionalModel(q_KV)
    reference = target_sequence_distribution(target, num_tokens=K + 2)
    for draft in ("point_mass", "sample"):
        stream = expected_output_distribution(target, drafter, gamma=K, num_tokens=K + 2, draft=draft)
        assert _max_diff(stream, reference) < EXACT
    # draft_probs=None behaves exactly like a one-hot draft distribution
    one_hot = PositionalModel(_one_hot(q_KV.argmax(-1), V).double())
    a = expected_output_distribution(target, drafter, gamma=K, draft="point_mass")
    b = expected_output_distribution(target, one_hot, gamma=K, draft="sample")
    assert _max_diff(a, b) < EXACT
    assert _max_diff(a, _algorithm_1_step(p_KV[: K + 1], _one_hot(q_KV[:K].argmax(-1), V).double())) < EXACT


@pytest.mark.parametrize("seed", range(6))
def test_exact_acceptance_probability_is_sum_min(seed):
    V = 7
    p_V = _filtered_probs(V, 500 + seed, *FILTERS[seed % 4])
    q_V = _filtered_probs(V, 600 + seed, *FILTERS[(seed + 1) % 4])
    alpha = float(torch.minimum(p_V, q_V).sum())
    tv = 0.5 * float((p_V - q_V).abs().sum())
    assert alpha == pytest.approx(1 - tv, abs=EXACT)
    p_n = expected_num_accepted_distribution(PositionalModel(p_V), PositionalModel(q_V), gamma=1)
    assert p_n[1] == pytest.approx(alpha, abs=EXACT)
    # per draft token: accepted with probability min(1, p(x)/q(x)), read off the real code
    support = torch.nonzero(q_V > 0).flatten()
    law = verifier_step_law(
        p_V.expand(len(support), 2, V).clone(), support.unsqueeze(1), q_V.expand(len(support), 1, V).clone()
    )
    for x, outcomes in zip(support.tolist(), law, strict=True):
        accepted = sum(o.probability for o in outcomes if o.num_accepted == 1)
        assert accepted == pytest.approx(min(1.0, float(p_V[x] / q_V[x])), abs=EXACT)


@pytest.mark.parametrize("seed", range(3))
def test_exact_num_accepted_is_truncated_geometric(seed):
    V, gamma = 6, 4
    p_V = _filtered_probs(V, 700 + seed, *FILTERS[seed])
    q_V = _filtered_probs(V, 800 + seed, *FILTERS[seed + 1])
    alpha = float(torch.minimum(p_V, q_V).sum())
    p_n = expected_num_accepted_distribution(PositionalModel(p_V), PositionalModel(q_V), gamma=gamma)
    expected = [alpha**n * (1 - alpha) for n in range(gamma)] + [alpha**gamma]
    assert p_n == pytest.approx(expected, abs=EXACT)


def test_exact_markov_block_gamma_2_vocab_3_all_27_sequences():
    target = MarkovModel.random(3, order=1, seed=11)
    drafter = MarkovModel.random(3, order=1, seed=12)
    for context in [(0,), (1,), (2,), ()]:
        stream = expected_output_distribution(target, drafter, gamma=2, context=context, num_tokens=3)
        joint = target_sequence_distribution(target, num_tokens=3, context=context)
        assert len(joint) == 27 and set(stream) == set(joint)
        assert _max_diff(stream, joint) < EXACT
        # the target rows really are row-specific: P(x1 | x0) differs between values of x0
        pair = {}
        for (x0, x1, _), prob in joint.items():
            pair[x0, x1] = pair.get((x0, x1), 0.0) + prob
        rows = [[pair[x0, x1] / sum(pair[x0, y] for y in range(3)) for x1 in range(3)] for x0 in range(3)]
        assert min(abs(a - b) for a, b in zip(rows[0], rows[1], strict=True)) > 1e-3


@pytest.mark.parametrize("draft", ["sample", "point_mass"])
def test_exact_markov_order_2_with_eos_and_filters(draft):
    from specdec.sampling import SamplingParams

    target = MarkovModel.random(4, order=2, seed=13, eos_token_ids=(3,))
    drafter = MarkovModel.random(4, order=1, seed=14)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, top_k=3), SamplingParams(top_p=0.85)):
        kwargs = dict(context=(1, 2), num_tokens=4, sampling=sampling, eos_token_ids=(3,))
        stream = expected_output_distribution(target, drafter, gamma=3, draft=draft, **kwargs)
        joint = target_sequence_distribution(target, **{k: v for k, v in kwargs.items()})
        assert sum(joint.values()) == pytest.approx(1.0, abs=EXACT)
        assert any(s[-1] == 3 and len(s) < 4 for s in joint)  # EOS cuts some sequences short
        assert _max_diff(stream, joint) < EXACT
