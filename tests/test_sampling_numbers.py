"""Sampling numbers at their edges: seeds in [0, 2**64) (numpy ints too), temperatures below float32."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from _tiny import TableTarget, random_table

import specdec
from experiments.config import validate_config
from specdec.bench import BenchConfig
from specdec.cli import main
from specdec.sampling import MIN_TEMPERATURE, SamplingParams, logits_to_probs, sample_from_probs
from specdec.seeds import check_seed

BAD_SEEDS = [-1, 2**64, 99999999999999999999999, True, 1.0, "3", None, np.bool_(True), np.float64(2.0)]


def test_check_seed_accepts_ints_in_range_and_numpy_ints():
    for seed in (0, 1, 2**63, 2**64 - 1, np.int64(5), np.uint64(2**64 - 1), np.int32(7), np.uint8(3)):
        value = check_seed(seed)
        assert type(value) is int and value == int(seed)
    for bad in BAD_SEEDS:
        with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
            check_seed(bad)
    with pytest.raises(ValueError, match="Config.seed must be"):
        check_seed(-3, "Config.seed")


def _run(seed, temperature: float = 1.0):
    target = TableTarget(random_table(11, seed=2))
    return specdec.generate(
        target,
        [[1, 2, 3]],
        drafter="ngram",
        max_new_tokens=12,
        temperature=temperature,
        seed=seed,
        ignore_eos=True,
    ).token_ids


def test_generate_seeds():
    assert _run(np.int64(7)) == _run(7)  # a numpy seed is the same seed
    top = _run(2**64 - 1)
    assert top == _run(np.uint64(2**64 - 1))
    for bad in (-1, 2**64, 99999999999999999999999, True, 1.5):
        with pytest.raises(ValueError, match="seed must be an int in"):
            _run(bad)


def test_temperatures_below_float32_are_refused_naming_the_smallest():
    for tiny in (1e-50, 2.0**-150, 1e-300):
        with pytest.raises(
            ValueError, match=r"temperature must be 0 \(greedy\) or at least 1\.4012984643\d*e-45"
        ):
            SamplingParams(temperature=tiny)
        with pytest.raises(ValueError, match="smallest positive float32"):
            logits_to_probs(torch.zeros(3), tiny)
    with pytest.raises(ValueError, match="temperature must be a number"):
        SamplingParams(temperature=True)
    # The smallest usable temperature gives a valid (limit) distribution: uniform over the maximal logits.
    logits = torch.tensor([[2.0, 1.0, 2.0, -5.0], [0.0, 3.0, 1e-3, 2.999]])
    probs = logits_to_probs(logits, MIN_TEMPERATURE)
    assert torch.isfinite(probs).all()
    assert probs.tolist() == [[0.5, 0.0, 0.5, 0.0], [0.0, 1.0, 0.0, 0.0]]
    assert sample_from_probs(probs, torch.Generator().manual_seed(0)).shape == (2,)
    assert len(_run(0, temperature=MIN_TEMPERATURE)[0]) == 12


def test_cli_seed_and_temperature_fail_in_one_line_before_loading(tmp_path, capsys):
    base = ["generate", "--target", str(tmp_path / "no-such-model"), "--prompt", "x"]
    for seed in ("-1", "99999999999999999999999", "18446744073709551616", "1.0"):
        with pytest.raises(SystemExit) as exit_info:
            main([*base, "--seed", seed])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "argument --seed: expected an integer in [0, 2**64)" in err and err.count("\n") == 1
    assert main([*base, "--temperature", "1e-50"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "temperature must be 0 (greedy) or at least 1.4" in err
    assert "no-such-model" not in err  # refused before the (missing) model is looked up


def test_experiment_configs_and_bench_config_check_seeds():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class RunConfig:
        seed: int = 0

        def __post_init__(self) -> None:
            validate_config(self)

    assert RunConfig(seed=2**64 - 1).seed == 2**64 - 1
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match=r"RunConfig\.seed must be an int in \[0, 2\*\*64\)"):
            RunConfig(seed=bad)
    with pytest.raises(ValueError, match="seed must be an int in"):
        BenchConfig(seed=-1)
