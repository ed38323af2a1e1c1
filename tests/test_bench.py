"""The benchmark: prompt sets, one-run comparison table, JSON/Markdown output, interruption safety."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from _tiny import save_tiny_checkpoint

from specdec import bench
from specdec.bench import BenchConfig, load_prompts, markdown_table, run_bench
from specdec.bench.report import bench_document


def test_prompt_sets_are_read_from_the_installed_packages():
    he = load_prompts("humaneval", 1000)
    assert len(he) == 164 and all("def " in p for p in he)
    mt = load_prompts("mtbench", 1000)
    assert len(mt) == 80 and all(isinstance(q, str) and q for q in mt)
    picked = load_prompts("mtbench", 4)
    assert picked == [mt[0], mt[20], mt[40], mt[60]]  # evenly spaced
    with pytest.raises(ValueError, match="known: humaneval, mtbench"):
        load_prompts("nope", 3)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    return str(save_tiny_checkpoint(root / "target", seed=1)), str(
        save_tiny_checkpoint(root / "draft", seed=1)
    )


@pytest.fixture
def tiny_sets(monkeypatch):
    monkeypatch.setitem(bench.PROMPT_SETS, "code", lambda: ["def f(x):\n    return x", "abc abc abc abc"])
    monkeypatch.setitem(bench.PROMPT_SETS, "chat", lambda: ["Say hi.", "Count: 1 2 3"])


def test_bench_compares_everything_in_one_run(ckpts, tiny_sets, tmp_path):
    target, draft = ckpts
    cfg = BenchConfig(
        target=target,
        prompt_sets=("code", "chat"),
        num_prompts=2,
        max_new_tokens=10,
        temperatures=(0.0, 0.7),
        drafters=("none", "ngram", "model", "no-such-drafter"),
        gamma_policy="fixed",  # the draft model is the target: auto would rightly draft little
        backend="hf",
        draft_model=draft,
        out=str(tmp_path / "out"),
        warmup=False,
    )
    payload = run_bench(cfg, command="test")
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    md = (tmp_path / "out" / "bench.md").read_text()
    assert data["summary"] == json.loads(json.dumps(payload["summary"]))
    methods = {"ours/none", "ours/ngram", "ours/model", "hf/plain", "hf/prompt_lookup", "hf/assistant"}
    assert {r["method"] for r in data["summary"]} == methods
    assert any("no-such-drafter" in n for n in data["notes"])
    assert len(data["runs"]) == 2 * len(methods)
    rows = {(r["prompt_set"], r["temperature"], r["method"]): r for r in data["summary"]}
    for s in ("code", "chat", "all"):
        for T in (0.0, 0.7):
            assert rows[(s, T, "ours/none")]["speedup"] == pytest.approx(1.0)
            for m in methods:
                assert rows[(s, T, m)]["tokens_per_second"] > 0
    for m in methods - {"ours/none"}:
        # greedy: every method reproduces our plain decode token for token
        assert rows[("all", 0.0, m)]["exact_match_rate"] == 1.0
        assert "exact_match_rate" not in rows[("all", 0.7, m)]
    spec = rows[("all", 0.0, "ours/model")]  # the draft model is the target itself: all accepted
    assert spec["acceptance_rate"] == 1.0 and spec["mean_accepted_tokens"] > 3
    assert spec["predicted_speedup"] > 0 and spec["measured_over_predicted"] > 0
    # bench.json is in the one results schema (specdec.summary/1): the paper's reader accepts it
    from paper.results import load_summary

    doc = load_summary(tmp_path / "out" / "bench.json")
    assert (doc["experiment"], doc["complete"], doc["num_runs"], doc["num_planned_runs"]) == (
        "specdec-bench",
        True,
        2,
        2,
    )
    (table,) = doc["tables"]
    assert [(r["prompt_set"], r["method"]) for r in table["rows"]] == [
        (r["prompt_set"], r["method"]) for r in data["summary"]
    ]
    assert [r["tokens_per_second"] for r in table["rows"]] == [
        r["tokens_per_second"] for r in data["summary"]
    ]
    assert target in table["caption"] and doc["env"]["git_commit"] == data["environment"]["commit"]
    partial = bench_document(payload, "specdec-bench", complete_temperatures=1)
    assert not partial["complete"] and partial["missing_run_ids"] == ["T=0.7"]
    with pytest.raises(ValueError, match="name must be a"):
        BenchConfig(name="Bench 1")
    assert "| all | 0.7 | ours/ngram |" in md and "no-such-drafter" in md
    for r in data["runs"]:
        assert len(r["prompts"]) == 4
        for p in r["prompts"]:
            assert p["num_tokens"] == len(p["token_ids"]) <= 10


def _third_ours_call_raises(monkeypatch, error: BaseException) -> None:
    """Make the third generation of our decode loop raise `error` (in the two-prompt plan below:
    ours/ngram on prompt 1, after ours/none and ours/ngram on prompt 0)."""
    from specdec.bench import speculative

    calls = {"n": 0}
    real = speculative.engine_method

    def flaky_method(*args, **kwargs):
        run = real(*args, **kwargs)

        def flaky(*a, **k):
            calls["n"] += 1
            if calls["n"] == 3:
                raise error
            return run(*a, **k)

        return flaky

    monkeypatch.setattr(speculative, "engine_method", flaky_method)


def _two_prompt_config(target, tmp_path) -> BenchConfig:
    return BenchConfig(
        target=target,
        prompt_sets=("code",),
        num_prompts=2,
        max_new_tokens=6,
        temperatures=(0.0,),
        drafters=("none", "ngram"),
        hf_baselines=("plain",),
        backend="hf",
        out=str(tmp_path / "out"),
        warmup=False,
    )


def test_bench_keeps_finished_runs_when_interrupted(ckpts, tiny_sets, tmp_path, monkeypatch):
    target, _ = ckpts
    _third_ours_call_raises(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        run_bench(_two_prompt_config(target, tmp_path))
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    # Methods run interleaved per prompt: the finished prompt is kept for every method.
    assert [r["method"] for r in data["runs"]] == ["ours/none", "hf/plain", "ours/ngram"]
    assert [[p["index"] for p in r["prompts"]] for r in data["runs"]] == [[0], [0], [0]]


def test_a_failing_method_is_dropped_with_a_note_and_the_others_finish(
    ckpts, tiny_sets, tmp_path, monkeypatch
):
    target, _ = ckpts
    _third_ours_call_raises(monkeypatch, RuntimeError("simulated device mismatch"))
    run_bench(_two_prompt_config(target, tmp_path))
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [r["method"] for r in data["runs"]] == ["ours/none", "hf/plain"]
    assert all([p["index"] for p in r["prompts"]] == [0, 1] for r in data["runs"])
    assert {r["method"] for r in data["summary"]} == {"ours/none", "hf/plain"}
    assert any("ours/ngram" in n and "simulated device mismatch" in n for n in data["notes"])


def test_device_option_is_checked_at_the_boundary(tmp_path):
    import argparse

    from specdec.targets import check_device

    assert check_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device"):
        check_device("not-a-device")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            check_device("cuda")
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--device", "cpu", "--out", str(tmp_path)])
    assert bench.speculative.config_from_args(args).device == "cpu"


def test_config_validation_and_cli_parsing(tmp_path):
    with pytest.raises(ValueError, match="prompt set"):
        BenchConfig(prompt_sets=("nope",))
    with pytest.raises(ValueError, match="temperatures"):
        BenchConfig(temperatures=(-1.0,))
    with pytest.raises(ValueError, match="transformers baseline"):
        BenchConfig(hf_baselines=("vllm",))
    import argparse

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(
        [
            "--prompt-set",
            "mtbench",
            "--temperatures",
            "0,0.7",
            "--drafters",
            "none,ngram",
            "--hf-baselines",
            "",
            "--drafter-option",
            "layerskip.num_layers=8",
            "--out",
            str(tmp_path),
        ]
    )
    args.command = None
    cfg = bench.speculative.config_from_args(args)
    assert cfg.prompt_sets == ("mtbench",) and cfg.temperatures == (0.0, 0.7)
    assert cfg.hf_baselines == () and cfg.drafter_options == {"layerskip": {"num_layers": 8}}


def test_markdown_table_formats_missing_values():
    row = {
        "prompt_set": "all",
        "temperature": 0.0,
        "method": "hf/plain",
        "tokens_per_second": 10.0,
        "speedup": 0.5,
    }
    assert "| all | 0 | hf/plain | 10.0 | 0.50× | – |" in markdown_table([row])


def test_labelled_drafters_compare_settings_of_one_drafter(ckpts, tiny_sets, tmp_path):
    """LABEL=DRAFTER runs a drafter under its own label with that label's options."""
    target, _ = ckpts
    cfg = BenchConfig(
        target=target,
        prompt_sets=("code",),
        num_prompts=2,
        max_new_tokens=8,
        temperatures=(0.0,),
        drafters=("none", "ngram", "ngram-1=ngram", "bad=ngram", "x=no-such-drafter"),
        drafter_options={"ngram-1": {"max_ngram": 1}, "bad": {"max_ngram": 0}},
        hf_baselines=(),
        backend="hf",
        out=str(tmp_path / "out"),
        warmup=False,
    )
    payload = run_bench(cfg)
    methods = {r["method"] for r in payload["summary"]}
    assert methods == {"ours/none", "ours/ngram", "ours/ngram-1"}
    assert any(n.startswith("ours/bad skipped: ValueError: max_ngram") for n in payload["notes"])
    assert any(n.startswith("ours/x skipped: not registered") for n in payload["notes"])
    rows = {r["method"]: r for r in payload["summary"] if r["prompt_set"] == "all"}
    assert rows["ours/ngram-1"]["exact_match_rate"] == 1.0


def test_drafter_gammas_give_labels_their_own_draft_length(ckpts, tiny_sets, tmp_path):
    """One interleaved run compares γ: the draft model is the target itself, so every draft is
    accepted and τ tracks γ + 1."""
    target, draft = ckpts
    cfg = replace(
        _two_prompt_config(target, tmp_path),
        max_new_tokens=12,
        drafters=("none", "model", "model-g1=model"),
        drafter_gammas={"model-g1": 1},
        gamma=4,
        gamma_policy="fixed",  # exactly γ per step (auto would choose each depth)
        hf_baselines=(),
        draft_model=draft,
    )
    rows = {r["method"]: r for r in run_bench(cfg)["summary"] if r["prompt_set"] == "all"}
    assert rows["ours/model-g1"]["mean_accepted_tokens"] <= 2.0 < rows["ours/model"]["mean_accepted_tokens"]
    assert rows["ours/model-g1"]["exact_match_rate"] == 1.0
    with pytest.raises(ValueError, match="drafter_gammas names 'nope'"):
        BenchConfig(drafters=("none", "ngram"), drafter_gammas={"nope": 2})
    with pytest.raises(ValueError, match=r"drafter_gammas\['ngram'\] must be an int >= 0"):
        BenchConfig(drafters=("none", "ngram"), drafter_gammas={"ngram": -1})
    import argparse

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(
        ["--drafters", "none,ngram,g6=ngram", "--drafter-gamma", "g6=6", "--out", str(tmp_path)]
    )
    assert bench.speculative.config_from_args(args).drafter_gammas == {"g6": 6}
    with pytest.raises(ValueError, match="--drafter-gamma expects LABEL=N"):
        bench.speculative.config_from_args(
            p.parse_args(["--drafters", "none,ngram", "--drafter-gamma", "ngram=x"])
        )


def test_chat_prompt_sets_are_sent_through_the_chat_template(ckpts, tiny_sets, tmp_path, monkeypatch):
    from specdec.bench import speculative

    assert "mtbench-chat" in speculative.CHAT_PROMPT_SETS and "mtbench" not in speculative.CHAT_PROMPT_SETS
    assert load_prompts("mtbench-chat", 3) == load_prompts("mtbench", 3)  # same questions (held out alike)
    monkeypatch.setitem(bench.PROMPT_SETS, "mtbench-chat", lambda: ["Say hi."])
    encode, calls = speculative.encode_prompt, []

    def recording(tokenizer, text, *, chat):
        calls.append((text, chat))
        return encode(tokenizer, text, chat=chat)

    monkeypatch.setattr(speculative, "encode_prompt", recording)
    cfg = BenchConfig(
        target=ckpts[0],
        prompt_sets=("code", "mtbench-chat"),
        num_prompts=1,
        max_new_tokens=4,
        temperatures=(0.0,),
        drafters=("none",),
        hf_baselines=(),
        backend="llama",
        out=str(tmp_path / "out"),
        warmup=False,
    )
    data = run_bench(cfg, command="test")
    assert calls == [("def f(x):\n    return x", False), ("Say hi.", True)]
    assert {r["prompt_set"] for r in data["summary"]} == {"code", "mtbench-chat", "all"}


def test_generate_serve_and_bench_share_the_engine_arguments():
    """One ``add_engine_arguments``: the target's options spelled alike in ``generate``, ``serve`` and
    ``bench`` (and the concurrency bench); each command keeps its own defaults and extras."""
    import argparse

    from specdec.bench import concurrency
    from specdec.cli import build_parser

    parser = build_parser()
    target = [
        "--target",
        "t",
        "--weights",
        "int8",
        "--dtype",
        "bfloat16",
        "--backend",
        "hf",
        "--compile",
        "none",
    ]
    for command in (["generate", "--prompt", "hi"], ["serve"], ["bench"]):
        args = parser.parse_args([*command, *target])
        assert (args.target, args.weights, args.dtype, args.backend, args.compile) == (
            "t", "int8", "bfloat16", "hf", "none"
        )  # fmt: skip
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--weights", "int3"])
    generate = parser.parse_args(["generate", "--prompt", "hi"])
    assert (generate.drafter, generate.gamma, generate.gamma_policy, generate.verify) == (
        "default", None, "auto", "exact"
    )  # fmt: skip
    serve = parser.parse_args(["serve", "--gamma", "3", "--threads", "2", "--gamma-option", "k=1"])
    assert (serve.gamma, serve.threads, serve.gamma_option, serve.verify) == (3, 2, ["k=1"], "exact")
    assert parser.parse_args(["serve", "--gamma", "goodput"]).gamma == "goodput"
    bench_args = parser.parse_args(["bench", "--drafter-option", "ngram.n=3"])
    assert (bench_args.gamma, bench_args.gamma_policy, bench_args.device) == (4, "auto", "cpu")
    assert not hasattr(bench_args, "verify") and not hasattr(bench_args, "drafter")
    p = argparse.ArgumentParser()
    concurrency.add_concurrency_arguments(p)
    args = p.parse_args(target)
    assert (args.target, args.weights, args.dtype, args.backend, args.compile) == (
        "t", "int8", "bfloat16", "hf", "none"
    )  # fmt: skip
    assert not hasattr(args, "gamma") and not hasattr(args, "drafter_option")
