"""Triton grouped GEMM: a persistent forward kernel (also dX) and a weight-gradient kernel (dW).

Legend: M rows in expert order, K reduction dim, N output dim, E experts (groups), BM/BN/BK tile sizes.

Forward, y_MN = x_g @ w[e] per group (or x_g @ w[e]^T when TRANS_W):
  The tile schedule comes from the group sizes alone, on the device (no host sync): every group e owns
  cdiv(m_e, BM) * cdiv(N, BN) output tiles, numbered group after group. A persistent grid of programs
  (about one per SM) walks the tile numbers with a stride of the grid size, as in Triton's grouped-GEMM
  and persistent-matmul tutorials (08, 09) and MegaBlocks (arXiv:2211.15841). A tile number is mapped to
  its group with a prefix sum over the E group sizes held in registers (one vector load per program,
  not a loop of scalar loads). Inside a group, tiles are visited in GROUP_M-row bands so that programs
  running together share w columns and x rows in L2. Accumulation is in float32.
  Operands come in through Hopper TMA descriptors when the strides allow it (USE_TMA), else through
  masked pointer loads; both run under TRITON_INTERPRET=1. A TMA tile of x may run past the group into
  the next group's rows: those rows only feed output rows that are never stored, so it is harmless.
  With FLATTEN the tile loop and the K loop are fused into one software pipeline (tl.range(flatten=True),
  as in Triton's persistent-matmul tutorial), so the next tile's first loads overlap this tile's
  epilogue: it pays where K is short (few K steps per tile), e.g. the down projection of fine-grained
  experts. Tile shape, TMA and FLATTEN are autotuned per (N, K, rows-per-group bucket, layout).
Weight gradient, dw[e] = x_g^T @ dy_g: one program per (e, k-tile, n-tile) reduces over the group's
  rows with masked loads; an empty group stores zeros.
dX is the forward kernel with TRANS_W flipped (see op.py).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from .._backends import triton_interpreting

# The interpreter multiplies bfloat16 dot operands as raw integers (triton-lang/triton#11584, "not
# supported yet"), so under TRITON_INTERPRET the kernels cast 16-bit operands to float32 before tl.dot.
_UPCAST_DOT = triton_interpreting()
TMA_ENV_VAR = "SPECDEC_TRITON_TMA"  # "0" switches the TMA path off (for comparisons and debugging)
AUTOTUNE_ENV_VAR = "SPECDEC_TRITON_AUTOTUNE"  # "0": no tuning, the first config that fits is used
FLATTEN_ENV_VAR = "SPECDEC_TRITON_FLATTEN"  # "0" drops the flattened-loop configs (a Triton that cannot)
# Set when the TMA kernel failed to compile or launch (a Triton build that cannot lower it): from then on
# the pointer-load path is used, after one warning.
_TMA_FAILURE: str | None = None


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _processors(device: torch.device) -> int:
    """SMs of the GPU; under the interpreter a small number, so that every program walks several tiles."""
    return _num_sms(device.index or 0) if device.type == "cuda" else 3


def _set_descriptor_blocks(nargs: dict) -> None:
    """Autotune pre-hook: TMA descriptors carry their block shape, which must match the config."""
    if not nargs["USE_TMA"]:
        return
    bm, bn, bk = nargs["BM"], nargs["BN"], nargs["BK"]
    nargs["x_desc"].block_shape = [bm, bk]
    nargs["w_desc"].block_shape = [1, bn, bk] if nargs["TRANS_W"] else [1, bk, bn]


# (BM, BN, BK, warps, stages, programs per SM): Hopper-sized tiles for 16-bit inputs first, then tiles
# small enough for two resident programs per SM (one's epilogue hides behind the other's main loop),
# then small ones for fp32 and decode-sized groups. Shared memory per program is
# stages * (BM + BN) * BK * element bytes (the prune below drops what does not fit).
FORWARD_TILES = [
    (128, 256, 64, 8, 3, 1),
    (128, 256, 64, 8, 4, 1),
    (128, 128, 64, 8, 4, 1),
    (128, 128, 128, 8, 3, 1),
    (128, 128, 64, 8, 3, 2),
    (64, 256, 64, 4, 4, 1),
    (64, 128, 64, 4, 4, 2),
    (64, 64, 32, 4, 3, 2),
]


def _config(bm, bn, bk, warps, stages, per_sm, *, use_tma: bool, flatten: bool, group_m: int = 8):
    kwargs = {"BM": bm, "BN": bn, "BK": bk, "GROUP_M": group_m, "PROGRAMS_PER_SM": per_sm}
    kwargs.update(USE_TMA=use_tma, FLATTEN=flatten)
    return triton.Config(kwargs, num_warps=warps, num_stages=stages, pre_hook=_set_descriptor_blocks)


def _forward_configs() -> list[triton.Config]:
    if triton_interpreting():  # small tiles keep the interpreter quick; the prune keeps one, so no tuning
        return [
            _config(16, 16, 16, 4, 1, 1, use_tma=tma, flatten=flatten, group_m=2)
            for tma in (True, False)
            for flatten in (True, False)
        ]
    return [
        _config(*tile, use_tma=tma, flatten=flatten)
        for tile in FORWARD_TILES
        for tma in (True, False)
        for flatten in (True, False)
    ]


def _prune_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop configs that cannot run here: pipelined tiles over the shared-memory budget (fp32 tiles are
    twice as big), TMA configs when the operands have no descriptors, flattened loops when switched
    off; keep only the first that is left when SPECDEC_TRITON_AUTOTUNE=0 (and under the interpreter)."""
    elem = named_args["x_ptr"].element_size()
    tma_ok = bool(named_args["TMA_OK"])
    flatten_ok = os.environ.get(FLATTEN_ENV_VAR, "1") != "0"
    runnable = [
        c for c in configs if (tma_ok or not c.kwargs["USE_TMA"]) and (flatten_ok or not c.kwargs["FLATTEN"])
    ]
    fits = [
        c
        for c in runnable
        if c.num_stages * (c.kwargs["BM"] + c.kwargs["BN"]) * c.kwargs["BK"] * elem <= 200 * 1024
    ] or runnable[-1:]
    one = os.environ.get(AUTOTUNE_ENV_VAR, "1") == "0" or triton_interpreting()
    return fits[:1] if one else fits


def _tune_bench(kernel_call, quantiles):
    """Shorter timing than Triton's default (25 ms warm-up, 100 ms of repeats) per candidate: with 32
    candidates per tuning key, tuning would otherwise cost seconds per new problem shape."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


def _autotune(**kwargs):
    try:
        return triton.autotune(**kwargs, do_bench=_tune_bench)
    except TypeError:  # a Triton without the do_bench argument: its default timing
        return triton.autotune(**kwargs)


@_autotune(
    configs=_forward_configs(),
    key=["N", "K", "ROWS_BUCKET", "TRANS_W", "TMA_OK"],  # (+ the dtypes of the tensor arguments)
    prune_configs_by={"early_config_prune": _prune_configs},
)
@triton.jit(do_not_specialize=["ROWS_BUCKET", "TMA_OK"])
def grouped_gemm_forward_kernel(
    # tensors: x [M, K]; w [E, K, N] (or [E, N, K] when TRANS_W); y [M, N]; group sizes [E]
    x_ptr,
    w_ptr,
    y_ptr,
    group_sizes_ptr,
    # TMA descriptors over x [M, K] and w (3-D) when TMA_OK; None otherwise
    x_desc,
    w_desc,
    # problem sizes
    N,
    K,
    E,
    # strides (elements); the last dim of every tensor is contiguous
    stride_xm,
    stride_we,
    stride_wk,
    stride_wn,
    stride_ym,
    # autotune key only: log2 bucket of rows per group (decode-sized vs prefill-sized problems), and
    # whether descriptors were passed (configs with USE_TMA are pruned without them)
    ROWS_BUCKET,
    TMA_OK,
    # compile-time switches
    TRANS_W: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    E_PAD: tl.constexpr,
    # tile shape and loop structure (from the autotune config)
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr,  # read by the launch grid only
    USE_TMA: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    # ---- the tile schedule: prefix sums over the E groups, in registers
    e_idx = tl.arange(0, E_PAD)
    sizes_E = tl.load(group_sizes_ptr + e_idx, mask=e_idx < E, other=0).to(tl.int32)
    n_tiles = tl.cdiv(N, BN)
    tiles_E = tl.cdiv(sizes_E, BM) * n_tiles
    tiles_end_E = tl.cumsum(tiles_E, axis=0)
    total_tiles = tl.max(tiles_end_E, axis=0)

    for tile in tl.range(tl.program_id(0), total_tiles, tl.num_programs(0), flatten=FLATTEN):
        # ---- which group, and where this tile sits inside it
        group = tl.sum((tiles_end_E <= tile).to(tl.int32), axis=0)
        before = e_idx < group
        first_tile = tl.max(tl.where(before, tiles_end_E, 0), axis=0)
        row_start = tl.sum(tl.where(before, sizes_E, 0), axis=0)
        rows = tl.sum(tl.where(e_idx == group, sizes_E, 0), axis=0)
        local = tile - first_tile
        m_tiles = tl.cdiv(rows, BM)
        band = GROUP_M * n_tiles  # GROUP_M row tiles x all column tiles, for L2 reuse
        first_m = (local // band) * GROUP_M
        band_m = tl.minimum(m_tiles - first_m, GROUP_M)
        pid_m = first_m + (local % band) % band_m
        pid_n = (local % band) // band_m

        offs_m = pid_m * BM + tl.arange(0, BM)  # row inside the group
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        row_mask = offs_m < rows
        x_rows = (row_start + offs_m).to(tl.int64)
        w_base = w_ptr + group.to(tl.int64) * stride_we

        # ---- main loop over K, float32 accumulator
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            if USE_TMA:
                a = x_desc.load([row_start + pid_m * BM, k0])
                if TRANS_W:
                    b = w_desc.load([group, pid_n * BN, k0]).reshape(BN, BK).trans()
                else:
                    b = w_desc.load([group, k0, pid_n * BN]).reshape(BK, BN)
            else:
                k_mask = (k0 + offs_k) < K
                a = tl.load(
                    x_ptr + x_rows[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )
                b = tl.load(
                    w_base + (k0 + offs_k)[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=k_mask[:, None] & (offs_n[None, :] < N),
                    other=0.0,
                )
            if UPCAST_DOT:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

        # ---- epilogue: masked store of the rows that belong to this group
        y_ptrs = y_ptr + x_rows[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & (offs_n[None, :] < N))


@triton.jit
def grouped_gemm_wgrad_kernel(
    # tensors: x [M, K]; dy [M, N]; dw [E, K, N]; group sizes [E]
    x_ptr,
    dy_ptr,
    dw_ptr,
    group_sizes_ptr,
    # problem sizes
    N,
    K,
    E,
    # strides (elements); the last dim of every tensor is contiguous
    stride_xm,
    stride_dym,
    stride_dwe,
    stride_dwk,
    # compile-time switches
    UPCAST_DOT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    E_PAD: tl.constexpr,
    # tile shape: BK x BN output tile, reduced over BM rows at a time
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    # ---- which (expert, k-tile, n-tile) this program owns
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, BK)
    n_tiles = tl.cdiv(N, BN)
    group = pid // (k_tiles * n_tiles)
    pid_k = (pid // n_tiles) % k_tiles
    pid_n = pid % n_tiles

    e_idx = tl.arange(0, E_PAD)
    sizes_E = tl.load(group_sizes_ptr + e_idx, mask=e_idx < E, other=0).to(tl.int32)
    row_start = tl.sum(tl.where(e_idx < group, sizes_E, 0), axis=0)
    rows = tl.sum(tl.where(e_idx == group, sizes_E, 0), axis=0)

    offs_k = pid_k * BK + tl.arange(0, BK)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    k_mask = offs_k < K
    n_mask = offs_n < N

    # ---- reduce over the group's rows; an empty group leaves the accumulator at zero
    acc = tl.zeros((BK, BN), dtype=tl.float32)
    for m0 in range(0, rows, BM):
        row_mask = (m0 + offs_m) < rows
        r = (row_start + m0 + offs_m).to(tl.int64)
        x_t = tl.load(
            x_ptr + r[None, :] * stride_xm + offs_k[:, None],
            mask=k_mask[:, None] & row_mask[None, :],
            other=0.0,
        )  # [BK, BM]: x_g^T read in place
        dy = tl.load(
            dy_ptr + r[:, None] * stride_dym + offs_n[None, :],
            mask=row_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        if UPCAST_DOT:
            x_t = x_t.to(tl.float32)
            dy = dy.to(tl.float32)
        acc = tl.dot(x_t, dy, acc, input_precision=INPUT_PRECISION)

    dw_ptrs = dw_ptr + group.to(tl.int64) * stride_dwe + offs_k[:, None] * stride_dwk + offs_n[None, :]
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])


# --------------------------------------------------------------------------- wrappers
def _empty(like: Tensor, *shape: int) -> Tensor:
    """Uninitialised output (tests replace this to poison outputs and catch unwritten elements)."""
    return like.new_empty(shape)


def _input_precision(dtype: torch.dtype) -> str:
    """Full fp32 products unless the user allowed TF32 matmuls in torch (same contract as torch.mm)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _tma_ok(x_MK: Tensor, w: Tensor) -> bool:
    """Whether TMA descriptors can describe x and w: Hopper (or the interpreter) and 16-byte strides."""
    if os.environ.get(TMA_ENV_VAR, "1") == "0" or _TMA_FAILURE is not None:
        return False
    if x_MK.device.type == "cuda" and torch.cuda.get_device_capability(x_MK.device)[0] < 9:
        return False
    elem = x_MK.element_size()
    strides_ok = all((s * elem) % 16 == 0 for s in (x_MK.stride(0), w.stride(0), w.stride(1)))
    bases_ok = x_MK.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
    return strides_ok and bases_ok and x_MK.shape[0] > 0 and min(w.shape) > 0


def grouped_gemm_triton(x_MK: Tensor, w: Tensor, group_sizes_E: Tensor, trans_w: bool) -> Tensor:
    """Launch the forward kernel: y_MN = x_g @ w[e] (w [E, K, N]) or x_g @ w[e]^T (w [E, N, K])."""
    num_rows = x_MK.shape[0]
    n = w.shape[1] if trans_w else w.shape[2]
    y_MN = _empty(x_MK, num_rows, n)
    if num_rows == 0 or n == 0:
        return y_MN
    if _tma_ok(x_MK, w):
        try:
            _launch_forward(x_MK, w, y_MN, group_sizes_E, trans_w, use_tma=True)
            return y_MN
        except Exception as err:  # a Triton build that cannot lower this TMA kernel: keep working without
            global _TMA_FAILURE
            _TMA_FAILURE = f"{type(err).__name__}: {err}"
            message = f"Triton grouped GEMM: TMA path failed, using pointer loads ({_TMA_FAILURE[:500]})"
            warnings.warn(message, stacklevel=2)
    _launch_forward(x_MK, w, y_MN, group_sizes_E, trans_w, use_tma=False)
    return y_MN


def grouped_gemm_triton_config(
    x_MK: Tensor, w: Tensor, group_sizes_E: Tensor, trans_w: bool, config: triton.Config
) -> Tensor:
    """The forward kernel with one given config instead of the autotuned one (for checking every
    candidate of the autotuner, and for sweeps). A config with USE_TMA needs TMA-ready operands."""
    if config.kwargs["USE_TMA"] and not _tma_ok(x_MK, w):
        raise ValueError("config uses TMA but x_MK / w cannot be described by TMA descriptors here")
    n = w.shape[1] if trans_w else w.shape[2]
    y_MN = _empty(x_MK, x_MK.shape[0], n)
    if x_MK.shape[0] and n:
        _launch_forward(
            x_MK, w, y_MN, group_sizes_E, trans_w, use_tma=config.kwargs["USE_TMA"], config=config
        )
    return y_MN


def _launch_forward(
    x_MK: Tensor,
    w: Tensor,
    y_MN: Tensor,
    group_sizes_E: Tensor,
    trans_w: bool,
    *,
    use_tma: bool,
    config: triton.Config | None = None,
) -> None:
    num_rows, k = x_MK.shape
    num_experts, n = w.shape[0], y_MN.shape[1]
    # strides of w as seen by the kernel: element (e, k, n) of the [E, K, N] operand
    stride_wk, stride_wn = (w.stride(2), w.stride(1)) if trans_w else (w.stride(1), w.stride(2))
    x_desc = w_desc = None
    if use_tma:  # block shapes are placeholders; the autotune pre-hook sets them per config
        x_desc = TensorDescriptor.from_tensor(x_MK, [32, 32])
        w_desc = TensorDescriptor.from_tensor(w, [1, 32, 32])
    rows_per_group = max(1, num_rows // num_experts)
    processors = _processors(x_MK.device)

    def grid(meta: dict) -> tuple[int]:
        # an upper bound on the number of tiles, without reading the group sizes back to the host
        bound = (triton.cdiv(num_rows, meta["BM"]) + num_experts) * triton.cdiv(n, meta["BN"])
        return (max(1, min(processors * meta["PROGRAMS_PER_SM"], bound)),)

    kernel, fixed = grouped_gemm_forward_kernel, {}
    if config is not None:  # bypass the autotuner: its pre-hook, then the JIT function with this config
        kernel, fixed = grouped_gemm_forward_kernel.fn, config.all_kwargs()
        config.pre_hook({"x_desc": x_desc, "w_desc": w_desc, "TRANS_W": trans_w, **config.kwargs})
    kernel[grid](
        x_MK,
        w,
        y_MN,
        group_sizes_E,
        x_desc,
        w_desc,
        n,
        k,
        num_experts,
        x_MK.stride(0),
        w.stride(0),
        stride_wk,
        stride_wn,
        y_MN.stride(0),
        min(rows_per_group.bit_length(), 8),
        int(use_tma),
        TRANS_W=trans_w,
        UPCAST_DOT=_UPCAST_DOT and x_MK.dtype != torch.float32,
        INPUT_PRECISION=_input_precision(x_MK.dtype),
        E_PAD=triton.next_power_of_2(num_experts),
        **fixed,
    )


def grouped_gemm_weight_grad_triton(x_MK: Tensor, dy_MN: Tensor, group_sizes_E: Tensor) -> Tensor:
    """Launch the dW kernel: dw[e] = x_g^T @ dy_g, zeros for empty groups."""
    k, n = x_MK.shape[1], dy_MN.shape[1]
    num_experts = group_sizes_E.shape[0]
    dw_EKN = _empty(x_MK, num_experts, k, n)
    if k == 0 or n == 0:
        return dw_EKN
    if triton_interpreting():
        bm, bn, bk, warps, stages = 16, 16, 16, 4, 1
    elif x_MK.dtype == torch.float32:
        bm, bn, bk, warps, stages = 32, 64, 64, 4, 3
    else:
        bm, bn, bk, warps, stages = 64, 128, 128, 8, 3
    grid = (num_experts * triton.cdiv(k, bk) * triton.cdiv(n, bn),)
    grouped_gemm_wgrad_kernel[grid](
        x_MK,
        dy_MN,
        dw_EKN,
        group_sizes_E,
        n,
        k,
        num_experts,
        x_MK.stride(0),
        dy_MN.stride(0),
        dw_EKN.stride(0),
        dw_EKN.stride(1),
        UPCAST_DOT=_UPCAST_DOT and x_MK.dtype != torch.float32,
        INPUT_PRECISION=_input_precision(x_MK.dtype),
        E_PAD=triton.next_power_of_2(num_experts),
        BM=bm,
        BN=bn,
        BK=bk,
        num_warps=warps,
        num_stages=stages,
    )
    return dw_EKN
