"""``specdec bench-serve``'s llama.cpp peers: ``llama-server:ngram-mod`` and ``llama-server:eagle3`` beside
plain ``llama-server`` and ours. The exact commands of each mode; llama-server's own acceptance (the
responses' ``timings`` and the ``/metrics`` counters per draft position) in the record and the table;
unknown modes refused; the eagle3 head's export and conversion, with a fake ``convert_hf_to_gguf.py``
and a fake ``llama-server`` (``tests/_fake_openai_server.py`` run as a script), and its errors."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx", reason="specdec bench-serve needs httpx")

import _fake_openai_server as fake  # noqa: E402

from specdec.bench import serve_heads as heads  # noqa: E402
from specdec.bench import serve_peers as peers  # noqa: E402
from specdec.bench import serve_probe as probe  # noqa: E402
from specdec.bench.serve_command import BenchServeConfig, run_bench_serve  # noqa: E402
from specdec.bench.serve_load import result_from_trace  # noqa: E402
from specdec.cli import main  # noqa: E402

needs_asgi = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn")),
    reason="the fake server needs starlette and uvicorn ([serve] extra)",
)
ALL_SERVERS = ("ours:none", "ours:default", "llama-server", "llama-server:ngram-mod", "llama-server:eagle3")
COMMON = ["-m", "m.gguf", "-t", "2", "-np", "4", "-c", "2048", "--host", "127.0.0.1", "--port", "9"]


# --- the modes and their commands ------------------------------------------------------------------


def test_every_mode_parses_in_one_list_and_unknown_modes_are_refused():
    specs = peers.parse_servers(ALL_SERVERS)
    assert [(s.kind, s.drafter, s.mode) for s in specs] == [
        ("ours", "none", None),
        ("ours", "default", None),
        ("llama-server", None, None),
        ("llama-server", None, "ngram-mod"),
        ("llama-server", None, "eagle3"),
    ]
    assert [s.name for s in specs] == list(ALL_SERVERS)
    (plain,) = peers.parse_servers(["ours:plain"])  # drafter none, every request without drafts
    assert (plain.drafter, plain.request_extras) == ("none", {"speculative": False})
    assert [s.mode for s in peers.parse_servers(["llama-server:eagle3"], "--peers", ours=False)] == ["eagle3"]
    with pytest.raises(
        ValueError, match=r"--servers: unknown llama-server mode 'dflash'; known: ngram-mod, eagle3"
    ):
        peers.parse_servers(["llama-server:dflash"])
    with pytest.raises(ValueError, match=r"--peers: unknown llama-server mode ''"):
        peers.parse_servers(["llama-server:"], "--peers", ours=False)
    with pytest.raises(ValueError, match="known: ngram-mod, eagle3"):
        peers.llama_speculation_args("draft-eagle3", threads=2)


def test_unknown_mode_on_the_command_line_is_one_line_naming_the_known_ones(tmp_path, capsys):
    argv = ["bench-serve", "--servers", "ours:none,llama-server:lookahead", "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdec: error: --servers: unknown llama-server mode 'lookahead'")
    assert "known: ngram-mod, eagle3" in err and "\n" not in err


def _command(mode, **kw):
    speculation = peers.llama_speculation_args(mode, threads=2, **kw)
    return peers.llama_server_command(
        Path("/bin/llama-server"), Path("m.gguf"), threads=2, slots=4, ctx_per_slot=512, port=9, model="m",
        speculation=speculation,
    )  # fmt: skip


def test_the_command_of_each_mode_is_exact():
    base = ["/bin/llama-server", *COMMON, "--metrics", "-a", "m"]
    assert _command(None) == base
    assert _command("ngram-mod") == [*base, "--spec-type", "ngram-mod"]
    assert _command("eagle3", head=Path("/c/head.gguf"), draft_max=5) == [
        *base, "--spec-type", "draft-eagle3", "-md", "/c/head.gguf", "--spec-draft-n-max", "5",
        "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "--spec-draft-threads", "2",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="-md HEAD.gguf"):
        _command("eagle3")  # no converted head


def test_eagle3_drafts_gamma_tokens_or_three():
    def config(gamma):
        return BenchServeConfig(servers=("llama-server:eagle3",), concurrency=(1,), gamma=gamma)

    assert config("5").draft_max == 5 and config("auto").draft_max == 3 and config("0").draft_max == 0


# --- llama-server's acceptance ---------------------------------------------------------------------


def test_timings_carry_llama_servers_draft_counts():
    def trace(usage, timings):
        return result_from_trace(
            0, sent_s=0.0, token_times_s=[0.1, 0.2], last_choice_s=0.2, usage=usage, timings=timings
        )

    r = trace({"completion_tokens": 2}, {"predicted_n": 2, "draft_n": 6, "draft_n_accepted": 4})
    assert (r.draft_tokens, r.accepted_tokens) == (6, 4)
    none_drafted = trace({"completion_tokens": 2}, {"predicted_n": 2})  # llama-server leaves both out
    assert (none_drafted.draft_tokens, none_drafted.accepted_tokens) == (0, 0)
    ours = trace({"num_draft_tokens": 9, "num_accepted_tokens": 5}, {"draft_n": 6, "draft_n_accepted": 4})
    assert (ours.draft_tokens, ours.accepted_tokens) == (9, 5)  # the usage counts win
    assert trace({"completion_tokens": 2}, None).draft_tokens is None


def test_per_position_counters_of_both_servers():
    llama = (
        "llamacpp:spec_decode_num_drafts_total 10\n"
        "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter\n"
        'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 6\n'
        'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 1\n'
    )
    samples = probe.parse_prometheus_text(llama, keep_label="position")
    assert probe.accepted_per_position(samples) == [6.0, 0.0, 1.0]  # position 1 not listed: 0
    assert probe.spec_counters(samples)["num_drafts"] == 10.0
    ours = (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 5\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_created{model_name="m",position="0"} 1.7e9\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2\n'
    )
    assert probe.accepted_per_position(probe.parse_prometheus_text(ours, keep_label="position")) == [5.0, 2.0]
    assert probe.accepted_per_position(probe.parse_prometheus_text("llamacpp:n_decode_total 3\n")) is None
    assert probe.per_position([6.0, 1.0], [9.0, 2.0, 1.0], 4.0) == [0.75, 0.25, 0.25]
    assert probe.per_position(None, [2.0], 2.0) == [1.0]
    assert probe.per_position([1.0], [1.0], 0.0) is None and probe.per_position(None, None, 3.0) is None


# --- the eagle3 head: export and conversion --------------------------------------------------------


def test_convert_command_is_llama_cpps_script_on_the_head_and_target_folders():
    command = heads.convert_command(
        Path("/l/convert_hf_to_gguf.py"), Path("/c/speculators"), Path("/t"), Path("/c/h.gguf"), python="py"
    )
    assert command == [
        "py", "/l/convert_hf_to_gguf.py", "/c/speculators", "--target-model-dir", "/t",
        "--outfile", "/c/h.gguf", "--outtype", "f32",
    ]  # fmt: skip
    assert heads.convert_command(Path("c.py"), Path("h"), Path("t"), Path("o"))[0] == sys.executable


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_the_converter_is_found_beside_the_binary_or_named(monkeypatch, tmp_path):
    monkeypatch.delenv(heads.LLAMA_CONVERT_ENV, raising=False)
    in_tree = _executable(tmp_path / "llama.cpp" / "build" / "bin" / "llama-server", "")
    script = _executable(tmp_path / "llama.cpp" / heads.CONVERTER, "")
    assert heads.find_converter(in_tree) == script
    out_of_tree = _executable(tmp_path / "build" / "bin" / "llama-server", "")
    (tmp_path / "build" / "CMakeCache.txt").write_text(
        f"# a CMake cache\nCMAKE_HOME_DIRECTORY:INTERNAL={tmp_path / 'llama.cpp'}\n"
    )
    assert heads.find_converter(out_of_tree) == script
    other = tmp_path / "other.py"
    other.write_text("")
    monkeypatch.setenv(heads.LLAMA_CONVERT_ENV, str(other))
    assert heads.find_converter(in_tree) == other  # $LLAMA_CONVERT wins over the tree
    assert heads.find_converter(in_tree, str(script)) == script  # --llama-convert wins over both


def test_a_missing_converter_is_a_value_error_naming_what_to_give(monkeypatch, tmp_path):
    monkeypatch.delenv(heads.LLAMA_CONVERT_ENV, raising=False)
    lone = _executable(tmp_path / "opt" / "bin" / "llama-server", "")
    with pytest.raises(ValueError, match=r"--llama-convert PATH or set \$LLAMA_CONVERT \(none in .*opt/bin"):
        heads.find_converter(lone)
    with pytest.raises(ValueError, match=r"--llama-convert='.*nope.py' is not a file"):
        heads.find_converter(lone, str(tmp_path / "nope.py"))
    monkeypatch.setenv(heads.LLAMA_CONVERT_ENV, str(tmp_path / "gone.py"))
    with pytest.raises(ValueError, match=r"\$LLAMA_CONVERT='.*gone.py' is not a file"):
        heads.find_converter(lone)


FAKE_CONVERTER = """import json, sys
from pathlib import Path
args = sys.argv[1:]
with open({calls!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
head, target = Path(args[0]), Path(args[args.index("--target-model-dir") + 1])
assert (head / "config.json").is_file() and (target / "config.json").is_file()
Path(args[args.index("--outfile") + 1]).write_bytes(b"GGUF fake head")
"""


def _target_dir(path: Path, *, tokenizer: bool = True) -> Path:
    """What convert_hf_to_gguf.py reads from the target's folder (the HF config, the tokenizer)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"vocab_size": 49152, "num_hidden_layers": 30}))
    (path / "tokenizer_config.json").write_text("{}")
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return path


@pytest.fixture
def converter_env(monkeypatch, tmp_path):
    """A cache of our own, a fake converter that logs its arguments, and a target folder."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(heads, "CONVERTER_NEEDS", ())  # the fake script imports nothing
    calls = tmp_path / "calls.jsonl"
    script = _executable(tmp_path / "llama.cpp" / heads.CONVERTER, FAKE_CONVERTER.format(calls=str(calls)))
    target = _target_dir(tmp_path / "target")
    monkeypatch.setattr("specdec.targets.loading.resolve_checkpoint", lambda name: target)
    return script, target, calls


def test_prepare_exports_the_head_converts_it_once_and_caches_it(converter_env):
    script, target, calls = converter_env
    gguf = heads.prepare_eagle3_head("my-target.gguf", converter=script)
    assert gguf.name == "head.gguf" and gguf.read_bytes() == b"GGUF fake head"
    folder = gguf.parent
    assert folder.parent == Path(os.environ["SPECDEC_CACHE"]) / "llama-heads"
    assert folder.name.startswith("eagle3-smollm2-135m-")
    (argv,) = [json.loads(line) for line in calls.read_text().splitlines()]
    assert argv == [
        str(folder / "speculators"), "--target-model-dir", str(target),
        "--outfile", str(folder / "head.gguf.partial"), "--outtype", "f32",
    ]  # fmt: skip
    exported = json.loads((folder / "speculators" / "config.json").read_text())
    assert exported["speculators_model_type"] == "eagle3" and exported["torch_dtype"] == "float32"
    assert exported["speculators_config"]["verifier"]["name_or_path"] == str(target)
    assert len(exported["eagle_aux_hidden_state_layer_ids"]) == 3  # llama.cpp's eagle3 reads exactly 3
    assert heads.prepare_eagle3_head("my-target.gguf", converter=script) == gguf
    assert len(calls.read_text().splitlines()) == 1  # the cache holds it: not converted again


def test_prepare_takes_a_head_folder_as_it_is(converter_env, tmp_path):
    script, _, calls = converter_env
    folder = tmp_path / "my-head"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    gguf = heads.prepare_eagle3_head("t.gguf", converter=script, head=str(folder))
    assert json.loads(calls.read_text())[0] == str(folder) and gguf.is_file()
    assert not (gguf.parent / "speculators").exists()


def test_prepare_names_what_is_missing(converter_env, monkeypatch, tmp_path):
    script, target, _ = converter_env
    monkeypatch.setattr(heads, "CONVERTER_NEEDS", ("transformers", "no_such_module_for_convert"))
    with pytest.raises(ValueError, match=r"imports no_such_module_for_convert, which this Python lacks"):
        heads.prepare_eagle3_head("t.gguf", converter=script)
    monkeypatch.setattr(heads, "CONVERTER_NEEDS", ())
    with pytest.raises(ValueError, match="weights 'no-such-head.safetensors'"):
        heads.prepare_eagle3_head("t.gguf", converter=script, head="no-such-head.safetensors")
    bare = _target_dir(tmp_path / "bare", tokenizer=False)
    monkeypatch.setattr("specdec.targets.loading.resolve_checkpoint", lambda name: bare)
    with pytest.raises(ValueError, match=r"lacks tokenizer.json, which llama.cpp's convert_hf_to_gguf.py"):
        heads.prepare_eagle3_head("t.gguf", converter=script)


def test_a_head_for_another_builtin_target_is_refused(converter_env, tmp_path):
    import torch
    from safetensors.torch import save_file

    script, _, _ = converter_env
    other = tmp_path / "other-head.safetensors"
    save_file({"fc.weight": torch.zeros(1)}, str(other), metadata={"target": "qwen3-0.6b"})
    with pytest.raises(ValueError, match="trained for 'qwen3-0.6b', not --target smollm2-135m"):
        heads.prepare_eagle3_head("smollm2-135m", converter=script, head=str(other))


def test_a_failing_conversion_is_a_runtime_error_with_its_log(converter_env, tmp_path):
    _, _, _ = converter_env
    broken = _executable(
        tmp_path / "broken" / heads.CONVERTER, "raise ModuleNotFoundError('sentencepiece')\n"
    )
    with pytest.raises(RuntimeError, match=r"failed \(status 1\).*ModuleNotFoundError: sentencepiece"):
        heads.prepare_eagle3_head("t.gguf", converter=broken)
    assert not list((tmp_path / "cache" / "llama-heads").glob("*/head.gguf"))  # nothing cached


# --- one run: plain, ngram-mod and eagle3 against the fake llama-server ----------------------------


@pytest.fixture
def fake_llama(monkeypatch, tmp_path, converter_env):
    """The fake llama-server built in the llama.cpp tree that holds the fake converter, on PATH."""
    script, _, calls = converter_env
    binary = script.parent / "build" / "bin" / "llama-server"
    _executable(binary, f'#!/bin/sh\nexec "{sys.executable}" "{Path(fake.__file__).resolve()}" "$@"\n')
    monkeypatch.delenv(peers.LLAMA_SERVER_ENV, raising=False)
    monkeypatch.delenv(heads.LLAMA_CONVERT_ENV, raising=False)
    monkeypatch.setenv("PATH", f"{binary.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(
        "specdec.bench.report.environment", lambda: {"cpu": "Test CPU", "isa": "test", "commit": "abc"}
    )
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return gguf, calls


def _config(gguf: Path, out: Path, servers=("llama-server", "llama-server:ngram-mod", "llama-server:eagle3")):
    return BenchServeConfig(
        peers=servers, target=str(gguf), prompt_sets=("humaneval",), num_prompts=2, max_tokens=8,
        concurrency=(1, 2), threads=3, gamma="4", out=str(out), startup_timeout_s=60,
    )  # fmt: skip


@pytest.mark.slow  # about 6 s on 2 cores
@needs_asgi
def test_three_llama_modes_in_one_run_with_their_acceptance(fake_llama, tmp_path):
    gguf, calls = fake_llama
    lines: list[str] = []
    record = run_bench_serve(_config(gguf, tmp_path / "out"), echo=lines.append)
    plain, ngram, eagle = record["servers"]
    assert [s["name"] for s in record["servers"]] == [
        "llama-server",
        "llama-server:ngram-mod",
        "llama-server:eagle3",
    ]
    assert all(s["exit_status"] == 0 and not s.get("error") for s in record["servers"])
    assert plain["launch"].endswith(f"--metrics -a {gguf}")
    assert ngram["launch"].endswith(f"--metrics -a {gguf} --spec-type ngram-mod")
    head = Path(eagle["head"])
    assert eagle["launch"].endswith(
        f"--metrics -a {gguf} --spec-type draft-eagle3 -md {head} --spec-draft-n-max 4 --spec-draft-n-min 0 "
        "--spec-draft-p-min 0 --spec-draft-threads 3"
    )
    assert head.is_file() and len(calls.read_text().splitlines()) == 1
    assert any(line.startswith("llama-server:eagle3: converting eagle3-smollm2-135m") for line in lines)
    n = 2  # requests per level
    for level in plain["levels"]:
        assert (level["usage_drafted"], level["usage_accepted"]) == (0, 0)  # timings without draft_n
        assert level["acceptance"]["alpha"] is None and level["acceptance"]["per_position"] is None
    for server in (ngram, eagle):
        for level in server["levels"]:
            assert level["completed"] == n
            assert level["usage_drafted"] == n * fake.LLAMA_DRAFT_N
            assert level["usage_accepted"] == n * fake.LLAMA_ACCEPTED
            acc = level["acceptance"]
            assert acc["drafts"] == n * fake.LLAMA_DRAFTS and acc["drafted"] == level["usage_drafted"]
            assert acc["alpha"] == pytest.approx(fake.LLAMA_ACCEPTED / fake.LLAMA_DRAFT_N)
            assert acc["tau"] == pytest.approx(1 + fake.LLAMA_ACCEPTED / fake.LLAMA_DRAFTS)
            assert acc["per_position"] == pytest.approx([c / fake.LLAMA_DRAFTS for c in fake.LLAMA_PER_POS])
    doc = json.loads((tmp_path / "out" / "bench-serve.json").read_text())
    rows = {(r["server"], r["load"]): r for r in doc["tables"][0]["rows"]}
    row = rows[("llama-server:eagle3", "c=2")]
    assert (row["response_drafted"], row["response_accepted"]) == (12, 8)
    assert row["response_alpha"] == pytest.approx(2 / 3) and row["alpha_per_position"] == "0.67 / 0.33 / 0.33"
    assert rows[("llama-server", "c=1")]["alpha_per_position"] is None
    md = (tmp_path / "out" / "bench-serve.md").read_text()
    assert "| α by position | accepted / drafted (responses) |" in md
    assert md.count("| 0.67 | 2.33 | 0.67 / 0.33 / 0.33 | 8 / 12 (0.67) |") == 4  # 2 servers × 2 levels
    assert md.count("| – | – | – | 0 / 0 |") == 2  # plain llama-server drafts nothing
    again = run_bench_serve(_config(gguf, tmp_path / "again", ("llama-server:eagle3",)), echo=lambda _: None)
    assert again["servers"][0]["head"] == str(head) and len(calls.read_text().splitlines()) == 1  # cached


@needs_asgi
def test_without_a_converter_nothing_starts(fake_llama, monkeypatch, tmp_path):
    gguf, _ = fake_llama
    lonely = _executable(tmp_path / "lonely" / "llama-server", "#!/bin/sh\nexit 1\n")
    monkeypatch.setenv(peers.LLAMA_SERVER_ENV, str(lonely))
    with pytest.raises(ValueError, match=r"llama-server:eagle3 needs llama.cpp's convert_hf_to_gguf.py"):
        run_bench_serve(_config(gguf, tmp_path / "out"), echo=lambda _: None)
    assert not list((tmp_path / "out").glob("server-*.log"))  # the check came before any server


def test_eagle3_without_a_llama_server_is_skipped_without_converting(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(peers.LLAMA_SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(
        "specdec.bench.report.environment", lambda: {"cpu": "Test CPU", "isa": "test", "commit": "abc"}
    )
    config = BenchServeConfig(
        servers=("llama-server:eagle3",), num_prompts=1, concurrency=(1,), out=str(tmp_path)
    )
    (entry,) = run_bench_serve(config, echo=lambda _: None)["servers"]
    assert entry["skipped"].startswith("llama-server:eagle3 skipped: no llama-server on PATH")
    assert "head" not in entry
    assert capsys.readouterr().err.startswith("specdec bench-serve: llama-server:eagle3 skipped")


def test_the_llama_flags_reach_the_config():
    from specdec.bench.serve_cli import config_from_args
    from specdec.cli import build_parser

    argv = ["bench-serve", "--servers", ",".join(ALL_SERVERS), "--llama-head", "h.safetensors"]
    config = config_from_args(build_parser().parse_args([*argv, "--llama-convert", "/l/c.py"]))
    assert config.servers == ALL_SERVERS
    assert (config.llama_head, config.llama_convert) == ("h.safetensors", "/l/c.py")
    default = config_from_args(build_parser().parse_args(["bench-serve", "--servers", "llama-server:eagle3"]))
    assert (default.llama_head, default.llama_convert) == (None, None)
