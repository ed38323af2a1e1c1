"""kernels.packed_gemm (csrc/packed_gemm.c) against its oracle, F.linear on the dequantised weight:
every weight format (f32, bf16, q8, q4) on every ISA path this CPU runs (AVX-512, AVX2, generic),
row counts from one tile (decode) to many (with the next-block prefetch), odd shapes that leave
partial blocks, the fused input transforms, GGUF blocks, and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.packed_gemm as pg
from kernels.native import ISA_FLAGS, cpu_isa, runnable_isas
from kernels.quant import QuantizedRows, from_gguf_blocks, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(not pg.packed_gemm_available(), reason="no C compiler: packed kernel is off")
ISAS = runnable_isas()


def _packed(fmt: str, w_OI: torch.Tensor, isa: str, group: int = 32) -> pg.PackedWeight:
    if fmt in ("f32", "bf16"):
        return pg.pack_weight(w_OI, torch.float32 if fmt == "f32" else torch.bfloat16, isa=isa)
    return (quantize_int8(w_OI) if fmt == "q8" else quantize_int4(w_OI, group)).pack(isa)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 accumulation-order tolerance: relative to the output's scale."""
    torch.testing.assert_close(got, want.float(), rtol=0, atol=2e-5 * float(want.abs().max()) + 1e-6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8", "q4"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 12, 13, 40, 193])
def test_every_format_on_every_isa_path_equals_the_dequantised_product(isa, fmt, rows):
    gen = torch.Generator().manual_seed(rows * 7)
    for out_features, in_features in ((45, 64), (130, 96), (33, 160)):
        w_OI = torch.randn(out_features, in_features, generator=gen)
        packed = _packed(fmt, w_OI, isa)
        x_MI = torch.randn(rows, in_features, generator=gen)
        got = pg.packed_linear(x_MI, packed)
        assert got.shape == (rows, out_features)
        _close(got, x_MI.double() @ packed.dequantize().double().T)


@pytest.mark.parametrize("fmt", ["f32", "q4"])
def test_threads_split_the_blocks_without_changing_a_bit(fmt):
    """Each output block is computed by one thread, so any thread count gives the same floats."""
    gen = torch.Generator().manual_seed(3)
    packed = _packed(fmt, torch.randn(200, 96, generator=gen), cpu_isa())
    x_MI = torch.randn(7, 96, generator=gen)
    one = pg.packed_linear(x_MI, packed, threads=1)
    for threads in (2, 3, 64):
        assert torch.equal(pg.packed_linear(x_MI, packed, threads=threads), one)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["f32", "q4"])
@pytest.mark.parametrize("fused", ["bias+residual", "norm", "swiglu"])
def test_fused_input_transforms_equal_the_unfused_ops(isa, fmt, fused):
    gen = torch.Generator().manual_seed(3)
    O, I = 70, 64
    w_OI = torch.randn(O, I, generator=gen)
    packed = _packed(fmt, w_OI, isa)
    w = packed.dequantize()
    for rows in (1, 6, 30):
        x = torch.randn(rows, 2 * I if fused == "swiglu" else I, generator=gen) * 3
        if fused == "bias+residual":
            b, r = torch.randn(O, generator=gen), torch.randn(rows, O, generator=gen)
            got, want = pg.packed_linear(x, packed, bias_O=b, residual_MO=r), F.linear(x, w, b) + r
        elif fused == "norm":
            n = torch.rand(I, generator=gen) + 0.5
            got = pg.packed_linear(x, packed, norm_weight_I=n, norm_eps=1e-5)
            want = F.linear(F.rms_norm(x, (I,), n, 1e-5), w)
        else:
            got = pg.packed_linear(x, packed, swiglu=True)
            g, u = x.double().chunk(2, dim=-1)
            want = (g * torch.sigmoid(g) * u) @ w.double().T
        _close(got, want)


def test_the_layout_round_trips_and_the_isa_paths_agree():
    """dequantize() recovers what was packed; every ISA path packs its own layout of the same weight
    and computes the same product (to accumulation order)."""
    gen = torch.Generator().manual_seed(5)
    w_OI = torch.randn(50, 64, generator=gen)
    x = torch.randn(3, 64, generator=gen)
    results = []
    for isa in ISAS:
        assert torch.equal(pg.pack_weight(w_OI, isa=isa).dequantize(), w_OI)
        assert torch.equal(
            pg.pack_weight(w_OI, torch.bfloat16, isa=isa).dequantize(), w_OI.bfloat16().float()
        )
        q4 = quantize_int4(w_OI)
        assert torch.equal(q4.pack(isa).dequantize(), q4.dequantize())
        results.append(pg.packed_linear(x, q4.pack(isa)))
    for r in results[1:]:
        _close(r, results[0])


def test_quantisers_stay_close_and_handle_flat_rows():
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(20, 64, generator=gen)
    w[3] = 0.25  # a row (and its groups) with one value: scale 0
    i8, i4 = quantize_int8(w), quantize_int4(w, 32)
    assert (i8.dequantize() - w).abs().max() <= w.abs().amax(dim=1, keepdim=True).max() / 127 * 0.51 + 1e-3
    spread = w.view(20, 2, 32).amax(-1) - w.view(20, 2, 32).amin(-1)
    assert ((i4.dequantize() - w).view(20, 2, 32).abs().amax(-1) <= spread / 15 * 0.51 + 1e-3).all()
    assert torch.allclose(i4.dequantize()[3], w[3], atol=1e-3)
    with pytest.raises(ValueError, match="group_size must divide"):
        quantize_int4(w, 48)
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_int8(torch.full((2, 4), float("nan")))


def test_gguf_blocks_dequantise_like_the_gguf_package():
    """Q4_0 / Q4_1 / Q8_0 blocks, packed as they are: the dequantised weight is gguf's, bit for bit."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    gen = np.random.default_rng(0)
    w = gen.standard_normal((48, 64)).astype(np.float32)
    for kind in ("Q4_0", "Q4_1", "Q8_0"):
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        raw = gguf.quants.quantize(w, qtype)
        expected = gguf.quants.dequantize(raw, qtype).reshape(48, 64)
        rows = from_gguf_blocks(raw, kind, 48, 64)
        assert isinstance(rows, QuantizedRows) and np.array_equal(rows.dequantize().numpy(), expected)
        assert torch.equal(rows.pack().dequantize(), rows.dequantize())
    with pytest.raises(ValueError, match="'Q6_K' is not read natively"):
        from_gguf_blocks(np.zeros(10, np.uint8), "Q6_K", 1, 256)


def test_isa_selection_and_bad_input(monkeypatch):
    assert cpu_isa() in ISAS and ISAS[-1] == "generic" and set(ISAS) <= set(ISA_FLAGS)
    monkeypatch.setenv("SPECDEC_CPU_ISA", "generic")
    assert cpu_isa() == "generic"
    monkeypatch.setenv("SPECDEC_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="SPECDEC_CPU_ISA must be one of"):
        cpu_isa()
    if "avx512" not in ISAS:
        monkeypatch.setenv("SPECDEC_CPU_ISA", "avx512")
        with pytest.raises(ValueError, match="cannot run"):
            cpu_isa()
    monkeypatch.delenv("SPECDEC_CPU_ISA")
    w = pg.pack_weight(torch.randn(8, 6))
    with pytest.raises(ValueError, match="x_MI"):
        pg.packed_linear(torch.randn(3, 6).double(), w)
    with pytest.raises(ValueError, match="x_MI"):
        pg.packed_linear(torch.randn(3, 5), w)
    with pytest.raises(ValueError, match="w_OI"):
        pg.pack_weight(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="dtype"):
        pg.pack_weight(torch.randn(2, 3), torch.float16)
    with pytest.raises(ValueError, match="out_features"):
        pg.packed_matmul(torch.randn(3, 6), w, 10_000)


@pytest.mark.slow  # compiles the other paths' kernels: ~10 s
def test_every_isa_path_compiles_even_where_this_cpu_cannot_run_it(tmp_path):
    """CI machines differ: the AVX-512 build must at least compile on an AVX2 machine (and vice versa)."""
    import shutil
    import subprocess
    from pathlib import Path

    from kernels.native import COMMON_FLAGS, LIBS

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    root = Path(pg.__file__).parent
    sources = [root / "csrc" / "packed_gemm.c", root / "csrc" / "llama_forward.c"]
    sources.append(root / "routing" / "csrc" / "moe_route_cpu.c")
    for isa in sorted(set(ISA_FLAGS) - set(ISAS)):
        for src in sources:
            out = tmp_path / f"{src.stem}-{isa}.so"
            cmd = [cc, *COMMON_FLAGS, *ISA_FLAGS[isa], str(src), *LIBS, "-o", str(out)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"{isa} {src.name}: {done.stderr[-2000:]}"
            assert out.stat().st_size > 0


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8", "q4"])
def test_a_row_gets_the_same_bits_whatever_the_other_rows(isa, fmt):
    """Batch invariance: a row's output is bitwise the same alone (M = 1) and at any place in a product
    of M rows (tiles of every size, the remainder tile included), whatever the other rows hold."""
    gen = torch.Generator().manual_seed(3)
    for out_features, in_features in ((45, 64), (130, 98)):
        w_OI = torch.randn(out_features, in_features, generator=gen)
        packed = _packed(fmt, w_OI, isa, group=in_features if fmt == "q4" and in_features % 32 else 32)
        x_1I = torch.randn(1, in_features, generator=gen)
        alone = pg.packed_linear(x_1I, packed)
        for rows in (2, 3, 5, 7, 8, 12, 13, 16):
            for at in {0, rows // 2, rows - 1}:
                x_MI = torch.randn(rows, in_features, generator=gen)
                x_MI[at] = x_1I[0]
                got = pg.packed_linear(x_MI, packed)[at : at + 1]
                assert torch.equal(got, alone), f"{fmt} on {isa}: row {at} of {rows} differs from it alone"
