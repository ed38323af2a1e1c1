"""Unit tests of specdec.sampling: logits_to_probs (temperature → top-k → top-p) and sample_from_probs.

Legend: N rows, V vocabulary.
"""

import math

import pytest
import torch

from specdec.sampling import SamplingParams, logits_to_probs, sample_from_probs


def _log(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


# --- output format ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize(
    "kwargs", [{}, {"temperature": 0.0}, {"temperature": 0.7, "top_k": 3}, {"top_p": 0.8}]
)
def test_output_is_float32_normalised_and_keeps_shape(dtype, kwargs):
    logits_NV = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0)).to(dtype)
    probs = logits_to_probs(logits_NV, **kwargs)
    assert probs.dtype == torch.float32
    assert probs.shape == logits_NV.shape
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3), atol=1e-6, rtol=0)


def test_rows_are_processed_independently():
    logits_NV = torch.randn(5, 9, generator=torch.Generator().manual_seed(1))
    batched = logits_to_probs(logits_NV, temperature=0.8, top_k=5, top_p=0.7)
    for row in range(5):
        torch.testing.assert_close(batched[row], logits_to_probs(logits_NV[row], 0.8, 5, 0.7))


def test_plain_temperature_is_softmax_of_scaled_logits():
    logits_NV = torch.randn(4, 7, generator=torch.Generator().manual_seed(2))
    for t in (0.3, 1.0, 2.5):
        torch.testing.assert_close(logits_to_probs(logits_NV, t), torch.softmax(logits_NV / t, -1))


# --- greedy ----------------------------------------------------------------------------------------


def test_temperature_zero_is_one_hot_argmax():
    logits_NV = torch.randn(6, 10, generator=torch.Generator().manual_seed(3))
    probs = logits_to_probs(logits_NV, temperature=0.0, top_k=4, top_p=0.5)
    expected = torch.nn.functional.one_hot(logits_NV.argmax(-1), 10).float()
    assert torch.equal(probs, expected)


def test_temperature_zero_ties_go_to_the_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [0.0, -1.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, temperature=0.0)
    assert probs.argmax(-1).tolist() == [1, 0, 0]
    assert torch.equal(probs.sum(-1), torch.ones(3))
    assert int((probs > 0).sum()) == 3


# --- top-k and top-p -----------------------------------------------------------------------------------


def test_top_k_keeps_the_k_largest_and_ties_go_to_lower_ids():
    logits = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.0])
    probs = logits_to_probs(logits, top_k=2)
    assert probs.tolist() == pytest.approx([0.0, 0.5, 0.5, 0.0, 0.0])
    probs = logits_to_probs(torch.tensor([0.1, 3.0, -1.0, 2.0]), top_k=2)
    torch.testing.assert_close(probs, torch.softmax(torch.tensor([-math.inf, 3.0, -math.inf, 2.0]), -1))


def test_top_k_one_is_the_argmax_and_k_at_least_v_is_a_no_op():
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(4))
    assert torch.equal(logits_to_probs(logits, top_k=1), logits_to_probs(logits, temperature=0.0))
    torch.testing.assert_close(logits_to_probs(logits, top_k=6), torch.softmax(logits, -1))
    torch.testing.assert_close(logits_to_probs(logits, top_k=100), torch.softmax(logits, -1))
    torch.testing.assert_close(logits_to_probs(logits, top_p=1.0), torch.softmax(logits, -1))


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.45, [0]), (0.55, [0, 1]), (0.79, [0, 1]), (0.81, [0, 1, 2]), (0.999, [0, 1, 2, 3])],
)
def test_top_p_keeps_the_token_that_crosses_p(top_p, kept):
    # sorted probabilities 0.5, 0.3, 0.15, 0.05 (cumulative 0.5, 0.8, 0.95, 1.0), shuffled ids
    ids = [2, 0, 3, 1]
    probs_V = [0.0] * 4
    for rank, p in zip(ids, [0.5, 0.3, 0.15, 0.05], strict=True):
        probs_V[rank] = p
    out = logits_to_probs(_log(probs_V), top_p=top_p)
    kept_ids = [ids[r] for r in kept]
    assert sorted(torch.nonzero(out > 0).flatten().tolist()) == sorted(kept_ids)
    mass = sum(probs_V[i] for i in kept_ids)
    for i in kept_ids:
        assert out[i].item() == pytest.approx(probs_V[i] / mass, rel=1e-5)


def test_top_p_ties_go_to_lower_ids():
    out = logits_to_probs(torch.zeros(4), top_p=0.3)  # mass before: 0, .25, .5 -> keep ids 0, 1
    assert out.tolist() == pytest.approx([0.5, 0.5, 0.0, 0.0])


def test_temperature_is_applied_before_top_p():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    # At T=1 the 0.8-nucleus is {0, 1} (0.644, 0.237); at T=3 the flatter distribution (0.385, 0.276,
    # 0.198, 0.142) needs {0, 1, 2}. Top-p before temperature would keep {0, 1} at any T.
    assert (logits_to_probs(logits, temperature=1.0, top_p=0.8) > 0).tolist() == [True, True, False, False]
    out = logits_to_probs(logits, temperature=3.0, top_p=0.8)
    torch.testing.assert_close(out, torch.softmax(torch.tensor([2.0, 1.0, 0.0, -math.inf]) / 3.0, -1))


def test_top_k_is_applied_before_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    # top-k=2 renormalises to (0.731, 0.269): the 0.7-nucleus is token 0 alone. Top-p first on the
    # full softmax (0.644, 0.237, ...) would keep {0, 1}.
    assert logits_to_probs(logits, top_k=2, top_p=0.7).tolist() == [1.0, 0.0, 0.0, 0.0]
    # and top-k=3 then top-p=0.95: renormalised (0.665, 0.245, 0.090) keeps all three.
    out = logits_to_probs(logits, top_k=3, top_p=0.95)
    torch.testing.assert_close(out, torch.softmax(torch.tensor([3.0, 2.0, 1.0, -math.inf]), -1))


def test_full_order_temperature_top_k_top_p():
    logits = torch.tensor([4.0, 3.0, 2.5, 2.0, 0.0, -3.0])
    t, k, p = 2.0, 4, 0.6
    scaled = logits / t
    top = torch.softmax(torch.where(torch.arange(6) < k, scaled, -math.inf), -1)  # already sorted
    mass_before = torch.cumsum(top, -1) - top
    nucleus = torch.where(mass_before < p, top, 0.0)
    torch.testing.assert_close(logits_to_probs(logits, t, k, p), nucleus / nucleus.sum())


def test_filtered_tokens_get_exactly_zero():
    logits = torch.randn(8, 12, generator=torch.Generator().manual_seed(5))
    out = logits_to_probs(logits, top_k=5, top_p=0.9)
    assert ((out > 0).sum(-1) <= 5).all()
    assert (out[out < 1e-30] == 0).all()


# --- bad arguments ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -3}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.2}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
    ],
)
def test_bad_sampling_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        logits_to_probs(torch.zeros(4), **kwargs)
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_bad_logits_raise_value_error():
    with pytest.raises(ValueError, match="logits"):
        logits_to_probs(torch.tensor([1, 2, 3]))  # integer dtype
    with pytest.raises(ValueError, match="logits"):
        logits_to_probs(torch.tensor(1.0))  # no vocab dim
    with pytest.raises(ValueError, match="logits"):
        logits_to_probs(torch.zeros(3, 0))  # V = 0


def test_sampling_params_is_frozen_and_keyword_only():
    s = SamplingParams(temperature=0.0, top_k=3)
    assert s.greedy and not SamplingParams().greedy
    with pytest.raises(AttributeError):
        s.temperature = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        SamplingParams(1.0)  # type: ignore[misc]


# --- sample_from_probs ---------------------------------------------------------------------------------


def test_sample_from_probs_shapes_and_point_masses():
    probs_NV = torch.nn.functional.one_hot(torch.tensor([[3, 0], [1, 2]]), 4).float()
    out = sample_from_probs(probs_NV)
    assert out.dtype == torch.long and out.shape == (2, 2)
    assert out.tolist() == [[3, 0], [1, 2]]
    assert sample_from_probs(torch.zeros(0, 5)).shape == (0,)


def test_sample_from_probs_is_seeded_and_accepts_unnormalised_weights():
    weights = torch.tensor([[2.0, 0.0, 6.0]]).expand(1000, 3)
    a = sample_from_probs(weights, torch.Generator().manual_seed(7))
    b = sample_from_probs(weights, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    assert set(a.tolist()) == {0, 2}  # never the zero-weight id
