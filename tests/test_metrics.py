"""SpecMetrics: definitions (α, τ, histogram, latencies), pooling, and the predicted speedup."""

from __future__ import annotations

import json

import pytest

from specdec.metrics import (
    MetricsRecorder,
    StepStats,
    expected_tokens_per_step,
    merge_metrics,
    predicted_speedup,
    predicted_speedup_from_metrics,
)


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 5) == 1.0
    assert expected_tokens_per_step(1.0, 5) == 6.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_per_step(0.8, 0) == 1.0
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_step(1.2, 3)
    with pytest.raises(ValueError, match="gamma"):
        expected_tokens_per_step(0.5, -1)


def test_predicted_speedup_closed_form():
    # Leviathan et al. Table/eq.: α=0.8, γ=4 → E = (1-0.8^5)/0.2 = 3.3616 tokens per step
    e = (1 - 0.8**5) / 0.2
    s = predicted_speedup(alpha=0.8, gamma=4, t_draft=0.002, t_verify=0.05, t_target=0.035)
    assert s == pytest.approx(e * 0.035 / (4 * 0.002 + 0.05))
    # γ = 0: plain decoding, speedup = t_target / t_verify(1)
    assert predicted_speedup(
        alpha=0.3, gamma=0, t_draft=1.0, t_verify=0.035, t_target=0.035
    ) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        predicted_speedup(alpha=0.5, gamma=0, t_draft=0.0, t_verify=0.0, t_target=1.0)


def record(rec: MetricsRecorder, K: int, accepted: list[int], draft_s: float, verify_s: float, wall: float):
    rec.record_step(
        StepStats(
            gamma=K,
            num_drafted=K,
            num_accepted=accepted,
            draft_time_s=draft_s,
            target_time_s=verify_s,
            verify_time_s=verify_s,
        )
    )
    for a in accepted:
        rec.record_commit(wall, a + 1)


def test_recorder_definitions():
    rec = MetricsRecorder()
    rec.record_prefill(0.1, 0.0, 0.12, 2)
    record(rec, 3, [3, 0], 0.006, 0.05, 0.06)  # row 0 all accepted + bonus (4), row 1 rejected first (1)
    record(rec, 3, [1, 2], 0.006, 0.05, 0.06)
    m = rec.finish(1.0)
    assert m.num_proposed == 12 and m.num_accepted == 6
    assert m.acceptance_rate == pytest.approx(0.5)
    assert m.mean_accepted_tokens == pytest.approx(
        (4 + 1 + 2 + 3) / 4
    )  # τ: tokens per verify, bonus included
    assert m.num_rejections == 3
    assert m.alpha_iid == pytest.approx(6 / (6 + 3))
    # position k accepted / proposed: k=0: rows (3,0,1,2) → 3/4; k=1: (3,2) → 2/4; k=2: (3) → 1/4
    assert m.acceptance_histogram == pytest.approx([0.75, 0.5, 0.25])
    assert m.num_generated_tokens == 2 + 10
    assert m.tokens_per_second == pytest.approx(12.0)
    assert m.ttft_s == pytest.approx(0.12)
    assert m.num_target_calls == 3 and m.num_steps == 2 and m.num_row_steps == 4
    assert m.draft_time_per_token_s == pytest.approx(0.012 / 6)
    assert m.verify_time_by_block == {4: pytest.approx(0.05)}
    # per-token latency: a step's wall time shared by the tokens it committed
    assert sorted(set(round(x, 6) for x in m.token_latencies_s)) == [0.015, 0.02, 0.03, 0.06]
    assert m.latency_p50_s <= m.latency_p99_s <= 0.06
    assert m.tpot_s == pytest.approx(sum(m.token_latencies_s) / 10)
    d = m.to_dict()
    json.dumps(d)
    assert "token_latencies_s" not in d
    for key in (
        "acceptance_rate",
        "mean_accepted_tokens",
        "tokens_per_second",
        "ttft_s",
        "tpot_s",
        "acceptance_histogram",
        "latency_p50_s",
        "latency_p99_s",
        "target_time_s",
        "draft_time_s",
        "num_target_calls",
        "num_generated_tokens",
        "num_proposed",
        "num_accepted",
        "gamma_history",
    ):
        assert key in d


def test_merge_pools_counts():
    a, b = MetricsRecorder(), MetricsRecorder()
    a.record_prefill(0.1, 0.0, 0.1, 1)
    record(a, 2, [2], 0.002, 0.04, 0.05)
    b.record_prefill(0.1, 0.0, 0.2, 1)
    record(b, 4, [0], 0.004, 0.06, 0.07)
    record(b, 0, [0], 0.0, 0.03, 0.03)
    ma, mb = a.finish(0.5), b.finish(1.5)
    m = merge_metrics([ma, mb])
    assert m.num_proposed == 6 and m.num_accepted == 2
    assert m.mean_accepted_tokens == pytest.approx((3 + 1 + 1) / 3)
    assert m.acceptance_histogram == pytest.approx([1 / 2, 1 / 2, 0.0, 0.0])
    assert m.tokens_per_second == pytest.approx((ma.num_generated_tokens + mb.num_generated_tokens) / 2.0)
    assert m.verify_time_by_block == {1: pytest.approx(0.03), 3: pytest.approx(0.04), 5: pytest.approx(0.06)}
    assert m.draft_time_per_token_s == pytest.approx(0.006 / 6)
    with pytest.raises(ValueError):
        merge_metrics([])


def test_predicted_from_metrics_equals_closed_form_for_constant_gamma():
    rec = MetricsRecorder()
    rec.record_prefill(0.1, 0.0, 0.1, 1)
    for accepted in ([4], [1], [0], [4], [2]):
        record(rec, 4, accepted, 0.008, 0.05, 0.06)
    m = rec.finish(1.0)
    expected = predicted_speedup(alpha=m.alpha_iid, gamma=4, t_draft=0.002, t_verify=0.05, t_target=0.035)
    assert predicted_speedup_from_metrics(m, 0.035) == pytest.approx(expected)
    # a run with no verify step predicts nothing
    empty = MetricsRecorder()
    empty.record_prefill(0.1, 0.0, 0.1, 1)
    assert predicted_speedup_from_metrics(empty.finish(0.1), 0.035) == 0.0


def test_predicted_from_metrics_interpolates_unmeasured_block_lengths():
    rec = MetricsRecorder()
    rec.record_prefill(0.1, 0.0, 0.1, 1)
    record(rec, 0, [0], 0.0, 0.03, 0.03)  # T = 1
    record(rec, 2, [2], 0.002, 0.05, 0.05)  # T = 3
    m = rec.finish(1.0)
    alpha = m.alpha_iid  # 1.0: no rejection
    tokens = expected_tokens_per_step(alpha, 0) + expected_tokens_per_step(alpha, 2)
    cost = 0.03 + (2 * 0.001 + 0.05)
    assert predicted_speedup_from_metrics(m, 0.03) == pytest.approx(tokens * 0.03 / cost)
