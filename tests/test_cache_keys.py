"""Every cache is keyed on what its contents depend on (``docs/caches.md``).

Legend: T tokens, V vocabulary.

- The GGUF conversion cache: another file of the same name and size, or the same file edited in place,
  converts anew; a file missing a tensor is refused, naming it, and nothing is cached.
- The packed-weight cache: editing ``config.json`` (the norm epsilon baked into the packed layers)
  changes the key, and the reload equals a fresh cache.

Tiny GGUF files are written here from random-init ``transformers`` Llamas (float32 tensors, a byte-level
``gpt2`` vocabulary), in llama.cpp's layout: its tensor names and its rotary row order for q and k.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from _tiny import save_tiny_checkpoint, tiny_llama, write_llama_gguf

from specdec.targets import loading
from specdec.targets.llama import LlamaTarget
from specdec.targets.llama_weights import packed_cache_path

gguf = pytest.importorskip("gguf")

# 256 byte tokens, one merged token (transformers needs a merge), then the specials; EOS 259 or 258.
VOCAB = 260


def write_gguf(path: Path, *, seed: int = 0, eos: int = 259, drop: tuple[str, ...] = (), tied: bool = False):
    """A one-layer Llama as a float32 GGUF file at ``path`` with a byte-level ``gpt2`` vocabulary (without
    the tensors named in ``drop``); returns the ``transformers`` model it was written from."""
    from tokenizers.pre_tokenizers import ByteLevel

    def vocab(w) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([*sorted(ByteLevel.alphabet()), "Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        w.add_token_types([1] * 257 + [3] * 3)
        w.add_token_merges(["Ġ t"])
        w.add_bos_token_id(258 if eos == 259 else 259)
        w.add_eos_token_id(eos)

    model = tiny_llama(seed=seed, num_layers=1, vocab_size=VOCAB, eos_token_id=eos)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_llama_gguf(path, model, vocab=vocab, context_length=256, tied=tied, drop=drop)
    return model


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    """An empty ``$SPECDEC_CACHE`` for the test."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(root))
    return root


def _logits(target: LlamaTarget, ids_T: list[int]) -> torch.Tensor:
    target.reset(1, 32)
    return target.forward(torch.tensor([ids_T]), torch.tensor([0])).logits_BTV[0]


def _hf_logits(model, ids_T: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids_T])).logits[0].float()


IDS = [71, 68, 75, 75, 78, 220, 87, 78, 81, 75, 67]


def test_same_name_and_size_at_two_paths_convert_apart(cache, tmp_path):
    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    model_a, model_b = write_gguf(a, seed=1, eos=259), write_gguf(b, seed=2, eos=258)
    assert a.stat().st_size == b.stat().st_size
    dir_a, dir_b = loading.resolve_checkpoint(a), loading.resolve_checkpoint(b)
    assert dir_a != dir_b and dir_a.parent == dir_b.parent == cache
    assert json.loads((dir_a / "SOURCE.json").read_text())["path"] == str(a.resolve())
    for path, model, eos in ((a, model_a, 259), (b, model_b, 258)):
        target = LlamaTarget.from_pretrained(path, weights="fp32", linear_backend="reference")
        assert target.eos_token_ids == (eos,)
        assert target.tokenizer.eos_token_id == eos
        ref = _hf_logits(model, IDS)
        torch.testing.assert_close(_logits(target, IDS), ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(_hf_logits(loading.load_hf_model(path), IDS), ref, atol=1e-5, rtol=0)
    assert not torch.allclose(_hf_logits(model_a, IDS), _hf_logits(model_b, IDS), atol=1e-3)


def test_a_file_edited_in_place_converts_again(cache, tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(path, seed=3)
    first = loading.resolve_checkpoint(path)
    size = path.stat().st_size
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "output_norm.weight")
    new_norm = np.linspace(0.5, 1.5, tensor.n_elements, dtype=np.float32)
    with open(path, "r+b") as f:  # same size, same header: only one tensor's bytes change
        f.seek(int(tensor.data_offset))
        f.write(new_norm.tobytes())
    assert path.stat().st_size == size
    second = loading.resolve_checkpoint(path)
    assert second != first
    from safetensors.torch import load_file

    assert torch.equal(
        load_file(str(second / "model.safetensors"))["model.norm.weight"], torch.from_numpy(new_norm)
    )
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the time alone
    third = loading.resolve_checkpoint(path)
    assert third not in (first, second)
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == sorted(
        d.name for d in (first, second, third)
    )


def test_a_missing_tensor_is_refused_by_name_and_nothing_is_cached(cache, tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(path, drop=("blk.0.ffn_up.weight",))
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight \(GGUF blk\.0\.ffn_up\.weight\)"
    ) as err:
        loading.resolve_checkpoint(path)
    assert str(path) in str(err.value)
    with pytest.raises(ValueError, match="up_proj"):
        LlamaTarget.from_pretrained(path, weights="fp32", linear_backend="reference")
    left = [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] if cache.exists() else []
    assert left == []


def test_a_tied_lm_head_is_not_missing(cache, tmp_path):
    path = tmp_path / "tied.gguf"
    model = write_gguf(path, seed=4, tied=True)
    out = loading.resolve_checkpoint(path)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)  # what the tied file means
    target = LlamaTarget.from_pretrained(path, weights="fp32", linear_backend="reference")
    torch.testing.assert_close(_logits(target, IDS), _hf_logits(model, IDS), atol=1e-4, rtol=0)


def test_two_threads_convert_once(cache, tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    write_gguf(path, seed=5)
    calls, convert = [], loading._convert_gguf
    monkeypatch.setattr(loading, "_convert_gguf", lambda g, out: (calls.append(out), convert(g, out)))
    outs: list[Path] = []
    threads = [
        threading.Thread(target=lambda: outs.append(loading.resolve_checkpoint(path))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outs) == 2 and outs[0] == outs[1] and len(calls) == 1
    assert (outs[0] / "model.safetensors").is_file()
    assert not [p for p in cache.iterdir() if ".tmp" in p.name]


@pytest.mark.parametrize(
    "cut, message",
    [(10, "truncated GGUF header"), (None, "claims 1099511627776 tensors")],
)
def test_an_unreadable_header_is_a_one_line_error(cache, tmp_path, cut, message):
    import struct

    path = tmp_path / "model.gguf"
    write_gguf(path)
    data = path.read_bytes()
    if cut is None:  # a header claiming 2**40 tensors
        data = data[:8] + struct.pack("<Q", 2**40) + data[16:]
    else:
        data = data[:cut]
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message) as err:
        loading.resolve_checkpoint(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_the_header_index_is_everything_before_the_tensor_data(tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(path)
    reader = gguf.GGUFReader(str(path))
    with open(path, "rb") as f:
        index = loading._HeaderReader(path, f, path.stat().st_size).index_bytes()
    data = path.read_bytes()
    assert data[: len(index)] == index
    assert len(index) <= reader.data_offset < len(index) + reader.alignment  # then the alignment padding
    assert set(data[len(index) : reader.data_offset]) <= {0}


def test_editing_the_norm_epsilon_changes_the_packed_cache_key(monkeypatch, tmp_path):
    from kernels.llama_forward import native_forward_available
    from kernels.native import cpu_isa
    from kernels.packed_gemm import packed_gemm_available

    # Load the kernels from the usual cache before $SPECDEC_CACHE moves (else they compile again).
    if not (packed_gemm_available() and packed_gemm_available(cpu_isa())):
        pytest.skip("the packed kernel does not build here")
    native_forward_available()
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    path = save_tiny_checkpoint(tmp_path / "ckpt", seed=6, init_std=0.2)
    load = lambda: LlamaTarget.from_pretrained(
        path, weights="fp32", linear_backend="packed", load_tokenizer=False
    )
    before = _logits(load(), IDS)
    cache_before, key_before = packed_cache_path(path, None, "fp32", "packed")
    assert cache_before is not None and cache_before.is_file()

    config = json.loads((path / "config.json").read_text())
    config["rms_norm_eps"] = 0.5  # large enough to move the logits
    (path / "config.json").write_text(json.dumps(config))
    cache_after, key_after = packed_cache_path(path, None, "fp32", "packed")
    assert key_after != key_before and cache_after != cache_before
    reloaded = _logits(load(), IDS)
    assert cache_after is not None and cache_after.is_file()

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "fresh"))
    fresh = _logits(load(), IDS)
    assert torch.equal(reloaded, fresh)
    assert not torch.allclose(reloaded, before, atol=1e-3)
