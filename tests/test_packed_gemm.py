"""kernels.packed_gemm (csrc/packed_gemm.c) against x @ W.T: row counts from one tile (decode) to many
(with and without the next-block prefetch), odd shapes that leave partial blocks, float32 and bfloat16
weights, and bad input."""

from __future__ import annotations

import pytest
import torch

import kernels.packed_gemm as pg

pytestmark = pytest.mark.skipif(not pg.packed_gemm_available(), reason="no C compiler: packed kernel is off")


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 24, 100, 192, 193, 300])
@pytest.mark.parametrize("in_features,out_features", [(37, 45), (64, 96), (130, 33)])
def test_packed_matmul_equals_the_plain_product(rows, in_features, out_features):
    gen = torch.Generator().manual_seed(rows * 7 + in_features)
    w_OI = torch.randn(out_features, in_features, generator=gen)
    x_MI = torch.randn(rows, in_features, generator=gen)
    got = pg.packed_matmul(x_MI, pg.pack_weight(w_OI), out_features)
    expected = (x_MI.double() @ w_OI.double().T).float()
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 30])
def test_bfloat16_weights_multiply_in_float32(rows):
    gen = torch.Generator().manual_seed(rows)
    w_OI = torch.randn(70, 40, generator=gen)
    x_MI = torch.randn(rows, 40, generator=gen)
    got = pg.packed_matmul(x_MI, pg.pack_weight(w_OI, torch.bfloat16), 70)
    expected = (x_MI.double() @ w_OI.bfloat16().double().T).float()  # weights rounded, math in fp32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_packed_gemm_rejects_bad_input():
    w = pg.pack_weight(torch.randn(8, 6))
    with pytest.raises(ValueError, match="x_MI"):
        pg.packed_matmul(torch.randn(3, 6).double(), w, 8)
    with pytest.raises(ValueError, match="x_MI"):
        pg.packed_matmul(torch.randn(6, 3).T, w, 8)  # not contiguous
    with pytest.raises(ValueError, match="do not make"):
        pg.packed_matmul(torch.randn(3, 5), w, 8)
    with pytest.raises(ValueError, match="do not make"):
        pg.packed_matmul(torch.randn(3, 6), w, 10_000)
    with pytest.raises(ValueError, match="w_OI"):
        pg.pack_weight(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="dtype"):
        pg.pack_weight(torch.randn(2, 3), torch.float16)


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_swiglu_input_is_computed_inside_the_kernel(rows):
    gen = torch.Generator().manual_seed(rows)
    w_OI = torch.randn(50, 36, generator=gen)
    h = torch.randn(rows, 72, generator=gen) * 4  # [gate | up], wide enough to saturate the sigmoid
    got = pg.packed_matmul(h, pg.pack_weight(w_OI), 50, swiglu=True)
    g, u = h.double().chunk(2, dim=-1)
    expected = ((g * torch.sigmoid(g) * u) @ w_OI.double().T).float()
    # float32 rounding of sums of ~36 terms of size up to ~100: relative to the output's scale
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))
    with pytest.raises(ValueError, match="gate | up"):
        pg.packed_matmul(torch.randn(rows, 71), pg.pack_weight(w_OI), 50, swiglu=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_and_stream_prefetch_at_the_ends(dtype):
    """One tile, two tiles and many (2+ rows prefetch the weight stream; a prefetch past the last
    block must not fault) all equal the float64 reference."""
    gen = torch.Generator().manual_seed(3)
    w_OI = torch.randn(130, 200, generator=gen)
    w = pg.pack_weight(w_OI, dtype)
    for rows in (1, 2, 7, 12, 13, 40, 300):
        x = torch.randn(rows, 200, generator=gen)
        expected = (x.double() @ w_OI.to(dtype).double().T).float()
        torch.testing.assert_close(pg.packed_matmul(x, w, 130), expected, rtol=1e-5, atol=1e-4)
