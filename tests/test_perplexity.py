"""``specdec perplexity`` and :mod:`specdec.quality`: llama-perplexity's protocol, its statistics
against independent computations, the CLI's JSON, the llama-perplexity peer, and bad arguments."""

from __future__ import annotations

import json
import math
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from _tiny import save_tiny_checkpoint, tiny_llama

from specdec.cli import main
from specdec.percentile import percentile
from specdec.quality.llama_perplexity import (
    LLAMA_PERPLEXITY_ENV,
    PeerComparison,
    parse_llama_perplexity_output,
    read_llama_logits,
    run_llama_perplexity,
)
from specdec.quality.logprobs import token_logprobs
from specdec.quality.perplexity import (
    Scores,
    chunk_tokens,
    evaluate_text,
    kl_divergence,
    measure,
    ppl_with_stderr,
    score_chunk,
)

pytestmark = pytest.mark.usefixtures("one_thread")
DATA = Path(__file__).parent / "data"
TEXT = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and the target "
    "verifies them in one forward pass; perplexity measures what the weights cost. "
) * 4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=3, init_std=0.2)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    from specdec.targets.llama import LlamaTarget

    return LlamaTarget.from_pretrained(tiny_path, weights="fp32")


def _hf_nll(model, chunks_NC: torch.Tensor) -> list[float]:
    """Scored-token NLLs computed independently: transformers' model, plain torch log-softmax."""
    out = []
    for chunk in chunks_NC:
        with torch.no_grad():
            logits = model(chunk[None]).logits[0].double()
        first = chunk.numel() // 2
        logp = torch.log_softmax(logits, dim=-1)
        out += [-float(logp[t, chunk[t + 1]]) for t in range(first, chunk.numel() - 1)]
    return out


def test_ppl_equals_exp_mean_nll_of_an_independent_computation(tiny):
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(0))
    chunks = chunk_tokens(ids, ctx=32, chunks=4)
    result = measure({"fp32": tiny}, chunks)["fp32"]
    nll = _hf_nll(tiny_llama(seed=3, init_std=0.2), chunks)
    assert result["n_tokens"] == len(nll) == 4 * (32 - 16 - 1)
    assert result["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)
    assert result["ppl"] > 1.5  # a random model on random tokens is far from certain
    assert result["kld_mean"] is None and result["top1_agree"] is None  # no reference


def test_token_logprobs_equal_log_softmax_of_transformers_logits(tiny):
    ids = [5, 17, 200, 3, 99, 42, 42, 7]
    with torch.no_grad():
        logits = tiny_llama(seed=3, init_std=0.2)(torch.tensor([ids])).logits[0]
    expected = torch.log_softmax(logits.float(), dim=-1)[torch.arange(7), torch.tensor(ids[1:])]
    got = token_logprobs(tiny, ids)
    assert got.dtype == torch.float32 and got.shape == (7,)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="ids must hold ids in"):
        token_logprobs(tiny, [1, 300])
    with pytest.raises(ValueError, match="ids must be a non-empty 1-D"):
        token_logprobs(tiny, [[1, 2]])


def test_stderr_formula_by_hand():
    nll = [2.0, 2.5, 3.0, 1.0, 4.0]
    n = len(nll)
    mean = sum(nll) / n
    var = sum(x * x for x in nll) / n - mean * mean
    ppl, err = ppl_with_stderr(sum(nll), sum(x * x for x in nll), n)
    assert ppl == pytest.approx(math.exp(2.5))
    assert err == pytest.approx(math.exp(2.5) * math.sqrt(var / (n - 1)))
    assert err == pytest.approx(math.exp(2.5) * 0.5)  # E[x²] = 7.25, var = 1, sqrt(1 / 4)
    assert ppl_with_stderr(3.0, 3.0, 3) == (math.e, None)  # zero variance: no error bar


def test_percentile_is_llamas_linear_interpolation():
    """KL divergence's p99 uses the one percentile (specdec.percentile): llama-perplexity's linear
    interpolation at q/100 * (n - 1), numpy's default."""
    values = sorted(torch.rand(37, generator=torch.Generator().manual_seed(0)).tolist())
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)
    assert percentile([1.0, 3.0], 25) == 1.5


def test_identical_weights_have_zero_kl_and_full_top1_agreement(tiny, tiny_path):
    from specdec.targets.llama import LlamaTarget

    again = LlamaTarget.from_pretrained(tiny_path, weights="fp32")
    bf16 = LlamaTarget.from_pretrained(tiny_path, weights="bf16")
    chunks = chunk_tokens(list(range(1, 130)), ctx=16, chunks=5)
    out = measure({"ref": tiny, "same": again, "bf16": bf16}, chunks, reference="ref")
    assert out["ref"]["kld_mean"] is None and out["ref"]["top1_agree"] is None
    assert abs(out["same"]["kld_mean"]) < 1e-9 and abs(out["same"]["kld_p99"]) < 1e-9
    assert out["same"]["top1_agree"] == 1.0 and out["same"]["ppl"] == out["ref"]["ppl"]
    assert out["bf16"]["kld_mean"] > 1e-7 and out["bf16"]["kld_p99"] >= out["bf16"]["kld_mean"] * 0.5


def test_kl_divergence_against_a_hand_sum():
    ref = torch.log_softmax(torch.tensor([[1.0, 2.0, 0.5]]), dim=-1)
    q = torch.log_softmax(torch.tensor([[0.0, 2.5, 1.0]]), dim=-1)
    p = ref.exp()[0].tolist()
    expected = sum(pi * (a - b) for pi, a, b in zip(p, ref[0].tolist(), q[0].tolist(), strict=True))
    assert float(kl_divergence(ref, q)[0]) == pytest.approx(expected, rel=1e-6)
    assert float(kl_divergence(ref, ref)[0]) == 0.0


def test_chunks_follow_llama_perplexity():
    ids = list(range(100, 203))  # 103 tokens, ctx 16: 6 chunks, 7 tokens unused
    chunks = chunk_tokens(ids, ctx=16)
    assert chunks.shape == (6, 16) and chunks[1, 0] == 116 and chunks[-1, -1] == 195
    assert chunk_tokens(ids, ctx=16, chunks=2).shape == (2, 16)
    assert chunk_tokens(ids, ctx=16, chunks=99).shape == (6, 16)
    with_bos = chunk_tokens(ids, ctx=16, bos_token_id=1)
    assert with_bos[:, 0].tolist() == [1] * 6 and torch.equal(with_bos[:, 1:], chunks[:, 1:])
    with pytest.raises(ValueError, match="at least 64"):
        chunk_tokens(ids[:63], ctx=32)
    for bad in (7, 2, 0):
        with pytest.raises(ValueError, match="ctx must be an even integer >= 4"):
            chunk_tokens(ids, ctx=bad)
    with pytest.raises(ValueError, match="chunks must be an integer >= 1"):
        chunk_tokens(ids, ctx=16, chunks=0)


def test_score_chunk_scores_the_second_half(tiny):
    chunk = torch.arange(10, 30)
    scores = score_chunk(tiny, chunk)
    assert scores.nll_N.shape == (20 - 10 - 1,) and scores.logprobs_NV.shape == (9, tiny.vocab_size)
    expected = -token_logprobs(tiny, chunk)[10:].double()  # log p(chunk[11:] | prefix)
    torch.testing.assert_close(scores.nll_N, expected, atol=1e-6, rtol=0)


def test_bos_auto_follows_the_tokenizer(tiny):
    from _tiny import byte_tokenizer

    tok = byte_tokenizer()  # adds no BOS: chunks keep their first token
    out = evaluate_text({"fp32": tiny}, TEXT, tokenizer=tok, ctx=32, chunks=2, bos="auto")
    assert out["bos"] == "kept" and out["n_chunks"] == 2 and out["tokens_scored"] == 2 * 15
    seen = []
    evaluate_text(
        {"fp32": tiny}, TEXT, tokenizer=tok, ctx=32, chunks=2, bos="replace", chunks_hook=seen.append
    )
    assert seen[0][:, 0].tolist() == [tok.bos_token_id] * 2
    with pytest.raises(ValueError, match="bos must be one of"):
        evaluate_text({"fp32": tiny}, TEXT, tokenizer=tok, ctx=32, bos="insert")


# --- the command line ----------------------------------------------------------------------------


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(["perplexity", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_writes_the_json_schema(tiny_path, tmp_path, capsys):
    from paper.results import load_summary

    text = tmp_path / "text.txt"
    text.write_text(TEXT + "\n")
    out = tmp_path / "ppl.json"
    args = ["--target", str(tiny_path), "--weights", "fp32,bf16", "--text", str(text), "--ctx", "64"]
    status, stdout, err = _run(capsys, *args, "--chunks", "3", "--out", str(out))
    assert status == 0, err
    assert "| ours | bf16 |" in stdout and "chunk 3/3" in err
    doc = json.loads(out.read_text())
    assert set(doc["weights"]) == {"fp32", "bf16"} and doc["peers"] == {}
    for row in doc["weights"].values():
        assert {"ppl", "ppl_stderr", "kld_mean", "kld_p99", "top1_agree"} <= set(row)
        assert row["ppl"] > 1 and row["ppl_stderr"] > 0
    assert doc["weights"]["fp32"]["kld_mean"] is None and doc["weights"]["fp32"]["top1_agree"] is None
    assert doc["weights"]["bf16"]["kld_mean"] > 0 and 0 < doc["weights"]["bf16"]["top1_agree"] <= 1
    assert doc["ctx"] == 64 and doc["n_chunks"] == 3 and doc["reference"] == "fp32"
    assert doc["text"]["n_tokens"] == len(TEXT) and doc["bos"] == "kept"  # byte tokens; "\n" dropped
    assert doc["environment"]["cpu"] and "commit" in doc["environment"]
    assert doc["command"].startswith("specdec perplexity --target")
    assert load_summary(out)["tables"][0]["rows"][1]["weights"] == "bf16"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--weights", "fp32,fp64"], "--weights must list formats from"),
        (["--weights", "fp32,fp32"], "names a format twice"),
        (["--ctx", "63"], "--ctx must be an even number"),
        (["--ctx", "2"], "--ctx must be an even number"),
        (["--peers", "vllm"], "--peers must list peers from"),
        (["--text", "/nonexistent/text.txt"], "--text /nonexistent/text.txt: no such file"),
        (["--ctx", "4096"], "tokenizes to only"),
        (["--out", "/nonexistent/dir/x.json"], "--out /nonexistent/dir/x.json: its folder does not exist"),
        (["--peer-logits"], "--peer-logits compares"),
        (["--bos", "maybe"], "--bos must be one of"),
        (["--peers", "llama.cpp"], "needs a target that comes as a GGUF file"),
    ],
)
def test_cli_refuses_bad_arguments(tiny_path, tmp_path, capsys, extra, message):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    base = {"--target": str(tiny_path), "--weights": "fp32", "--text": str(text), "--ctx": "32"}
    for flag, value in zip(extra[::2], extra[1::2], strict=False):
        base[flag] = value
    argv = [x for kv in base.items() for x in kv] + [x for x in extra if x == "--peer-logits"]
    status, _, err = _run(capsys, *argv)
    assert status == 2 and message in err, err


def test_cli_refuses_an_empty_text(tiny_path, tmp_path, capsys):
    text = tmp_path / "empty.txt"
    text.write_text("\n")
    status, _, err = _run(capsys, "--target", str(tiny_path), "--weights", "fp32", "--text", str(text))
    assert status == 2 and "the file is empty" in err


# --- llama-perplexity --------------------------------------------------------------------------------


def test_parser_reads_a_captured_llama_perplexity_output():
    """The sample: llama-perplexity's console output (llama.cpp 0c1e570) on SmolLM2's GGUF and the
    held-out pydoc text, ``-c 256 --chunks 8 -t 1 -nr``."""
    text = (DATA / "llama_perplexity_output.txt").read_text()
    out = parse_llama_perplexity_output(text)
    assert out["ppl"] > 1 and 0 < out["ppl_stderr"] < out["ppl"]
    assert out["ctx"] > 0 and out["n_chunks"] >= 1 and out["seconds_per_pass"] > 0
    final = next(line for line in text.splitlines() if "Final estimate" in line)
    assert final.endswith(f"Final estimate: PPL = {out['ppl']:.4f} +/- {out['ppl_stderr']:.5f}")
    assert (out["ppl"], out["n_chunks"], out["ctx"], out["n_seq"]) == (15.1654, 8, 256, 8)
    assert out["system_info"].startswith("n_threads = 1")
    with pytest.raises(ValueError, match="no 'Final estimate"):
        parse_llama_perplexity_output(text.replace("Final estimate", "Final"))
    short = "perplexity: the data file you provided tokenizes to only 100 tokens\n"
    with pytest.raises(ValueError, match="tokenizes to only 100 tokens"):
        parse_llama_perplexity_output(short)


def _fake_binary(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "llama-perplexity"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_subprocess_path_with_a_fake_binary(tmp_path, monkeypatch):
    sample = DATA / "llama_perplexity_output.txt"
    args_file = tmp_path / "args.txt"
    fake = _fake_binary(tmp_path, f'echo "$@" >> {args_file}\ncat {sample} >&2\n')
    monkeypatch.setenv(LLAMA_PERPLEXITY_ENV, str(fake))
    gguf, text = tmp_path / "m.gguf", tmp_path / "t.txt"
    out = run_llama_perplexity(gguf, text, ctx=256, chunks=7, threads=2, extra_args=["--no-repack"])
    assert out["ppl"] == parse_llama_perplexity_output(sample.read_text())["ppl"]
    assert out["binary"] == str(fake) and "-c 256" in out["command"]
    expected = ["-m", str(gguf), "-f", str(text), "-c", "256", "-t", "2", "--chunks", "7", "--no-repack"]
    assert args_file.read_text().splitlines()[0].split() == expected  # then --version

    fail = _fake_binary(tmp_path, "echo 'error: unable to load model' >&2\nexit 1\n")
    monkeypatch.setenv(LLAMA_PERPLEXITY_ENV, str(fail))
    with pytest.raises(ValueError, match="exit status 1: error: unable to load model"):
        run_llama_perplexity(gguf, text, ctx=256)
    slow = _fake_binary(tmp_path, "sleep 5\n")
    monkeypatch.setenv(LLAMA_PERPLEXITY_ENV, str(slow))
    with pytest.raises(ValueError, match="timeout"):
        run_llama_perplexity(gguf, text, ctx=256, timeout_s=0.5)


def test_a_missing_binary_is_a_clear_error(tmp_path, monkeypatch, tiny_path, capsys):
    monkeypatch.delenv(LLAMA_PERPLEXITY_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match="no llama-perplexity on PATH"):
        run_llama_perplexity(tmp_path / "m.gguf", tmp_path / "t.txt", ctx=256)
    monkeypatch.setenv(LLAMA_PERPLEXITY_ENV, str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match=r"\$LLAMA_PERPLEXITY=.* is not an executable file"):
        run_llama_perplexity(tmp_path / "m.gguf", tmp_path / "t.txt", ctx=256)
    with pytest.raises(ValueError, match="needs a target that comes as a GGUF file"):
        run_llama_perplexity(None, tmp_path / "t.txt", ctx=256)


def _write_logits_file(
    path: Path, tokens: np.ndarray, logprobs: list[np.ndarray], ctx: int, n_vocab: int
) -> None:
    """A ``--kl-divergence-base`` file as perplexity.cpp writes it (its ``log_softmax`` quantiser)."""
    nv = 2 * ((n_vocab + 1) // 2) + 4
    with open(path, "wb") as f:
        f.write(b"_logits_")
        f.write(np.array([ctx, n_vocab, len(logprobs)], dtype=np.int32).tobytes())
        f.write(tokens.astype(np.int32).tobytes())
        for chunk in logprobs:
            for row in chunk:
                top, low = float(row.max()), max(float(row.min()), float(row.max()) - 16)
                scale = np.float32((top - low) / 65535.0)
                q = np.where(row > low, np.rint((row - low) / scale), 0).astype(np.uint16)
                out = np.zeros(nv, dtype=np.uint16)
                out[:4] = np.frombuffer(np.array([scale, low], dtype=np.float32).tobytes(), dtype=np.uint16)
                out[4 : 4 + n_vocab] = q
                f.write(out.tobytes())


def test_peer_logits_round_trip_and_token_by_token_comparison(tiny, tmp_path):
    chunks = chunk_tokens(torch.arange(40, 140), ctx=16, chunks=3)
    scores = [score_chunk(tiny, c) for c in chunks]
    path = tmp_path / "base.bin"
    _write_logits_file(
        path, chunks.reshape(-1).numpy(), [s.logprobs_NV.numpy() for s in scores], 16, tiny.vocab_size
    )
    peer = read_llama_logits(path)
    assert (peer.ctx, peer.n_vocab, peer.n_chunks) == (16, tiny.vocab_size, 3)
    torch.testing.assert_close(peer.chunk_logprobs(1), scores[1].logprobs_NV, atol=2e-4, rtol=0)
    compare = PeerComparison(peer, chunks)
    for i, s in enumerate(scores):
        compare.observe(i, "same", s)
        shifted = Scores(s.nll_N + 0.5, s.logprobs_NV, s.top1_N)
        compare.observe(i, "worse", shifted)
    result = compare.result()
    assert result["tokens"] == {"compared": 48, "different": 0, "first_different": None}
    same, worse = result["weights"]["same"], result["weights"]["worse"]
    assert same["chunks"] == 3 and same["dnll_abs_max"] < 2e-4 and same["top1_agree"] == 1.0
    assert same["kld_mean"] < 1e-6 and worse["dnll_mean"] == pytest.approx(0.5, abs=2e-4)
    flat = Scores(
        scores[0].nll_N, torch.full_like(scores[0].logprobs_NV, -math.log(tiny.vocab_size)), scores[0].top1_N
    )
    uniform = PeerComparison(peer, chunks)
    uniform.observe(0, "uniform", flat)
    base = peer.chunk_logprobs(0).double()
    by_hand = (base.exp() * (base - flat.logprobs_NV.double())).sum(-1).mean()  # all of them above -16
    assert uniform.result()["weights"]["uniform"]["kld_mean"] == pytest.approx(float(by_hand), rel=1e-9)
    assert float(by_hand) > 0.01
    other = chunks.clone()
    other[1, 5] += 1
    moved = PeerComparison(peer, other)
    moved.observe(1, "same", scores[1])
    assert (
        moved.tokens_report()["first_different"] == 16 + 5
        and moved.result()["weights"]["same"]["skipped_chunks"] == 1
    )
    path.write_bytes(b"not a logits file at all")
    with pytest.raises(ValueError, match="no '_logits_' header"):
        read_llama_logits(path)


# --- the held-out text -----------------------------------------------------------------------------


@pytest.mark.slow  # about 4 s on 2 cores
def test_heldout_pydoc_topics_stay_out_of_drafter_training():
    from pydoc_data.topics import topics

    from specdec.drafters.eagle.train.sources import _text_files
    from specdec.drafters.ngram_lm import corpus_documents
    from specdec.quality.text import heldout_topics, pydoc_text, training_topics

    held = heldout_topics()
    assert held and not set(held) & set(training_topics())
    assert set(held) | set(training_topics()) == set(topics)
    pydoc_docs = corpus_documents(["pydoc"], max_chars=10**9)
    assert len(pydoc_docs) == len(training_topics())
    assert not {topics[name] for name in held} & set(pydoc_docs)
    assert not any("pydoc_data" in p.parts for p in _text_files(0))
    text = pydoc_text()
    assert all(topics[name].strip("\n") in text for name in held)
    assert text == pydoc_text()  # deterministic


def test_committed_perplexity_table_comes_from_its_raw_figures():
    from paper.results import load_summary
    from specdec.bench.report import benchmark_document
    from specdec.quality import report

    path = Path(__file__).resolve().parents[1] / "paper" / "results" / "perplexity.json"
    doc = load_summary(path)
    envelope = {"schema", "experiment", "description", "created_at", "smoke", "complete", "num_runs"}
    envelope |= {"num_planned_runs", "missing_run_ids", "machine", "title", "notes", "tables", "figures"}
    raw = {k: v for k, v in doc.items() if k not in envelope}
    again = benchmark_document(
        raw, experiment="perplexity", summarize=report.summarize, description="", created_at=doc["created_at"]
    )
    assert json.loads(json.dumps(again["tables"])) == doc["tables"]
    weights = doc["weights"]
    assert weights[doc["reference"]]["kld_mean"] is None and doc["peers"]["llama.cpp"]["ppl"] > 1
    for name, row in weights.items():
        assert row["ppl_stderr"] > 0 and (name == doc["reference"]) == (row["top1_agree"] is None)


def test_peer_kl_leaves_out_tokens_below_minus_16_as_llama_does(tmp_path):
    g = torch.Generator().manual_seed(1)
    ctx, V = 8, 50
    base_NV = torch.log_softmax(12 * torch.randn(ctx - 1 - ctx // 2, V, generator=g), dim=-1)
    assert (base_NV < -16).any()  # some of llama.cpp's tokens fall below its range
    chunks = torch.randint(0, V, (1, ctx), generator=g)
    path = tmp_path / "base.bin"
    _write_logits_file(path, chunks.reshape(-1).numpy(), [base_NV.numpy()], ctx, V)
    peer = read_llama_logits(path)
    ours = torch.full_like(base_NV, -math.log(V))
    compare = PeerComparison(peer, chunks)
    compare.observe(
        0, "uniform", Scores(torch.zeros(base_NV.shape[0], dtype=torch.float64), ours, ours.argmax(-1))
    )
    stored = peer.chunk_logprobs(0).double()
    kept = stored > -16
    by_hand = (
        torch.where(kept, stored.exp() * (stored + math.log(V)), torch.zeros_like(stored)).sum(-1).mean()
    )
    got = compare.result()["weights"]["uniform"]["kld_mean"]
    assert got == pytest.approx(float(by_hand), rel=1e-6) and got > 1.0
