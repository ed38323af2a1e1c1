"""Typed configs, canonical JSON, stable run ids, sweeps and shards (experiments.config, .sweep)."""

from __future__ import annotations

import json
from dataclasses import FrozenInstanceError, dataclass

import pytest

from experiments.catalog.leviathan_table1 import Table1RowConfig
from experiments.config import (
    canonical_json,
    config_from_dict,
    config_to_dict,
    load_config,
    replace_fields,
    run_id,
    validate_config,
)
from experiments.sweep import Axis, Sweep, expand, parse_shard, shard


@dataclass(frozen=True, kw_only=True)
class Sampling:
    temperature: float = 1.0
    top_p: float | None = None

    def __post_init__(self) -> None:
        validate_config(self)


@dataclass(frozen=True, kw_only=True)
class Run:
    drafter: str = "ngram"
    target: str = "smollm2-135m"
    gamma: int = 4
    prompts: tuple[str, ...] = ("humaneval",)
    sampling: Sampling = Sampling()

    def __post_init__(self) -> None:
        validate_config(self)
        if self.gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {self.gamma}")


def test_configs_are_frozen_and_keyword_only():
    config = Run()
    with pytest.raises(FrozenInstanceError):
        config.gamma = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        Run("ngram")  # type: ignore[misc]


def test_validation_coerces_and_names_the_field():
    config = Run(prompts=["a", "b"], sampling=Sampling(temperature=1))
    assert config.prompts == ("a", "b") and isinstance(config.sampling.temperature, float)
    with pytest.raises(ValueError, match=r"Run\.gamma must be an int"):
        Run(gamma=2.5)
    with pytest.raises(ValueError, match=r"Run\.gamma must be an int"):
        Run(gamma=True)
    with pytest.raises(ValueError, match=r"Sampling\.temperature must be finite"):
        Sampling(temperature=float("nan"))
    with pytest.raises(ValueError, match=r"Sampling\.top_p must be"):
        Sampling(top_p="high")
    with pytest.raises(ValueError, match="gamma must be >= 0"):
        Run(gamma=-1)


def test_run_id_is_a_stable_hash_of_the_canonical_config():
    a, b = Run(sampling=Sampling(temperature=1)), Run(sampling=Sampling(temperature=1.0))
    assert canonical_json(a) == canonical_json(b) and run_id(a) == run_id(b)
    assert len(run_id(a)) == 16 and int(run_id(a), 16) >= 0
    payload = json.loads(canonical_json(a))
    assert payload["type"].endswith(":Run") and payload["config"]["sampling"] == {
        "temperature": 1.0,
        "top_p": None,
    }
    assert canonical_json(a) == json.dumps(payload, sort_keys=True, separators=(",", ":"))
    changed = {
        run_id(replace_fields(a, {k: v})) for k, v in [("gamma", 5), ("drafter", "eagle"), ("prompts", ())]
    }
    assert len(changed | {run_id(a)}) == 4
    # Pinned: run folders written by earlier versions must keep their ids (canonical JSON + SHA-256[:16]).
    assert run_id(Table1RowConfig(alpha=0.6, gamma=2)) == "1cb9f15a135422cf"


def test_run_id_depends_on_the_config_type():
    @dataclass(frozen=True, kw_only=True)
    class Other:
        drafter: str = "ngram"

    @dataclass(frozen=True, kw_only=True)
    class Same:
        drafter: str = "ngram"

    assert config_to_dict(Other()) == config_to_dict(Same()) and run_id(Other()) != run_id(Same())


def test_from_dict_and_yaml(tmp_path):
    config = config_from_dict(Run, {"gamma": 2, "sampling": {"temperature": 0}, "prompts": ["mt"]})
    assert config == Run(gamma=2, sampling=Sampling(temperature=0.0), prompts=("mt",))
    assert config_from_dict(Run, config_to_dict(config)) == config
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['gama'\]"):
        config_from_dict(Run, {"gama": 2})
    path = tmp_path / "run.yaml"
    path.write_text("drafter: layerskip\ngamma: 6\nsampling:\n  temperature: 0.7\n  top_p: 0.9\n")
    assert load_config(Run, path) == Run(
        drafter="layerskip", gamma=6, sampling=Sampling(temperature=0.7, top_p=0.9)
    )
    path.write_text("- not a mapping\n")
    with pytest.raises(ValueError, match="expected a YAML mapping"):
        load_config(Run, path)


def test_replace_fields_reaches_nested_configs():
    config = replace_fields(Run(), {"sampling.temperature": 0.0, "gamma": 2})
    assert config.sampling.temperature == 0.0 and config.gamma == 2 and Run().gamma == 4
    with pytest.raises(ValueError, match="'gama' is not a field of Run"):
        replace_fields(Run(), {"gama": 2})
    with pytest.raises(ValueError, match="not a nested config"):
        replace_fields(Run(), {"gamma.x": 2})


def test_sweep_grid_order_and_zipped_axes():
    sweep = Sweep(Run(), {"gamma": [1, 2, 3], "target,drafter": [("a", "x"), ("b", "y")]})
    configs = sweep.configs()
    assert len(sweep) == len(configs) == 6
    assert [(c.gamma, c.target, c.drafter) for c in configs[:3]] == [
        (1, "a", "x"),
        (1, "b", "y"),
        (2, "a", "x"),
    ]
    same = Sweep(
        Run(), (Axis.of("gamma", [1, 2, 3]), Axis.of(("target", "drafter"), [("a", "x"), ("b", "y")]))
    )
    assert same.configs() == configs
    nested = Sweep(Run(), {"sampling.temperature": [0.0, 1.0], "sampling.top_p": [None, 0.9]}).configs()
    assert {(c.sampling.temperature, c.sampling.top_p) for c in nested} == {
        (0.0, None),
        (0.0, 0.9),
        (1.0, None),
        (1.0, 0.9),
    }


def test_sweep_errors_name_the_problem():
    with pytest.raises(ValueError, match="axis field 'gama' is not a field of Run"):
        Sweep(Run(), {"gama": [1]})
    with pytest.raises(ValueError, match="appears on two axes"):
        Sweep(Run(), {"gamma": [1], "gamma,drafter": [(2, "x")]})
    with pytest.raises(ValueError, match="sets 2 fields, but a value has 3"):
        Sweep(Run(), {"target,drafter": [("a", "x", "z")]})
    with pytest.raises(ValueError, match="has no values"):
        Sweep(Run(), {"gamma": []})
    with pytest.raises(ValueError, match="gamma must be >= 0"):
        Sweep(Run(), {"gamma": [1, -1]}).configs()


def test_expand_concatenates_and_dedupes():
    a = Sweep(Run(), {"gamma": [1, 2]})
    b = Sweep(Run(), {"gamma": [2, 3]})
    assert [c.gamma for c in expand([a, b])] == [1, 2, 3]
    assert [c.gamma for c in expand(a)] == [1, 2]
    overridden = a.with_overrides(base={"drafter": "eagle"}, axes={"gamma": [7]})
    assert [(c.drafter, c.gamma) for c in overridden.configs()] == [("eagle", 7)]


def test_shards_partition_the_sweep_deterministically():
    configs = Sweep(Run(), {"gamma": list(range(10)), "drafter": ["ngram", "eagle", "none"]}).configs()
    for n in (1, 2, 3, 7):
        parts = [shard(configs, i, n) for i in range(n)]
        ids = [run_id(c) for part in parts for c in part]
        assert sorted(ids) == sorted(run_id(c) for c in configs) and len(set(ids)) == len(configs)
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        assert parts == [shard(configs, i, n) for i in range(n)]
    # The split depends on the set of runs, not on axis order.
    swapped = Sweep(Run(), {"drafter": ["ngram", "eagle", "none"], "gamma": list(range(10))}).configs()
    assert {run_id(c) for c in shard(swapped, 1, 3)} == {run_id(c) for c in shard(configs, 1, 3)}


@pytest.mark.parametrize("text", ["2/2", "-1/2", "1", "a/b", "0/0", "1/2/3"])
def test_parse_shard_rejects_bad_specs(text):
    with pytest.raises(ValueError, match="shard must"):
        parse_shard(text)


def test_parse_shard():
    assert parse_shard("0/1") == (0, 1) and parse_shard("3/4") == (3, 4)
