"""experiments.bench_prefetch: argument checks, the report, and its place in `python -m experiments`.
(The timing itself needs the real target and minutes; its results are in experiments/results/cpu/.)"""

from __future__ import annotations

import pytest

from experiments import bench_prefetch
from experiments.cli import COMMANDS


@pytest.mark.parametrize("flag", ["--repeats", "--num-prompts", "--gamma", "--max-new-tokens", "--threads"])
def test_bad_counts_are_a_value_error_naming_the_flag(flag):
    args = bench_prefetch.build_parser().parse_args([flag, "0"])
    with pytest.raises(ValueError, match=flag):
        bench_prefetch.run(args, log=lambda s: None)


def test_empty_drafter_list_is_rejected_by_the_parser():
    with pytest.raises(SystemExit):
        bench_prefetch.build_parser().parse_args(["--drafters", ","])


def test_report_lists_every_row_with_its_speedup():
    record = {
        "command": "python -m experiments.bench_prefetch --repeats 1",
        "prompt_sets": ["humaneval"],
        "num_prompts": 2,
        "gamma": 6,
        "max_new_tokens": 16,
        "threads": 2,
        "rows": [
            {"method": "none", "tokens_per_second": 70.0, "speedup": 1.0},
            {"method": "eagle (no sw prefetch)", "tokens_per_second": 105.04, "speedup": 1.5006},
        ],
    }
    text = bench_prefetch.to_markdown(record)
    assert "Command: `python -m experiments.bench_prefetch --repeats 1`" in text
    assert "| none | 70.0 | 1.00× |" in text
    assert "| eagle (no sw prefetch) | 105.0 | 1.50× |" in text


def test_registered_as_an_experiments_command():
    assert "bench-prefetch" in COMMANDS.names()
    assert COMMANDS.get("bench-prefetch") is bench_prefetch.main
