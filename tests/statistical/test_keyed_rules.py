"""Monte-Carlo distribution tests of the position-keyed rules (``exact`` keyed, ``gumbel``) and of
keyed sampling, with planted bugs that each check must reject.

Legend: R sample rows (one seed each), K draft length (γ), V vocabulary, L emitted-token capacity.

The randomness of these rules is a function of (seed, position, stream), so samples are taken over
seeds: row r of a run has seed ``seed0 + r`` and its own positions 0, 1, 2, ... A test-local
speculative loop (:func:`keyed_run`, order-1 Markov toys, vectorised over rows) drafts with the
drafter's rows, verifies with the rule under test at the rows' positions and commits; the draft
depth changes from step to step. Expected laws:

- streams: the target's own joint (:func:`specdec.testing.target_sequence_distribution`), for every
  rule, every drafter (independent keyed draws, coupled ``draft_keyed`` draws, point masses);
- one ``exact`` step: the Algorithm-1 law enumerated through the real ``rejection_sample``
  (:func:`specdec.testing.expected_output_distribution`): the keyed rule keeps the per-step law,
  bonus token included;
- one ``gumbel`` step with independent drafts: emitted y_0..y_m with probability
  Π p(y_k | y_<k) · Π_{k<m} q(y_k | y_<k) · (1 − q(y_m | y_<m) if m < K), enumerated below.

False alarms and power (as in test_verify_distribution.py): ALPHA = 1e-6 per check (budget 2e-6 for
the G-test's measured tail), N = required_sample_size(DESIGN_TV = 0.02, cells, ALPHA, BETA = 1e-6)
so each planted bug whose total variation is ≥ 0.02 is missed with probability ≤ 1e-6; every
mutant's TV from the expected law is printed and asserted ≥ DESIGN_TV. This file adds 9 checks on
correct code and 4 mutation checks: with the suite's 28 and 17 the union bound is
37 × 2e-6 + 21 × 1e-6 = 9.5e-5 < 1e-4 per CI run.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
import torch
from _stat_checks import Design

from specdec.sampling import SamplingParams
from specdec.testing import (
    GoodnessOfFit,
    MarkovModel,
    expected_output_distribution,
    target_sequence_distribution,
    total_variation,
)
from specdec.verify import VerifyResult, rejection_sample
from specdec.verify.gumbel import gumbel_verify
from specdec.verify.noise import PositionNoise, draft_keyed, sample_keyed

pytestmark = pytest.mark.statistical

DESIGN = Design(tv=0.02)
sample_size = DESIGN.sample_size

Rule = Callable[..., VerifyResult]


def check(counts: Counter, expected: dict, label: str, exact: bool) -> GoodnessOfFit:
    result = DESIGN.check(counts, expected, label)
    if exact:
        assert result.passed, f"a keyed rule failed a distribution test:\n{result}"
    else:
        # The planted bug must be at least as large as the size every check is built to catch.
        tv = total_variation(counts, expected)
        assert tv >= DESIGN.tv, f"planted bug too small to test at this N (TV {tv:.4f})"
        assert not result.passed, f"a planted bug went undetected:\n{result}"
    return result


# --- the test-local keyed loop ----------------------------------------------------------------------------


def _table(model: MarkovModel, sampling: SamplingParams | None) -> torch.Tensor:
    """float64 ``[V, V]``: row x is the processed next-token distribution after token x (order 1)."""
    V = model.vocab_size
    return model.next_token_probs([(x,) for x in range(V)], sampling)


def keyed_run(
    target: MarkovModel,
    drafter: MarkovModel,
    *,
    rule: Rule,
    num_samples: int,
    depths: Sequence[int],
    context: tuple[int, ...],
    num_tokens: int | None = None,
    draft: str = "independent",
    sampling: SamplingParams | None = None,
    seed0: int = 0,
) -> Counter:
    """Emitted tokens of ``num_samples`` keyed runs (seeds seed0, seed0+1, ...): one step
    (``num_tokens=None``, depth ``depths[0]``) or the first ``num_tokens`` of the stream, the depth of
    step i being ``depths[i % len(depths)]``. ``draft``: ``"independent"`` (stream "draft"),
    ``"coupled"`` (:func:`draft_keyed`) or ``"point_mass"`` (the drafter's argmax, probs None)."""
    R, V = num_samples, target.vocab_size
    table_T, table_D = _table(target, sampling).float(), _table(drafter, sampling).float()
    noise = PositionNoise(list(range(seed0, seed0 + R)))
    cap = (num_tokens or 0) + max(depths) + 1
    out_RL = torch.full((R, cap), -1, dtype=torch.long)
    n_R = torch.zeros(R, dtype=torch.long)
    last_R = torch.full((R,), context[-1], dtype=torch.long)
    for step in itertools.count():
        act = torch.arange(R) if step == 0 else (n_R < (num_tokens or 0)).nonzero().flatten()
        if act.numel() == 0:
            break
        K = depths[step % len(depths)]
        sub, n_A, prev_A = noise.select(act), n_R[act], last_R[act]
        drafts, draft_probs = [], []
        for k in range(K):
            q_AV = table_D[prev_A]
            if draft == "point_mass":
                x_A = q_AV.argmax(dim=-1)
            elif draft == "coupled":
                x_A = draft_keyed(q_AV, sub, n_A + k)
            else:
                x_A = sample_keyed(q_AV, sub, n_A + k, stream="draft")
            drafts.append(x_A)
            draft_probs.append(q_AV)
            prev_A = x_A
        draft_tokens_AK = torch.stack(drafts, 1) if K else torch.zeros((act.numel(), 0), dtype=torch.long)
        draft_probs_AKV = None
        if draft != "point_mass":
            draft_probs_AKV = torch.stack(draft_probs, 1) if K else torch.zeros((act.numel(), 0, V))
        target_probs_AKV = table_T[torch.cat([last_R[act].unsqueeze(1), draft_tokens_AK], dim=1)]
        positions_AK = n_A.unsqueeze(1) + torch.arange(K + 1)
        tokens_AK, num_accepted_A = rule(
            target_probs_AKV, draft_tokens_AK, draft_probs_AKV, noise=sub, positions_BK=positions_AK
        )
        m_A = num_accepted_A + 1
        keep_AK = torch.arange(K + 1) < m_A.unsqueeze(1)
        rows = act.unsqueeze(1).expand_as(positions_AK)
        out_RL[rows[keep_AK], positions_AK[keep_AK]] = tokens_AK[keep_AK]
        last_R[act] = tokens_AK.gather(1, num_accepted_A.unsqueeze(1)).squeeze(1)
        n_R[act] = n_A + m_A
        if num_tokens is None:
            break
    width = num_tokens if num_tokens is not None else cap
    return Counter(tuple(t for t in row if t >= 0) for row in out_RL[:, :width].tolist())


def plain_keyed_run(
    target: MarkovModel, *, num_samples: int, num_tokens: int, context: tuple[int, ...], sampling=None
) -> Counter:
    """Plain decoding with :func:`sample_keyed` (no drafter): what ``gumbel`` must reproduce."""
    table_T = _table(target, sampling).float()
    noise = PositionNoise(list(range(num_samples)))
    last = torch.full((num_samples,), context[-1], dtype=torch.long)
    out = []
    for p in range(num_tokens):
        last = sample_keyed(table_T[last], noise, torch.full((num_samples,), p))
        out.append(last)
    return Counter(map(tuple, torch.stack(out, 1).tolist()))


def gumbel_step_law(target: MarkovModel, drafter: MarkovModel, gamma: int, context: tuple[int, ...]) -> dict:
    """The exact law of one ``gumbel`` step with independently drawn drafts (module doc)."""
    V = target.vocab_size
    p, q = _table(target, None), _table(drafter, None)
    law: dict = {}
    for m in range(gamma + 1):
        for ys in itertools.product(range(V), repeat=m + 1):
            prob, prev = 1.0, context[-1]
            for k, y in enumerate(ys):
                prob *= float(p[prev, y])
                if k < m:
                    prob *= float(q[prev, y])
                elif m < gamma:
                    prob *= 1.0 - float(q[prev, y])
                prev = y
            law[ys] = law.get(ys, 0.0) + prob
    return law


# --- planted bugs (test-local wrappers around the real rules) ----------------------------------------------


def gumbel_positions_reused(target_probs_BKV, draft_tokens_BK, draft_probs_BKV, *, noise, positions_BK):
    """Bug: the gumbel rule keys every position with the same (first) position: one Gumbel vector
    serves all positions, so the tokens of a stream are correlated."""
    same_BK = positions_BK[:, :1].expand_as(positions_BK)
    return gumbel_verify(
        target_probs_BKV, draft_tokens_BK, draft_probs_BKV, noise=noise, positions_BK=same_BK
    )


def exact_ratio_inverted(target_probs_BKV, draft_tokens_BK, draft_probs_BKV, *, noise, positions_BK):
    """Bug: the acceptance test uses draft/target instead of target/draft (the recovered and bonus
    tokens are drawn as in the real rule)."""
    K = draft_tokens_BK.shape[1]
    if K == 0:
        return _exact(
            target_probs_BKV, draft_tokens_BK, draft_probs_BKV, noise=noise, positions_BK=positions_BK
        )
    swapped_BKV = torch.cat([draft_probs_BKV, target_probs_BKV[:, K:]], dim=1)
    _, n_B = rejection_sample(
        swapped_BKV, draft_tokens_BK, target_probs_BKV[:, :K], noise=noise, positions_BK=positions_BK
    )
    return _commit_with_real_stop_token(
        target_probs_BKV, draft_tokens_BK, draft_probs_BKV, n_B, noise, positions_BK
    )


def exact_residual_on_sample_stream(
    target_probs_BKV, draft_tokens_BK, draft_probs_BKV, *, noise, positions_BK
):
    """Bug: the recovered token is drawn with the "sample" stream, the one a coupled drafter
    (:func:`draft_keyed`) drew the rejected draft with."""
    tokens_BK1, n_B = rejection_sample(
        target_probs_BKV, draft_tokens_BK, draft_probs_BKV, noise=noise, positions_BK=positions_BK
    )
    K = draft_tokens_BK.shape[1]
    rows = (n_B < K).nonzero().flatten()
    if rows.numel():
        residual = (target_probs_BKV[rows, n_B[rows]] - draft_probs_BKV[rows, n_B[rows]]).clamp(min=0)
        tokens_BK1[rows, n_B[rows]] = sample_keyed(
            residual, noise.select(rows), positions_BK[rows, n_B[rows]]
        )
    return VerifyResult(tokens_BK1, n_B)


def exact_bonus_dropped(target_probs_BKV, draft_tokens_BK, draft_probs_BKV, *, noise, positions_BK):
    """Bug: when every draft is accepted, the bonus token is not emitted."""
    tokens_BK1, n_B = rejection_sample(
        target_probs_BKV, draft_tokens_BK, draft_probs_BKV, noise=noise, positions_BK=positions_BK
    )
    K = draft_tokens_BK.shape[1]
    tokens_BK1[n_B == K, K] = -1
    return VerifyResult(tokens_BK1, n_B)


def _commit_with_real_stop_token(
    target_probs_BKV, draft_tokens_BK, draft_probs_BKV, n_B, noise, positions_BK
):
    """Accepted drafts up to n_B, then the real rule's recovered (residual stream) or bonus token."""
    B, K1, _ = target_probs_BKV.shape
    K = K1 - 1
    rows = torch.arange(B)
    tokens_BK1 = torch.where(
        torch.arange(K1) < n_B.unsqueeze(1), torch.cat([draft_tokens_BK, draft_tokens_BK[:, :1]], 1), -1
    )
    stop_pos_B = positions_BK[rows, n_B]
    target_BV = target_probs_BKV[rows, n_B]
    residual_BV = (target_BV - draft_probs_BKV[rows, n_B.clamp(max=K - 1)]).clamp(min=0)
    residual_BV = torch.where(residual_BV.sum(-1, keepdim=True) > 0, residual_BV, target_BV)
    recovered_B = sample_keyed(residual_BV, noise, stop_pos_B, stream="residual")
    bonus_B = sample_keyed(target_BV, noise, stop_pos_B)
    tokens_BK1[rows, n_B] = torch.where(n_B < K, recovered_B, bonus_B)
    return VerifyResult(tokens_BK1, n_B)


def _exact(target_probs_BKV, draft_tokens_BK, draft_probs_BKV, *, noise, positions_BK):
    return rejection_sample(
        target_probs_BKV, draft_tokens_BK, draft_probs_BKV, noise=noise, positions_BK=positions_BK
    )


def _gumbel(target_probs_BKV, draft_tokens_BK, draft_probs_BKV, *, noise, positions_BK):
    return gumbel_verify(
        target_probs_BKV, draft_tokens_BK, draft_probs_BKV, noise=noise, positions_BK=positions_BK
    )


# --- the checks --------------------------------------------------------------------------------------------

MARKOV_5 = dict(target=MarkovModel.random(5, seed=51), drafter=MarkovModel.random(5, seed=52))
MARKOV_3 = dict(target=MarkovModel.random(3, seed=53), drafter=MarkovModel.random(3, seed=54))
SAMPLING = SamplingParams(temperature=0.9, top_p=0.9)
DEPTHS = (2, 0, 3, 1)  # the draft depth changes from step to step


def test_plain_keyed_sampling_follows_the_target():
    """Plain keyed decoding over seeds: the three-token joint is the target's (top-p zeros stay zero)."""
    expected = target_sequence_distribution(MARKOV_5["target"], num_tokens=3, context=(1,), sampling=SAMPLING)
    counts = plain_keyed_run(
        MARKOV_5["target"], num_samples=sample_size(expected), num_tokens=3, context=(1,), sampling=SAMPLING
    )
    check(counts, expected, "plain keyed sampling", exact=True)


@pytest.mark.parametrize(
    "rule, draft, exact",
    [
        (_exact, "independent", True),
        (_exact, "coupled", True),
        (_exact, "point_mass", True),
        (_gumbel, "independent", True),
        (_gumbel, "coupled", True),
        (gumbel_positions_reused, "coupled", False),
        (exact_ratio_inverted, "independent", False),
    ],
    ids=[
        "exact-independent",
        "exact-coupled",
        "exact-point-mass",
        "gumbel-independent",
        "gumbel-coupled",
        "mutant:gumbel_positions_reused",
        "mutant:exact_ratio_inverted",
    ],
)
def test_stream_follows_the_target(rule, draft, exact):
    """Three-token streams over seeds, with the depth changing every step and temperature + top-p on
    both sides, against the target's processed joint."""
    expected = target_sequence_distribution(MARKOV_5["target"], num_tokens=3, context=(1,), sampling=SAMPLING)
    counts = keyed_run(
        **MARKOV_5,
        rule=rule,
        num_samples=sample_size(expected),
        depths=DEPTHS,
        context=(1,),
        num_tokens=3,
        draft=draft,
        sampling=SAMPLING,
        seed0=1_000_000,
    )
    check(counts, expected, f"stream, {rule.__name__}, {draft} drafts", exact)


MARKOV_4 = dict(target=MarkovModel.random(4, seed=57), drafter=MarkovModel.random(4, seed=58))


@pytest.mark.parametrize(
    "rule, draft, models, exact",
    [
        (_exact, "independent", MARKOV_3, True),
        (_exact, "coupled", MARKOV_4, True),
        (exact_bonus_dropped, "independent", MARKOV_3, False),
        (exact_residual_on_sample_stream, "coupled", MARKOV_4, False),
    ],
    ids=[
        "exact-independent",
        "exact-coupled",
        "mutant:exact_bonus_dropped",
        "mutant:exact_residual_on_sample_stream",
    ],
)
def test_one_exact_step_keeps_the_algorithm_1_law(rule, draft, models, exact):
    """Everything one keyed exact step emits (1..γ+1 tokens), against Algorithm 1's law enumerated
    through the real rejection_sample (probed with chosen uniforms): same acceptance, residual and
    bonus, whether the drafts are drawn independently or coupled with the target's "sample" stream."""
    expected = expected_output_distribution(**models, gamma=2, context=(0,))
    counts = keyed_run(
        **models,
        rule=rule,
        num_samples=sample_size(expected),
        depths=(2,),
        context=(0,),
        draft=draft,
        seed0=2_000_000,
    )
    check(counts, expected, f"one step, {rule.__name__}, {draft} drafts", exact)


def test_one_gumbel_step_law():
    """Everything one gumbel step emits with independent drafts, against its enumerated law."""
    expected = gumbel_step_law(MARKOV_3["target"], MARKOV_3["drafter"], 2, (2,))
    assert abs(sum(expected.values()) - 1.0) < 1e-12
    counts = keyed_run(
        **MARKOV_3,
        rule=_gumbel,
        num_samples=sample_size(expected),
        depths=(2,),
        context=(2,),
        seed0=3_000_000,
    )
    check(counts, expected, "one gumbel step", exact=True)
    # Its tokens per step (Σ p·q acceptance) are below the exact rule's (Σ min(p, q)) on these toys.
    exact_law = expected_output_distribution(**MARKOV_3, gamma=2, context=(2,))
    tau_gumbel, tau_exact = (sum(len(s) * pr for s, pr in law.items()) for law in (expected, exact_law))
    print(f"tokens per step: gumbel {tau_gumbel:.3f}, exact {tau_exact:.3f}")
    assert tau_gumbel < tau_exact
