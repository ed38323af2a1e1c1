"""The engine experiments' own logic: plans, prompt categories, theory curve, log-likelihood."""

from __future__ import annotations

import math

import pytest
import torch

from experiments.catalog import (
    gamma_sweep,
    leviathan_table3_analog,
    lossy_quality,
    speedup_table,
)
from experiments.catalog.specdec_runs import (
    CATEGORIES,
    TINY_TARGET,
    DecodeRunConfig,
    InterleavedRunConfig,
    category_prompts,
    drafter_unavailable,
    open_target,
    sequence_log_likelihood,
    torch_threads,
)
from specdec.metrics import predicted_speedup


def test_full_plans_cover_the_issue():
    table3 = leviathan_table3_analog.EXPERIMENT.configs()
    drafters = {c.drafter for c in table3}
    assert {"unigram", "bigram", "ngram", "layerskip"} <= drafters
    assert {c.temperature for c in table3} == {0.0, 1.0} and all(c.gamma == 1 for c in table3)
    assert len(table3) == 2 * len(drafters)
    speed = speedup_table.EXPERIMENT.configs()
    assert [c.category for c in speed] == list(CATEGORIES) and len(CATEGORIES) == 9
    assert all(c.temperature == 0.0 and {"ngram", "bigram", "layerskip"} <= set(c.drafters) for c in speed)
    gammas = gamma_sweep.EXPERIMENT.configs()
    assert {"ngram", "bigram"} <= {c.drafter for c in gammas}
    assert all(c.gammas == (1, 2, 3, 4, 6, 8) and c.max_gamma_theory == 8 for c in gammas)
    lossy = lossy_quality.EXPERIMENT.configs()
    assert all(c.leniences == (1.0, 0.5, 0.3, 0.1) for c in lossy)
    assert {c.temperature for c in lossy} == {0.0, 1.0}
    # eagle runs exactly when its weights are shipped
    eagle_ready = drafter_unavailable("eagle", "smollm2-135m") is None
    assert ("eagle" in drafters) == eagle_ready
    assert ("eagle" in {c.drafter for c in gammas}) == eagle_ready
    assert drafter_unavailable("eagle", TINY_TARGET) is not None
    assert drafter_unavailable("no-such-drafter", TINY_TARGET) == "no-such-drafter: not registered"


def test_prompt_categories():
    for category in CATEGORIES:
        prompts = category_prompts(category, 2)
        assert len(prompts) == 2 and all(isinstance(p, str) and p for p in prompts)
    assert len(category_prompts("mtbench/math", 100)) == 10
    assert "def has_close_elements" in category_prompts("humaneval", 1)[0]
    with pytest.raises(ValueError, match="unknown prompt category"):
        category_prompts("mtbench/poetry", 1)
    with pytest.raises(ValueError, match="num_prompts"):
        category_prompts("humaneval", 0)


def test_theory_curve_is_the_cost_model():
    verify = {1: 0.010, 2: 0.012, 3: 0.014, 5: 0.020}
    curve = gamma_sweep.theory_curve(
        alpha=0.6, t_draft=0.001, t_target=0.010, verify_time_by_block=verify, max_gamma=6
    )
    assert len(curve) == 7 and curve[0] == pytest.approx(1.0)
    assert curve[2] == pytest.approx(
        predicted_speedup(alpha=0.6, gamma=2, t_draft=0.001, t_verify=0.014, t_target=0.010)
    )
    # T = 4 unmeasured: interpolated between 3 and 5; T > 5: flat at the longest measured block
    assert curve[3] == pytest.approx(
        predicted_speedup(alpha=0.6, gamma=3, t_draft=0.001, t_verify=0.017, t_target=0.010)
    )
    assert curve[6] == pytest.approx(
        predicted_speedup(alpha=0.6, gamma=6, t_draft=0.001, t_verify=0.020, t_target=0.010)
    )


def test_table3_shape_check():
    class Rec:
        def __init__(self, alpha):
            self.result = {"alpha": alpha}

    by = {("unigram", 0.0): Rec(0.05), ("bigram", 0.0): Rec(0.2), ("layerskip", 0.0): Rec(0.4)}
    by |= {("unigram", 1.0): Rec(0.05), ("bigram", 1.0): Rec(0.03), ("layerskip", 1.0): Rec(0.4)}
    assert leviathan_table3_analog._shape(by) == {"T=0": True, "T=1": False}
    published = leviathan_table3_analog.PUBLISHED
    assert published[("T5-XXL (EnDe)", "Bigram")] == (0.20, 0.19) and len(published) == 16
    assert leviathan_table3_analog._paper_cell("unigram", 0) == "0.03 / 0.08 / 0.13"
    assert leviathan_table3_analog._paper_cell("ngram", 1) is None


def test_configs_validate():
    with pytest.raises(ValueError, match="without 'none'"):
        speedup_table.SpeedupConfig(drafters=("none", "ngram"))
    with pytest.raises(ValueError, match="gammas"):
        gamma_sweep.GammaSweepConfig(gammas=(0, 1))
    with pytest.raises(ValueError, match="leniences"):
        lossy_quality.LossyQualityConfig(leniences=(1.0, 0.0))
    with pytest.raises(ValueError, match="gamma"):
        leviathan_table3_analog.AcceptanceConfig(gamma=0)


def test_decode_configs_share_one_base():
    from experiments.catalog.serving_load import ServingLoadConfig

    local = [
        gamma_sweep.GammaSweepConfig,
        speedup_table.SpeedupConfig,
        leviathan_table3_analog.AcceptanceConfig,
        lossy_quality.LossyQualityConfig,
    ]
    assert all(issubclass(cls, InterleavedRunConfig) for cls in local)
    assert issubclass(ServingLoadConfig, DecodeRunConfig)
    assert gamma_sweep.GammaSweepConfig().max_new_tokens == 96  # a subclass may restate a default
    assert speedup_table.SpeedupConfig().max_new_tokens == 128
    with pytest.raises(ValueError, match=r"AcceptanceConfig\.gamma must be >= 1, got 0"):
        leviathan_table3_analog.AcceptanceConfig(gamma=0)
    with pytest.raises(ValueError, match=r"SpeedupConfig\.max_new_tokens must be >= 2, got 1"):
        speedup_table.SpeedupConfig(max_new_tokens=1)
    with pytest.raises(ValueError, match=r"LossyQualityConfig\.num_threads must be >= 0, got -1"):
        lossy_quality.LossyQualityConfig(num_threads=-1)
    with pytest.raises(ValueError, match=r"ServingLoadConfig\.threads must be >= 1, got 0"):
        ServingLoadConfig(threads=0)


def test_sequence_log_likelihood_matches_transformers():
    from transformers import AutoModelForCausalLM

    from experiments.catalog.specdec_runs import tiny_checkpoint

    target = open_target(TINY_TARGET)
    prompt, generated = [5, 9, 33, 70], [101, 7, 7, 250]
    ours = sequence_log_likelihood(target, prompt, generated)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint()).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].double()
    logp = (
        torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(1, torch.tensor(generated)[:, None]).sum()
    )
    assert ours == pytest.approx(float(logp), abs=1e-3)
    assert sequence_log_likelihood(target, prompt, []) == 0.0
    assert math.isfinite(ours) and ours < 0


def test_torch_threads_restores_the_setting():
    before = torch.get_num_threads()
    with torch_threads(1) as n:
        assert n == 1 == torch.get_num_threads()
    assert torch.get_num_threads() == before
    with torch_threads(0) as n:
        assert n == before
    with pytest.raises(ValueError, match="num_threads"), torch_threads(-1):
        pass
