"""The tiny MoE LM behind switch-tables and moe-verify-cost: exact FLOP/parameter matching, seeded training,
capacity dropping, real routing, checkpoints, and the experiments' trained tables at smoke size."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from rich.console import Console

from experiments.catalog.moe_verify_cost import TrainedVerifyCostConfig
from experiments.catalog.switch_trained import ThroughputConfig, base_config, trained_sweeps
from experiments.config import run_id
from experiments.registry import get_experiment
from experiments.runner import run_experiment
from experiments.sweep import Sweep
from experiments.text_corpus import heldout_windows, load_corpus
from experiments.theory.moe_routing import distinct_experts_per_block
from experiments.tiny_moe_lm import (
    CHECKPOINT_FILE,
    TinyLMConfig,
    TinyMoELM,
    TinyTrainConfig,
    active_flops_per_token,
    count_params,
    evaluate,
    load_checkpoint,
    load_imbalance,
    routed_experts,
    save_checkpoint,
    train,
)

TINY = TinyLMConfig(dim=16, heads=2, layers=2, seq_len=16, hidden_dim=24, num_experts=4)


def tiny_train(**model_fields) -> TinyTrainConfig:
    return TinyTrainConfig(
        model=dataclasses.replace(TINY, **model_fields),
        steps=6,
        batch_size=4,
        eval_interval=3,
        eval_sequences=8,
        max_corpus_bytes=1 << 15,
    )


@pytest.fixture(scope="module")
def corpus():
    return load_corpus("stdlib", max_bytes=1 << 15)


# ------------------------------------------------------------------------------------ sizes and FLOPs
@pytest.mark.parametrize("experts", [1, 2, 8, 16])
def test_top1_moe_matches_the_dense_active_flops_and_parameters_up_to_the_router(experts):
    dense, sparse = TinyLMConfig(num_experts=0), TinyLMConfig(num_experts=experts)
    router = dense.layers * dense.dim * experts
    assert active_flops_per_token(sparse) - active_flops_per_token(dense) == 2 * router
    assert count_params(sparse)["active"] - count_params(dense)["active"] == router
    expert = 3 * dense.dim * dense.hidden_dim
    assert (
        count_params(sparse)["total"] - count_params(dense)["total"]
        == router + (experts - 1) * expert * dense.layers
    )


def test_count_params_matches_the_built_model():
    for config in (
        TINY,
        dataclasses.replace(TINY, num_experts=0),
        dataclasses.replace(TINY, top_k=2, router="softmax_topk"),
    ):
        built = sum(p.numel() for p in TinyMoELM(config).parameters())
        assert count_params(config)["total"] == built


def test_load_imbalance_exact_values():
    assert load_imbalance(torch.tensor([5, 5, 5, 5])) == {"max_over_mean": 1.0, "cv": 0.0}
    skewed = load_imbalance(torch.tensor([4, 0, 0, 0]))
    assert skewed["max_over_mean"] == 4.0 and skewed["cv"] == pytest.approx(math.sqrt(3))


# ------------------------------------------------------------------------------------ data
def test_corpus_holds_out_whole_files_deterministically(corpus):
    again = load_corpus("stdlib", max_bytes=1 << 15)
    assert torch.equal(corpus.train, again.train) and torch.equal(corpus.heldout, again.heldout)
    assert corpus.info["train_bytes"] == corpus.info["heldout_bytes"] == 1 << 15
    assert corpus.train.dtype == torch.uint8
    assert bytes(corpus.train[:4096].tolist()) not in bytes(corpus.heldout.tolist())


def test_bad_configs_and_corpora_raise_value_errors():
    with pytest.raises(ValueError, match="divisible"):
        TinyLMConfig(dim=10, heads=3)
    with pytest.raises(ValueError, match="num_experts"):
        TinyLMConfig(num_experts=1, top_k=2)
    with pytest.raises(ValueError, match="capacity_factor"):
        TinyLMConfig(capacity_factor=0.0)
    with pytest.raises(ValueError, match="steps"):
        TinyTrainConfig(steps=0)
    with pytest.raises(ValueError, match="corpus"):
        load_corpus("no-such-corpus")
    with pytest.raises(ValueError, match="MoE"):
        TrainedVerifyCostConfig(train=tiny_train(num_experts=0))


# ------------------------------------------------------------------------------------ training
def test_training_is_seeded_and_learns(corpus):
    losses = [[], []]
    for run in losses:
        train(tiny_train(), corpus=corpus, log=lambda metrics, step, run=run: run.append(metrics["loss"]))
    assert losses[0] == losses[1]
    config = dataclasses.replace(tiny_train(), steps=40, eval_interval=40, lr=1e-2)
    _, result = train(config, corpus=corpus)
    assert result["heldout"]["loss"] < math.log(256) - 1.0  # bytes of Python source are far from uniform
    assert result["curve"][-1]["step"] == 40 and result["train_tokens"] == 40 * 4 * 16


def test_capacity_drops_at_least_what_the_capacity_forces(corpus):
    model, result = train(tiny_train(capacity_factor=0.5), corpus=corpus)
    tokens = 4 * 16  # one held-out batch, as in training
    kept_at_most = 4 * math.ceil(0.5 * tokens / 4)  # E experts x capacity
    assert result["heldout"]["drop_fraction"] >= 1 - kept_at_most / tokens
    assert result["train_drop_fraction"] >= 1 - kept_at_most / tokens
    _, dropless = train(tiny_train(), corpus=corpus)
    assert dropless["heldout"]["drop_fraction"] == dropless["train_drop_fraction"] == 0.0


def test_routed_experts_are_the_routers_choices_and_checkpoints_round_trip(corpus, tmp_path):
    model, _ = train(tiny_train(), corpus=corpus)
    experts_LTK = routed_experts(model, corpus.heldout, 40)  # 16 + 16 + 8: chunks of S
    assert [tuple(ids.shape) for ids in experts_LTK] == [(40, 1), (40, 1)]
    assert all(0 <= int(ids.min()) and int(ids.max()) < 4 for ids in experts_LTK)
    assert torch.equal(distinct_experts_per_block(experts_LTK[0], 4, 1), torch.ones(40, dtype=torch.long))
    captured = []
    hook = model.blocks[1].ffn.router.register_forward_hook(lambda m, i, out: captured.append(out.experts_TK))
    model(corpus.heldout[16:32].long().unsqueeze(0))
    hook.remove()
    assert torch.equal(captured[0], experts_LTK[1][16:32])
    save_checkpoint(model, tmp_path / CHECKPOINT_FILE)
    loaded = load_checkpoint(model.config, tmp_path / CHECKPOINT_FILE)
    windows = heldout_windows(corpus.heldout, 4, 16)
    assert evaluate(loaded, windows, 4)["loss"] == evaluate(model, windows, 4)["loss"]
    with pytest.raises(ValueError, match="dense"):
        routed_experts(TinyMoELM(dataclasses.replace(TINY, num_experts=0)), corpus.heldout, 16)


# ------------------------------------------------------------------------------------ the experiments
def test_smoke_plan_shares_points_between_the_sweeps():
    configs = [c for sweep in trained_sweeps(smoke=True) for c in sweep.configs()]
    trainings = [c for c in configs if isinstance(c, TinyTrainConfig)]
    assert len(trainings) == 6 and len({run_id(c) for c in trainings}) == 4
    assert base_config(smoke=True) in trainings
    (throughput,) = [c for c in configs if isinstance(c, ThroughputConfig)]
    assert set(throughput.variants()) == {"E=0", "E=8", "cf=1.25"}


def test_trained_tables_have_the_switch_shape(tmp_path):
    report = run_experiment(
        get_experiment("switch-tables"), out=tmp_path, smoke=True, console=Console(quiet=True)
    )
    data = json.loads(report.summary_path.read_text())
    tables = {t["name"]: t["rows"] for t in data["tables"]}
    assert {"experts", "capacity", "aux-loss", "drop-fraction", "switch-loss"} <= set(tables)
    dense, sparse = tables["experts"]
    assert dense["model"] == "dense" and dense["delta"] == 0.0 and sparse["experts"] == 8
    assert sparse["flops"] > dense["flops"] and sparse["params"] > dense["params"]
    assert dense["speed"] == 1.0 and sparse["tokens_per_s"] > 0 and sparse["speed"] > 0
    capacity = {row["cf"]: row for row in tables["capacity"]}
    assert capacity["dropless"]["train_drop"] == capacity["dropless"]["delta"] == 0.0
    assert capacity["1.25"]["capacity"] == math.ceil(1.25 * 4 * 16 / 8)
    assert [row["coef"] for row in tables["aux-loss"]] == [0.0, 0.01]
    assert all(row["max_over_mean"] >= 1.0 and row["cv"] >= 0.0 for row in tables["aux-loss"])
    run_dir = report.out_dir / run_id(base_config(smoke=True))
    assert (run_dir / CHECKPOINT_FILE).is_file()
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]

    # moe-verify-cost reads that checkpoint from the same --out; alone, it trains the model itself
    verify = get_experiment("moe-verify-cost")
    trained_only = dataclasses.replace(verify, plan=lambda smoke=False: verify.sweeps(smoke=smoke)[1:])
    for out, source in ((tmp_path, "switch-tables/"), (tmp_path / "alone", "trained in moe-verify-cost/")):
        report = run_experiment(trained_only, out=out, smoke=True, console=Console(quiet=True))
        summary = json.loads(report.summary_path.read_text())
        rows = summary["tables"][0]["rows"]
        assert [row["n"] for row in rows] == [1, 2, 4, 8]
        assert rows[0]["measured"] == rows[0]["shuffled"] == rows[0]["formula"] == 1.0
        assert all(1.0 <= row["measured"] <= 8 and 1.0 <= row["shuffled"] <= 8 for row in rows)
        (run,) = report.ran
        result = json.loads((report.out_dir / run / "result.json").read_text())["result"]
        assert result["checkpoint"].startswith(source)


def test_full_plan_has_three_seeds_of_twelve_points_and_one_throughput_run():
    assert all(isinstance(s, Sweep) for s in trained_sweeps())
    configs = {run_id(c): c for s in trained_sweeps() for c in s.configs()}
    assert sum(isinstance(c, TinyTrainConfig) for c in configs.values()) == 36
    assert sum(isinstance(c, ThroughputConfig) for c in configs.values()) == 1
