"""The ``specdec`` command line (in-process through ``specdec.cli.main``)."""

from __future__ import annotations

import json

import pytest
from _tiny import byte_tokenizer, save_tiny_checkpoint

import specdec
from specdec.cli import IncrementalDetokenizer, main, parse_options
from specdec.targets.hf import HFTarget


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=1))


def run_json(capsys, *args: str) -> dict:
    assert main(["generate", *args, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON object
    return json.loads(out)


def test_generate_json_fields_and_equivalence(ckpt, capsys):
    args = ["--target", ckpt, "--backend", "hf", "--drafter", "ngram", "--prompt", "abc abc abc"]
    args += ["--max-new-tokens", "12", "--temperature", "0", "--gamma", "3", "--seed", "0", "--ignore-eos"]
    res = run_json(capsys, *args)
    for key in ("prompt_token_ids", "token_ids", "text", "metrics"):
        assert key in res
    for key in ("acceptance_rate", "mean_accepted_tokens", "tokens_per_second", "ttft_s", "tpot_s"):
        assert isinstance(res["metrics"][key], float)
    tok = byte_tokenizer()
    assert res["prompt_token_ids"] == tok("abc abc abc").input_ids
    assert len(res["token_ids"]) == 12
    assert res["text"] == tok.decode(res["token_ids"], skip_special_tokens=True)
    assert res["drafter"] == "ngram"
    # the library gives the same tokens
    target = HFTarget.from_pretrained(ckpt)
    out = specdec.generate(
        target,
        [res["prompt_token_ids"]],
        drafter="ngram",
        temperature=0.0,
        max_new_tokens=12,
        ignore_eos=True,
    )
    assert out.token_ids[0] == res["token_ids"]


def test_generate_seeds_top_k_top_p_and_policies(ckpt, capsys):
    base = [
        "--target",
        ckpt,
        "--backend",
        "hf",
        "--prompt",
        "hello",
        "--max-new-tokens",
        "10",
        "--ignore-eos",
    ]
    sample = ["--temperature", "0.9", "--top-k", "40", "--top-p", "0.95"]
    a = run_json(capsys, *base, *sample, "--seed", "3", "--drafter", "ngram")
    b = run_json(capsys, *base, *sample, "--seed", "3", "--drafter", "ngram")
    c = run_json(capsys, *base, *sample, "--seed", "4", "--drafter", "ngram")
    assert a["token_ids"] == b["token_ids"] != c["token_ids"]
    d = run_json(capsys, *base, "--temperature", "0", "--drafter", "none", "--gamma-policy", "goodput")
    e = run_json(capsys, *base, "--temperature", "0", "--drafter", "ngram", "--gamma-policy", "batch-table")
    f = run_json(capsys, *base, "--temperature", "0", "--drafter", "ngram", "--gamma", "3")  # auto, γ ≤ 3
    assert d["token_ids"] == e["token_ids"] == f["token_ids"]
    assert d["gamma_policy"] == "goodput" and f["gamma_policy"] == "auto"
    assert main(["generate", *base, "--gamma-policy", "heuristic"]) == 2  # removed with the static loop
    assert "unknown depth policy 'heuristic'" in capsys.readouterr().err


def test_generate_chat_template_and_stop(ckpt, capsys):
    tok = byte_tokenizer()
    base = [
        "--target",
        ckpt,
        "--backend",
        "hf",
        "--temperature",
        "0",
        "--max-new-tokens",
        "30",
        "--ignore-eos",
    ]
    res = run_json(capsys, *base, "--prompt", "hi", "--chat")
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert res["prompt_token_ids"] == tok(expected, add_special_tokens=False).input_ids
    # a stop string taken from the unstopped output cuts it
    pieces = [tok.decode([t]) for t in res["token_ids"]]
    i = next(
        i for i in range(5, len(pieces)) if pieces[i].isascii() and pieces[i].isprintable() and pieces[i]
    )
    stopped = run_json(capsys, *base, "--prompt", "hi", "--chat", "--stop", pieces[i])
    assert stopped["finish_reason"] == "stop_string"
    assert stopped["token_ids"] == res["token_ids"][: len(stopped["token_ids"])]
    assert pieces[i] in stopped["text"]


def test_generate_streams_text_and_prints_metrics(ckpt, capsys):
    args = ["generate", "--target", ckpt, "--backend", "hf", "--prompt", "hello", "--temperature", "0"]
    assert main([*args, "--max-new-tokens", "16", "--ignore-eos"]) == 0
    streamed = capsys.readouterr()
    res = run_json(capsys, *args[1:], "--max-new-tokens", "16", "--ignore-eos")
    assert streamed.out == res["text"] + "\n"
    assert "tok/s" in streamed.err and "alpha" in streamed.err and "TTFT" in streamed.err


def test_default_drafter_falls_back_to_ngram_without_a_shipped_head(ckpt, capsys):
    args = ["generate", "--target", ckpt, "--backend", "hf", "--prompt", "x", "--max-new-tokens", "3"]
    assert main([*args, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["drafter"] == "ngram"
    assert "drafter 'default' -> 'ngram'" in captured.err  # the fallback is announced, not silent


def test_default_backend_matches_the_transformers_adapter(ckpt, capsys):
    args = ["--target", ckpt, "--prompt", "abcabc", "--temperature", "0", "--max-new-tokens", "16"]
    auto = run_json(capsys, *args, "--drafter", "ngram")
    hf = run_json(capsys, *args, "--drafter", "ngram", "--backend", "hf")
    assert auto["token_ids"] == hf["token_ids"]


def test_model_drafter_option(ckpt, capsys):
    res = run_json(
        capsys,
        "--target",
        ckpt,
        "--backend",
        "hf",
        "--prompt",
        "abc",
        "--temperature",
        "0",
        "--max-new-tokens",
        "12",
        "--drafter",
        "model",
        "--drafter-option",
        f"model={ckpt}",
        "--drafter-option",
        "backend=hf",
        "--ignore-eos",
        "--gamma-policy",
        "fixed",  # under auto, a draft model as costly as the target rightly drafts nothing
        "--gamma",
        "3",
    )
    assert res["metrics"]["acceptance_rate"] == 1.0  # the target drafting for itself


def test_bad_arguments_exit_with_a_message(ckpt, capsys):
    base = ["generate", "--target", ckpt, "--backend", "hf", "--prompt", "x"]
    assert main([*base, "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main([*base, "--drafter", "nope"]) == 2
    assert "known drafters" in capsys.readouterr().err
    assert main([*base, "--drafter-option", "novalue"]) == 2
    assert "key=value" in capsys.readouterr().err
    assert main(["generate", "--target", "/no/such/dir", "--prompt", "x"]) == 2
    with pytest.raises(SystemExit):
        main(["generate"])  # --prompt is required


def test_train_head_is_a_subcommand_with_one_flag_per_config_field(capsys):
    """``specdec train-head`` carries the recipe's flags (generated from TrainConfig); a bad config
    value is one line and exit status 2, before anything loads."""
    with pytest.raises(SystemExit):
        main(["train-head", "--help"])
    text = capsys.readouterr().out
    for flag in ("--out", "--data-root", "--work", "--no-eval", "--steps", "--aux-layers", "--data-seed"):
        assert flag in text
    assert main(["train-head", "--steps", "0"]) == 2
    assert "TrainConfig.steps must be an int >= 1" in capsys.readouterr().err


def test_parse_options():
    assert parse_options(["a=1", "b=0.5", "c=true", "d=x=y", "e=False"], "--o") == {
        "a": 1,
        "b": 0.5,
        "c": True,
        "d": "x=y",
        "e": False,
    }
    with pytest.raises(ValueError, match="--o"):
        parse_options(["=1"], "--o")


def test_incremental_detokenizer_handles_multibyte_tokens():
    tok = byte_tokenizer()
    text = "héllo wörld 日本語 🙂 done"
    ids = tok(text).input_ids
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([t]) for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p == "") >= 5  # held back while a character was incomplete


@pytest.mark.model
def test_cli_smollm2_greedy_matches_transformers(capsys, smollm2_greedy):
    res = run_json(
        capsys,
        "--target",
        "smollm2-135m",
        "--prompt",
        "What is 2+2?",
        "--chat",
        "--temperature",
        "0",
        "--max-new-tokens",
        "24",
        "--drafter",
        "default",
        "--weights",
        "gguf",  # the format equal to transformers (the default may be gguf-q8)
    )
    assert res["token_ids"] == smollm2_greedy(res["prompt_token_ids"], 24)
    assert res["text"].strip()


def test_serve_flags_reach_the_server_config(monkeypatch):
    """Every `specdec serve` flag lands in its ServeConfig field (built by config_from_args)."""
    from specdec.serve.command import SERVE_PACKAGES

    for name in SERVE_PACKAGES:  # specdec.serve.server imports uvicorn and the app
        pytest.importorskip(name, reason="needs the [serve] extra (pip install -e '.[serve]')")
    import specdec.serve.server as server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda config: seen.setdefault("config", config) and 0)
    argv = ["serve", "--target", "t", "--drafter", "ngram", "--drafter-option", "n=3", "--gamma", "4"]
    argv += ["--verify-option", "a=1", "--max-num-seqs", "3", "--port", "9", "--api-key", "k"]
    argv += ["--max-body-bytes", "512", "--shutdown-timeout", "2.5", "--max-waiting", "7"]
    main(argv)
    config = seen["config"]
    assert (config.target, config.drafter, config.gamma) == ("t", "ngram", 4)
    assert config.drafter_options == {"n": 3}
    assert (config.verify_options, config.max_num_seqs, config.port, config.api_key) == ({"a": 1}, 3, 9, "k")
    assert (config.max_body_bytes, config.shutdown_timeout_s, config.max_waiting) == (512, 2.5, 7)
    seen.clear()
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    main(["serve"])  # no flags: the config's own defaults, field by field
    assert seen["config"] == server.ServeConfig()


def test_bench_flags_reach_the_bench_config():
    from specdec.bench.speculative import BenchConfig, config_from_args
    from specdec.cli import build_parser

    args = build_parser().parse_args(["bench", "--drafter-option", "ngram.n=2", "--no-warmup"])
    config = config_from_args(args)
    assert isinstance(config, BenchConfig)
    assert config.drafter_options == {"ngram": {"n": 2}} and config.warmup is False
    assert config.prompt_sets == args.prompt_set and config.num_prompts == args.num_prompts
