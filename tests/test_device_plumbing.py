"""``--device`` / ``--dtype`` from the command lines and the experiment configs down to the target, the
draft model and the run's ``env.json``.

There is no GPU here: the device a model lands on is checked with ``torch.device("meta")`` (a target
and a draft model build there through the same code as on CUDA), and ``cuda`` is checked to be
refused up front on a machine without one.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from _tiny import byte_tokenizer, save_tiny_checkpoint

from specdec.targets.llama import LlamaTarget


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("plumbing") / "tiny", tokenizer=byte_tokenizer())


def _meta_target(path, **kw) -> LlamaTarget:
    return LlamaTarget.from_pretrained(str(path), device="meta", load_tokenizer=False, **kw)


# --- the model drafter follows the target ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_model_drafter_loads_its_draft_on_the_targets_device_and_dtype(checkpoint, dtype):
    from specdec.drafters.model import ModelDrafter

    target = _meta_target(checkpoint, dtype=dtype)
    drafter = ModelDrafter(target, model=str(checkpoint))
    draft = drafter.draft
    assert draft.device.type == "meta" and draft.dtype == target.dtype
    weights = [lin._weight_OI() for ly in draft.layers for lin in (ly.qkv, ly.o, ly.gate_up, ly.down)]
    assert all(w.device.type == "meta" and w.dtype == target.dtype for w in weights)


def test_model_drafter_in_the_engines_pool_lands_on_the_targets_device(checkpoint):
    """The engine builds drafters by name (``make_slot_drafter``): its model goes where the target is."""
    from specdec.drafters.engine_drafter import make_slot_drafter

    target = _meta_target(checkpoint)
    drafter = make_slot_drafter(target, "model", {"model": str(checkpoint)}, num_slots=2)  # one for all rows
    assert drafter.draft.device.type == "meta" and drafter.num_slots == 2
    assert drafter.draft.embed_tokens.weight.device.type == "meta"


def test_model_drafter_refuses_a_ready_draft_model_on_another_device(checkpoint):
    from specdec.drafters.model import ModelDrafter

    target = _meta_target(checkpoint)
    on_cpu = LlamaTarget.from_pretrained(str(checkpoint), load_tokenizer=False)
    with pytest.raises(ValueError, match="draft model is on cpu, the drafter runs on meta"):
        ModelDrafter(target, model=on_cpu)
    drafter = ModelDrafter(on_cpu, model=on_cpu)  # the same device: taken as it is
    assert drafter.draft is on_cpu


def test_model_drafter_on_cuda_without_one_is_refused(checkpoint):
    from specdec.drafters.model import ModelDrafter

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    target = LlamaTarget.from_pretrained(str(checkpoint), load_tokenizer=False)
    with pytest.raises(ValueError, match="no CUDA device"):
        ModelDrafter(target, model=str(checkpoint), device="cuda")


# --- the command lines ----------------------------------------------------------------------------------


def test_generate_and_serve_parse_device_and_dtype():
    from specdec.cli import build_parser

    parser = build_parser()
    for command in (["generate", "--prompt", "hi"], ["serve"]):
        args = parser.parse_args([*command, "--device", "cpu", "--dtype", "bfloat16"])
        assert args.device == "cpu" and args.dtype == "bfloat16"
        args = parser.parse_args(command)
        assert args.device is None and args.dtype is None
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--dtype", "float64"])
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--device", "not-a-device"])
        if not torch.cuda.is_available():
            with pytest.raises(SystemExit):
                parser.parse_args([*command, "--device", "cuda"])


def test_serve_passes_device_and_dtype_to_its_config(monkeypatch):
    """``specdec serve --device --dtype`` reach the server's config (what opens the target)."""
    from specdec.serve.command import SERVE_PACKAGES

    for name in SERVE_PACKAGES:  # specdec.serve.server imports uvicorn and the app
        pytest.importorskip(name, reason="needs the [serve] extra (pip install -e '.[serve]')")
    import specdec.serve.server as server
    from specdec.cli import build_parser
    from specdec.serve.command import cmd_serve

    seen = {}
    monkeypatch.setattr(server, "serve", lambda config: seen.setdefault("config", config) and 0)
    args = build_parser().parse_args(["serve", "--device", "cpu", "--dtype", "float16", "--weights", "fp16"])
    cmd_serve(args)
    config = seen["config"]
    assert (config.device, config.dtype, config.weights) == ("cpu", "float16", "fp16")


def test_concurrency_bench_opens_its_target_on_the_device(monkeypatch, tmp_path):
    """``python -m specdec.bench.concurrency --device --dtype`` and ``specdec bench --concurrency`` (the
    engine under load, what replaced the batch-size experiment) open the target there."""
    import argparse

    import specdec.targets
    from specdec.bench import concurrency
    from specdec.cli import build_parser

    seen = {}

    def open_target(name, **kw):
        seen.update(kw)
        raise ValueError("stop here")

    monkeypatch.setattr(specdec.targets, "open_target", open_target)
    parser = argparse.ArgumentParser()
    concurrency.add_concurrency_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--dtype", "bfloat16", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="stop here"):
        concurrency.run_concurrency(args)
    assert (seen["device"], seen["dtype"]) == ("cpu", "bfloat16")
    bench = build_parser().parse_args(
        ["bench", "--concurrency", "1,2", "--device", "cpu", "--dtype", "float16"]
    )
    args = concurrency.from_bench_args(bench)
    assert (args.device, args.dtype, args.concurrency) == ("cpu", "float16", (1, 2))
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float64"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            parser.parse_args(["--device", "cuda"])


# --- experiment configs, the run command and env.json ----------------------------------------------------

MODEL_CONFIGS = [
    "experiments.catalog.gamma_sweep:GammaSweepConfig",
    "experiments.catalog.speedup_table:SpeedupConfig",
    "experiments.catalog.lossy_quality:LossyQualityConfig",
    "experiments.catalog.leviathan_table3_analog:AcceptanceConfig",
    "experiments.catalog.serving_load:ServingLoadConfig",
]


def _config_class(spec: str):
    import importlib

    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("spec", MODEL_CONFIGS)
def test_configs_that_build_a_model_have_device_and_dtype(spec):
    cls = _config_class(spec)
    config = cls()
    assert (config.device, config.dtype) == ("cpu", None)
    assert dataclasses.replace(config, device="cuda:1", dtype="bfloat16").device == "cuda:1"  # checked at run
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.device must be a torch device"):
        dataclasses.replace(config, device="gpu-please")
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.dtype must be one of"):
        dataclasses.replace(config, dtype="float64")


def test_serving_load_starts_its_server_on_the_device():
    """The ``serving-load`` run's server command carries the config's device and dtype."""
    import inspect

    from experiments.catalog import serving_load

    source = inspect.getsource(serving_load.run_serving_load)
    assert '"--device", config.device' in source and '"--dtype", config.dtype' in source


def test_run_with_device_and_dtype_records_them_in_env_json(tmp_path):
    """``python -m experiments run gamma-sweep --smoke --device cpu --dtype bfloat16``: every run's
    config carries them, its target ran in bf16, and ``env.json`` says so (not what is visible)."""
    from experiments.cli import main

    out = tmp_path / "out"
    assert (
        main(["run", "gamma-sweep", "--smoke", "--device", "cpu", "--dtype", "bfloat16", "--out", str(out)])
        == 0
    )
    runs = [p for p in (out / "gamma-sweep").iterdir() if (p / "env.json").is_file()]
    assert runs
    for run in runs:
        config = json.loads((run / "config.json").read_text())["config"]
        env = json.loads((run / "env.json").read_text())
        assert (config["device"], config["dtype"]) == ("cpu", "bfloat16")
        assert (env["device"], env["dtype"], env["weights"]) == ("cpu", "bfloat16", "bf16")
        assert env["cuda_available"] == torch.cuda.is_available()


def test_run_refuses_device_flags_where_they_do_not_apply_or_cannot_run(tmp_path, capsys):
    from experiments.cli import main

    out = str(tmp_path / "out")
    assert main(["run", "leviathan-table1", "--smoke", "--dtype", "bfloat16", "--out", out]) == 2
    assert "experiment 'leviathan-table1' builds no model" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["run", "gamma-sweep", "--smoke", "--device", "cuda", "--out", out]) == 2
        assert "no CUDA device" in capsys.readouterr().err
    # a GPU plan can still be listed anywhere
    assert main(["run", "gamma-sweep", "--smoke", "--device", "cuda", "--dry-run", "--out", out]) == 0
    assert '"device": "cuda"' in capsys.readouterr().out


def test_target_placement_names_what_the_target_runs_on(checkpoint):
    from experiments.env import target_placement

    cpu = LlamaTarget.from_pretrained(str(checkpoint), load_tokenizer=False, dtype=torch.float16)
    placement = target_placement(cpu)
    assert placement["device"] == "cpu" and placement["dtype"] == "float16" and placement["weights"] == "fp16"
    meta = target_placement(_meta_target(checkpoint, dtype=torch.bfloat16))
    assert (meta["device"], meta["dtype"]) == ("meta", "bfloat16")


def test_bf16_target_drafts_with_every_drafter_kind_and_keeps_greedy_output(checkpoint, tmp_path):
    """A target computing in bf16 (the GPU path, run on the CPU) with a draft model, an EAGLE head (its
    features and embedding in bf16) and n-grams: greedy speculative output equals its plain decoding."""
    import specdec
    from experiments.gpu_engine_check import random_eagle_head

    target = LlamaTarget.from_pretrained(str(checkpoint), dtype=torch.bfloat16)
    assert target.dtype == torch.bfloat16 and target.linear_backend == "reference"
    head = tmp_path / "head.safetensors"
    random_eagle_head(target, head)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [10, 11, 12, 13, 10, 11, 12]]
    plain = specdec.generate(target, prompts, drafter="none", max_new_tokens=12, temperature=0.0)
    for drafter, options in (
        ("ngram", {}),
        ("eagle", {"weights": str(head)}),
        ("model", {"model": str(checkpoint)}),
    ):
        out = specdec.generate(
            target, prompts, drafter=drafter, drafter_options=options, max_new_tokens=12, temperature=0.0
        )
        assert out.token_ids == plain.token_ids, drafter
