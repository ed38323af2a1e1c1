"""Every checkpoint is held to its config before anything is packed or run, and the native kernels'
entry points check the sizes they are given (issue 35).

Legend: V vocabulary, D hidden size, F intermediate size, E head dim.

A tiny random-init Llama (V = 259, D = 64, F = 128, 2 layers, 4 query and 2 key/value heads) is
saved as safetensors and as a GGUF file (llama.cpp's names and rotary row order; Q4_1 matrices, a
Q8_0 embedding, F32 norms), then corrupted in the ways users met: a matrix cut or grown, a tensor
missing, a truncated file, a header that claims 2**40 tensors. Every one must be a ``ValueError``
naming the file, the tensor, its shape and the expected one. What runs the native C forward runs in
a subprocess, so that a regression fails a test (with the signal) instead of killing pytest.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _tiny import save_tiny_checkpoint, tiny_llama, write_llama_gguf

from specdec.targets.checkpoint_contract import Checkpoint, check_checkpoint, expected_tensors
from specdec.targets.gguf import check_gguf_file, load_gguf_state
from specdec.targets.gguf_index import read_gguf_index
from specdec.targets.llama import LlamaTarget
from specdec.targets.llama_config import LlamaConfig, load_safetensors_state

gguf = pytest.importorskip("gguf")

V, D, F = 259, 64, 128
L0, L1 = "model.layers.0.", "model.layers.1."
IDS = [[71, 68, 75, 75, 78, 220, 87]]

# name -> replacement tensor (None: drop it), and the shape the message must name with the expected one
SAFETENSORS_CASES = {
    "down_cut": (
        {L0 + "mlp.down_proj.weight": torch.randn(D, 96)},
        L0 + "mlp.down_proj.weight",
        [D, 96],
        [D, F],
    ),
    "gate_up_grown": (
        {
            L0 + "mlp.gate_proj.weight": torch.randn(F + 32, D),
            L0 + "mlp.up_proj.weight": torch.randn(F + 32, D),
        },
        L0 + "mlp.gate_proj.weight",
        [F + 32, D],
        [F, D],
    ),
    "q_cut": (
        {L0 + "self_attn.q_proj.weight": torch.randn(32, D)},
        L0 + "self_attn.q_proj.weight",
        [32, D],
        [D, D],
    ),
    "norm_cut": (
        {L1 + "input_layernorm.weight": torch.ones(D - 1)},
        L1 + "input_layernorm.weight",
        [D - 1],
        [D],
    ),
    "missing": ({L1 + "mlp.up_proj.weight": None}, L1 + "mlp.up_proj.weight", None, [F, D]),
}


# --- checkpoints ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """The tiny checkpoint (safetensors, config, tokenizer)."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("good") / "model")


def _corrupt(good: Path, out: Path, changes: dict[str, torch.Tensor | None]) -> Path:
    """A copy of ``good`` with tensors replaced (or dropped, for None)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(good, out)
    state = load_file(str(good / "model.safetensors"))
    for name, value in changes.items():
        if value is None:
            state.pop(name)
        else:
            state[name] = value
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def corrupted(good, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corrupted")
    return {case: _corrupt(good, root / case, spec[0]) for case, spec in SAFETENSORS_CASES.items()}


def _config(model) -> LlamaConfig:
    return LlamaConfig.from_hf(model.config)


def write_gguf(path: Path, model, *, replace=None, drop=(), kinds=None) -> Path:
    """``model`` as a GGUF file: Q4_1 matrices, a Q8_0 embedding, F32 norms (``kinds``: GGUF name ->
    another type), with tensors replaced by float arrays (``replace``) or left out (``drop``)."""
    Q = gguf.GGMLQuantizationType
    kinds = kinds or {}
    V = model.config.vocab_size

    def vocab(w) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(V)])
        w.add_token_scores([0.0] * V)
        w.add_token_merges([])
        w.add_eos_token_id(258)

    def kind(name: str, a: np.ndarray):
        return kinds.get(name, Q.F32 if a.ndim == 1 else Q.Q8_0 if name == "token_embd.weight" else Q.Q4_1)

    context = model.config.max_position_embeddings
    return write_llama_gguf(
        path, model, vocab=vocab, context_length=context, drop=drop, replace=replace, kind=kind
    )


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def good_gguf(model, tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model)


def _load_gguf(path: Path, model) -> Checkpoint:
    c = model.config
    return load_gguf_state(
        path, model_type="llama", num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads
    )


def _logits(target: LlamaTarget) -> torch.Tensor:
    target.reset(1, 16)
    return target.forward(torch.tensor(IDS), torch.tensor([0])).logits_BTV[0]


# --- safetensors ------------------------------------------------------------------------------------
def test_the_contract_lists_every_tensor_of_a_transformers_llama(model):
    """The table is the model's own state dict, shape for shape (untied: with the LM head)."""
    table = expected_tensors(_config(model))
    assert {k: list(e.shape) for k, e in table.items()} == {
        k: list(v.shape) for k, v in model.state_dict().items()
    }


def test_a_correct_checkpoint_loads_and_matches_transformers(good, model):
    state = load_safetensors_state(good)
    assert isinstance(state, Checkpoint) and state.files == [good / "model.safetensors"]
    target = LlamaTarget.from_pretrained(good, load_tokenizer=False, linear_backend="reference")
    with torch.no_grad():
        ref = model(torch.tensor(IDS)).logits[0]
    torch.testing.assert_close(_logits(target), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_a_malformed_safetensors_checkpoint_names_file_tensor_and_shapes(corrupted, case):
    _, name, shape, expected = SAFETENSORS_CASES[case]
    path = corrupted[case]
    with pytest.raises(ValueError) as info:
        LlamaTarget.from_pretrained(path, load_tokenizer=False, linear_backend="reference")
    message = str(info.value)
    assert str(path / "model.safetensors") in message and repr(name) in message
    assert str(expected) in message
    assert (str(shape) in message) if shape is not None else "is missing" in message


def test_dtype_and_leftover_tensors_are_refused(model):
    config = _config(model)
    state = dict(model.state_dict())
    state[L0 + "input_layernorm.weight"] = torch.ones(D, dtype=torch.int64)
    with pytest.raises(
        ValueError, match=r"input_layernorm.weight' holds torch.int64 values, expected floating"
    ):
        check_checkpoint(config, state)
    state = {**model.state_dict(), L0 + "mlp.extra.weight": torch.ones(2)}
    with pytest.raises(
        ValueError, match=r"'model.layers.0.mlp.extra.weight' is not a tensor the native llama"
    ):
        check_checkpoint(config, state)
    state = {**model.state_dict(), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    check_checkpoint(config, state)  # recomputed by the target, never read: allowed


def test_a_packed_cache_whose_bytes_do_not_match_its_sizes_is_stale(good, tmp_path):
    """A cached packed weight is checked like any other (``PackedWeight``): a short one is rebuilt,
    not handed to the kernel."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from specdec.targets.llama_weights import load_packed, save_packed

    weights = LlamaTarget.from_pretrained(good, load_tokenizer=False, linear_backend="packed").packed_weights
    path = tmp_path / "packed.safetensors"
    save_packed(weights, path, "key")
    assert load_packed(path, "key") is not None
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    tensors["L0.down.data"] = tensors["L0.down.data"][:-4].clone()
    save_file(tensors, str(path), metadata=metadata)
    assert load_packed(path, "key") is None


# --- GGUF ------------------------------------------------------------------------------------------
def test_a_correct_gguf_reads_as_written(good_gguf, model):
    """Names mapped, llama.cpp's rotary rows undone, blocks kept; the gguf format runs the same
    function as its dequantised float32 weights."""
    state = _load_gguf(good_gguf, model)
    assert state.origins["model.layers.0.self_attn.q_proj.weight"] == (good_gguf, "blk.0.attn_q.weight")
    ref = model.state_dict()
    assert set(state) == set(ref)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        w = state[name].dequantize()  # Q4_1: within one quantisation step of the original rows
        step = (ref[name].amax(1, keepdim=True) - ref[name].amin(1, keepdim=True)) / 15
        assert bool(((w - ref[name]).abs() <= step).all()), name
    assert torch.equal(state["model.norm.weight"], ref["model.norm.weight"])
    config = _config(model)
    floats = {k: v.dequantize() if hasattr(v, "dequantize") else v for k, v in state.items()}
    as_gguf = LlamaTarget(config, state, weights="gguf", linear_backend="reference")
    as_fp32 = LlamaTarget(config, floats, weights="fp32", linear_backend="reference")
    torch.testing.assert_close(_logits(as_gguf), _logits(as_fp32), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "options, tensor, shape, expected",
    [
        (
            {"replace": {"token_embd.weight": np.zeros((V - 32, D), np.float32)}},
            "token_embd.weight",
            [V - 32, D],
            [V, D],
        ),
        (
            {"replace": {"blk.0.ffn_down.weight": np.zeros((D, 96), np.float32)}},
            "blk.0.ffn_down.weight",
            [D, 96],
            [D, F],
        ),
        ({"drop": ("blk.1.ffn_up.weight",)}, "blk.1.ffn_up.weight", None, [F, D]),
    ],
    ids=["token_embd_short", "ffn_down_cut", "missing"],
)
def test_a_gguf_of_the_wrong_shapes_names_file_tensor_and_shapes(
    model, tmp_path, options, tensor, shape, expected
):
    path = write_gguf(tmp_path / "bad.gguf", model, **options)
    with pytest.raises(ValueError) as info:
        LlamaTarget(_config(model), _load_gguf(path, model), weights="gguf", linear_backend="reference")
    message = str(info.value)
    assert message.startswith(f"{path}: tensor {tensor!r} (model.")
    assert str(expected) in message
    if shape is None:
        assert "is missing" in message
        check_gguf_file(path)  # presence is the contract's (or the conversion's) to check
    else:  # found from the file's own metadata, before any tensor data is read
        assert str(shape) in message and "of the file's llama metadata" in message
        with pytest.raises(ValueError) as info:
            check_gguf_file(path)
        assert str(info.value) == message


def test_a_gguf_that_disagrees_with_the_config_is_named(good_gguf, model):
    config = dataclasses.replace(_config(model), vocab_size=V + 1)
    with pytest.raises(ValueError) as info:
        LlamaTarget(config, _load_gguf(good_gguf, model), weights="gguf", linear_backend="reference")
    assert str(info.value).startswith(
        f"{good_gguf}: tensor 'token_embd.weight' (model.embed_tokens.weight) has shape [259, 64], "
        f"expected [260, 64] = [vocab_size, hidden_size] of the config"
    )


def test_a_gguf_tensor_type_the_format_cannot_run_is_named(model, tmp_path):
    path = write_gguf(
        tmp_path / "q5.gguf", model, kinds={"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q5_0}
    )
    with pytest.raises(
        ValueError, match=r"q5\.gguf: GGUF tensor 'blk\.0\.ffn_up\.weight' has type Q5_0, which"
    ):
        _load_gguf(path, model)


def _patched(src: Path, dst: Path, at: int, data: bytes | None = None, *, cut: int | None = None) -> Path:
    raw = bytearray(src.read_bytes())
    if data is not None:
        raw[at : at + len(data)] = data
    dst.write_bytes(bytes(raw[:cut] if cut is not None else raw))
    return dst


def test_malformed_gguf_files_are_one_line_value_errors(good_gguf, model, tmp_path):
    raw = good_gguf.read_bytes()
    index = read_gguf_index(good_gguf)
    last = max(index.tensors.values(), key=lambda t: t.offset)
    tokens_at = raw.index(b"tokenizer.ggml.tokens")
    down = raw.index(b"blk.0.ffn_down.weight") + len("blk.0.ffn_down.weight") + 4  # its first dim (I)
    index_at = raw.index(b"blk.1.ffn_down.weight")
    cases = {
        # cut inside the vocabulary, or the tensor index: the header names the field it cannot finish
        "index_cut": (
            _patched(good_gguf, tmp_path / "h.gguf", 0, cut=index_at + 30),
            "of tensor 'blk.1.ffn_down",
        ),
        "header_cut": (
            _patched(good_gguf, tmp_path / "a.gguf", 0, cut=tokens_at + 2000),
            "'tokenizer.ggml.tokens'",
        ),
        # header intact, data cut: the tensor whose bytes are gone
        "data_cut": (_patched(good_gguf, tmp_path / "b.gguf", 0, cut=len(raw) - 100), f"{last.name!r}"),
        "tensors_2e40": (
            _patched(good_gguf, tmp_path / "c.gguf", 8, struct.pack("<Q", 2**40)),
            "1099511627776 tensors",
        ),
        "keys_2e40": (
            _patched(good_gguf, tmp_path / "d.gguf", 16, struct.pack("<Q", 2**40)),
            "1099511627776 metadata",
        ),
        # a shape in the index that its bytes do not have: [64, 256] where 128 inputs were written
        "dims_wrong": (
            _patched(good_gguf, tmp_path / "e.gguf", down, struct.pack("<Q", 2 * F)),
            "'blk.0.ffn_down.weight' [64, 256] Q4_1",
        ),
        "not_gguf": (_patched(good_gguf, tmp_path / "f.gguf", 0, b"GGUX"), "no GGUF magic"),
        "utf8_name": (
            _patched(good_gguf, tmp_path / "g.gguf", raw.index(b"blk.0.ffn_down"), b"\xff"),
            "not UTF-8",
        ),
    }
    assert struct.unpack_from("<Q", raw, down)[0] == F
    for case, (path, needle) in cases.items():
        with pytest.raises(ValueError) as info:
            _load_gguf(path, model)
        message = str(info.value)
        assert message.startswith(f"{path}: ") and needle in message and "\n" not in message, (case, message)


def test_the_cli_prints_one_line_for_a_malformed_gguf(good_gguf, tmp_path, monkeypatch, capsys):
    """What a user runs: ``specdec generate --target BAD.gguf`` (the header is read before any
    conversion, so nothing here reaches transformers or a kernel)."""
    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    bad = _patched(good_gguf, tmp_path / "huge.gguf", 8, struct.pack("<Q", 2**40))
    assert main(["generate", "--target", str(bad), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specdec: error: ") and str(bad) in err, err


# --- the native kernels' entry points (in a subprocess: a regression would abort) -----------------------
def native_battery(spec_file: str) -> None:
    """Run in a subprocess by :func:`test_native_entry_points_refuse_what_would_reach_memory_out_of_bounds`:
    every malformed input through the native backend; prints one JSON object of what each did."""
    import contextlib
    import io

    from kernels.llama_forward import LayerSpec, LinearSpec, NativeDecoder
    from kernels.packed_gemm import PackedWeight, pack_weight
    from specdec.cli import main

    spec = json.loads(Path(spec_file).read_text())
    out: dict[str, str] = {}

    def attempt(case, fn):
        try:
            fn()
            out[case] = "ran"
        except ValueError as err:
            out[case] = str(err)

    def load_and_run(path):
        target = LlamaTarget.from_pretrained(path, load_tokenizer=False, linear_backend="packed")
        assert target._native is not None, "the native forward does not build here"
        _logits(target)

    for case, path in spec["safetensors"].items():
        attempt(case, lambda path=path: load_and_run(path))
    model = tiny_llama()
    config = _config(model)
    wide = dataclasses.replace(config, vocab_size=V + 1)  # a config.json that disagrees with the file
    attempt("gguf", lambda: LlamaTarget(wide, _load_gguf(Path(spec["gguf"]), model), weights="gguf"))

    good = LlamaTarget.from_pretrained(spec["good"], load_tokenizer=False, linear_backend="packed")
    ref = _logits(good).tolist()
    decoder, weights = good._native, good.packed_weights
    specs = [
        LayerSpec(
            *(LinearSpec(w.packed_weight, w.bias_O, w.norm_weight_I, w.norm_eps, w.swiglu) for w in lins)
        )
        for lins in ((ly.qkv, ly.o, ly.gate_up, ly.down) for ly in weights.layers)
    ]
    cut = LinearSpec(pack_weight(torch.randn(D, 96)), swiglu=True)
    bad_layers = [dataclasses.replace(specs[0], down=cut), specs[1]]
    dims = {"heads": 4, "kv_heads": 2, "head_dim": 16, "eps": 1e-5}
    attempt("decoder_down_cut", lambda: NativeDecoder(bad_layers, **dims))
    attempt("decoder_heads", lambda: NativeDecoder(specs, **{**dims, "heads": 8}))
    w = specs[0].qkv.weight
    attempt(
        "short_data",
        lambda: PackedWeight(w.fmt, w.out_features, w.in_features, w.group_size, w.isa, w.data[:-4]),
    )

    good.reset(1, 8)
    x, start = good.embed_tokens.weight[torch.tensor([1, 2])].contiguous(), torch.tensor([0])
    cos, sin = good._cos[:2].contiguous(), good._sin[:2].contiguous()
    k, v = good.cache.k_NBHLD, good.cache.v_NBHLD
    attempt("start_past_cache", lambda: decoder.forward(x, torch.tensor([7]), cos, sin, k, v, None, [0, 1]))
    attempt(
        "cache_shape", lambda: decoder.forward(x, start, cos, sin, k[:, :, :1].contiguous(), v, None, [0, 1])
    )
    attempt("x_width", lambda: decoder.forward(x[:, :32].contiguous(), start, cos, sin, k, v, None, [0, 1]))
    attempt("run_index", lambda: decoder.forward(x, start, cos, sin, k, v, None, [0, 2]))
    attempt(
        "mask_shape",
        lambda: decoder.forward(x, start, cos, sin, k, v, torch.ones(3, 3, dtype=torch.bool), [0]),
    )
    # Past every Python check: the C entry point refuses products whose sizes are not the model's.
    decoder._structs[0].down.O = 32
    attempt("c_sizes", lambda: decoder.forward(x, start, cos, sin, k, v, None, [0, 1]))
    decoder._structs[0].down.O = D
    out["good_again"] = "same" if _logits(good).tolist() == ref else "differs"

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(
            ["generate", "--target", spec["safetensors"]["down_cut"], "--prompt", "hi", "--drafter", "none"]
        )
    out["cli"] = json.dumps([code, err.getvalue()])
    print(json.dumps(out))


@pytest.mark.slow
def test_native_entry_points_refuse_what_would_reach_memory_out_of_bounds(good, corrupted, model, tmp_path):
    """The malformed checkpoints that once aborted with ``double free or corruption`` (down_proj cut,
    gate/up grown) or read out of bounds (q_proj cut), under the native backend; then the C entry
    points themselves, given mismatched sizes past the checkpoint check."""
    spec = {
        "good": str(good),
        "safetensors": {case: str(path) for case, path in corrupted.items()},
        "gguf": str(write_gguf(tmp_path / "tiny.gguf", model)),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    tests = str(Path(__file__).parent)
    spec_file, module = str(tmp_path / "spec.json"), Path(__file__).stem
    code = f"import sys; sys.path.insert(0, {tests!r}); import {module} as t; t.native_battery({spec_file!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode} (a negative one is a signal): {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, (_, name, shape, expected) in SAFETENSORS_CASES.items():
        assert repr(name) in out[case] and str(expected) in out[case], (case, out[case])
        assert str(shape) in out[case] if shape is not None else "is missing" in out[case]
    assert (
        "'token_embd.weight' (model.embed_tokens.weight) has shape [259, 64], expected [260, 64]"
        in out["gguf"]
    )
    assert "layer 0 down: packed weight [64, 96], expected [64, 128]" in out["decoder_down_cut"]
    assert "layer 0 qkv: packed weight [128, 64], expected [192, 64]" in out["decoder_heads"]
    assert "packs into" in out["short_data"]
    assert "start_B + T must lie in [0, L=8]" in out["start_past_cache"]
    assert "k_cache must be [N=2, rows, J=2, L, E=16]" in out["cache_shape"]
    assert "x_MD must be [B*T, D=64]" in out["x_width"]
    assert "run must hold layer indices in [0, 2)" in out["run_index"]
    assert "block_mask_TT must be [T, T] = [2, 2]" in out["mask_shape"]
    assert "code -3" in out["c_sizes"]
    assert out["good_again"] == "same"
    code, err = json.loads(out["cli"])
    assert code == 2 and err.count("\n") == 1 and "down_proj.weight' has shape [64, 96]" in err, err
