"""A block-scaled FP8 (W8A8) linear layer of one row or a few: `w8a8_block_fp8_linear` at decode
sizes, with the e4m3 weight streamed as `gemv.py` streams a 16-bit one.

At one token a layer reads its whole weight for two FLOPs a weight element, so FP8 weights halve
its time only where the launch and the loads' latency do not dominate. The GEMM of `fp8_gemm.py`
walks K one k-block (bk channels) at a time through 16-row tensor-core tiles and pays the loads'
latency at every step; here, as in `gemv.py`, a program asks for all of its weight at once and
sums on the CUDA cores:

    program p:  w   = W[p*BLOCK_N : (p+1)*BLOCK_N, :] as [BLOCK_N, BLOCK_G, bk]   e4m3, one load
                b_s = the weight scales of those rows' blocks, [BLOCK_N, BLOCK_G]
                for each row m of x (at most GEMV_MAX_ROWS):
                    x_q, x_s = x[m] quantized per bk-wide group, as `quantize_groups` does it
                    y[m, cols] = sum_j x_s[j] * b_s[:, j] * sum_{k in j} x_q[k] * w[:, k]

so the activations' quantization, the scales and the rounding are those of
`w8a8_block_fp8_linear` (x_q and x_s bit for bit; the e4m3 products are exact in fp32, and only
the order of the fp32 sums differs). Rows with more groups than MAX_BLOCK_K channels hold loop
over them in chunks. With a static input scale (`input_scale`) every group's x_s is that scale.

Launched by `fp8_gemm.w8a8_block_fp8_linear` for steps of up to GEMV_MAX_ROWS rows with
`TILELLM_GEMV=1` (`gemv.gemv_runs`), the switch of `gemv.py`'s kernels: opt-in until the engine's
steps with them are measured on a GPU. Its PyTorch twin is
`reference.fp8_gemm.w8a8_block_fp8_linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilellm.kernels.config import cdiv, interpreting, next_power_of_2
from tilellm.kernels.fp8 import quantize_groups, to_fp8
from tilellm.kernels.gemv import GEMV_MAX_ROWS, gemv_opted_in
from tilellm.kernels.launch import FastLaunch
from tilellm.kernels.pdl import pdl_launch_kwargs, pdl_start

# A program's tile: BLOCK_N weight rows (1 to MAX_BLOCK_N) of BLOCK_G groups of bk channels (the
# row's groups padded to a power of two, at most MAX_BLOCK_K channels), BLOCK_N * BLOCK_G * bk of
# at most TILE_ELEMENTS: the byte count of `gemv.py`'s 16-bit tiles, in e4m3. Not yet swept on a
# GPU.
TILE_ELEMENTS = 16384
MAX_BLOCK_K = 16384
MAX_BLOCK_N = 4
NUM_WARPS = 8


def fp8_gemv_runs(M: int, bk: int) -> bool:
    """Whether `w8a8_block_fp8_linear`'s steps of M rows in groups of bk run this kernel:
    `TILELLM_GEMV=1`, at most GEMV_MAX_ROWS rows and bk a power of two."""
    return 0 < M <= GEMV_MAX_ROWS and bk > 0 and bk & (bk - 1) == 0 and gemv_opted_in()


def fp8_gemv_tile(M: int, K: int, bk: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_G, g_tiles) for M rows of x against weight rows of K channels in
    groups of bk: BLOCK_M = M padded to a power of two, BLOCK_G groups a chunk (g_tiles chunks a
    row) and BLOCK_N weight rows a program."""
    groups = max(1, K // bk)
    block_g = min(max(1, MAX_BLOCK_K // bk), next_power_of_2(groups))
    block_n = max(1, min(MAX_BLOCK_N, TILE_ELEMENTS // (block_g * bk)))
    return next_power_of_2(max(M, 1)), block_n, block_g, cdiv(groups, block_g)


@triton.jit
def _row_product(
    X, As, m, M, stride_xm, ks, g_ok, w, b_s, eps, STATIC_A: tl.constexpr
):  # fmt: skip
    """Row m of x against the tile: x[m, ks] ([BLOCK_G, GROUP_K] channels, groups past K off)
    quantized as `fp8_gemm`'s kernels quantize it, times w [BLOCK_N, BLOCK_G, GROUP_K] (fp32 of
    the e4m3 values) scaled per group by x_s * b_s [BLOCK_N, BLOCK_G]: [BLOCK_N] fp32."""
    ok = g_ok[:, None] & (ks * 0 + m < M)
    x = tl.load(X + m * stride_xm + ks, mask=ok, other=0.0).to(tl.float32)
    if STATIC_A:  # the calibrated scale for every group
        a_s = tl.load(As)
        x_q = to_fp8(tl.div_rn(x, a_s))
        group_sums = tl.sum(w * x_q.to(tl.float32)[None, :, :], axis=2)
        return tl.sum(group_sums * (a_s * b_s), axis=1)
    x_q, a_s = quantize_groups(x, eps)  # groups past K: x = 0, so x_q = 0
    group_sums = tl.sum(w * x_q.to(tl.float32)[None, :, :], axis=2)
    return tl.sum(group_sums * (a_s[None, :] * b_s), axis=1)


@triton.jit(do_not_specialize=["M", "eps"])
def _fp8_gemv_kernel(
    X, W, Bs, As, Y, M, N, K, eps,
    stride_xm, stride_wn, stride_bs_n, stride_bs_k, stride_ym,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr, G_TILES: tl.constexpr, STATIC_A: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Y[rows, cols] for this program's BLOCK_N columns and every row of x (module docstring);
    W [N, K] e4m3, Bs [ceil(N / GROUP_N), K / GROUP_K] fp32, As the static scale (STATIC_A)."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    gs = tl.arange(0, BLOCK_G)
    ks = gs[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]  # [BLOCK_G, GROUP_K]
    w_rows = W + cols.to(tl.int64)[:, None, None] * stride_wn
    bs_rows = Bs + (cols // GROUP_N).to(tl.int64)[:, None] * stride_bs_n
    rows = tl.arange(0, BLOCK_M)
    num_groups = K // GROUP_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if G_TILES == 1:
        g_ok = gs < num_groups
        # the weight and its scales first: no kernel writes them, so their loads may start before
        # the wait for the kernel before (PDL), and they are in flight while x is read
        w = tl.load(w_rows + ks[None, :, :], mask=col_ok[:, None, None] & g_ok[None, :, None], other=0.0)
        b_s = tl.load(bs_rows + gs[None, :] * stride_bs_k, mask=col_ok[:, None] & g_ok[None, :], other=0.0)
        pdl_start(USE_PDL)
        w = w.to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            y = _row_product(X, As, m, M, stride_xm, ks, g_ok, w, b_s, eps, STATIC_A)
            acc = tl.where(rows[:, None] == m, y[None, :], acc)
    else:  # rows of more than MAX_BLOCK_K channels: chunks of BLOCK_G groups
        pdl_start(USE_PDL)
        for g0 in range(0, G_TILES * BLOCK_G, BLOCK_G):
            g_ok = (g0 + gs) < num_groups
            w = tl.load(
                w_rows + g0 * GROUP_K + ks[None, :, :],
                mask=col_ok[:, None, None] & g_ok[None, :, None],
                other=0.0,
            ).to(tl.float32)
            b_s = tl.load(
                bs_rows + (g0 + gs)[None, :] * stride_bs_k, mask=col_ok[:, None] & g_ok[None, :], other=0.0
            )
            for m in tl.static_range(BLOCK_M):
                y = _row_product(X + g0 * GROUP_K, As, m, M, stride_xm, ks, g_ok, w, b_s, eps, STATIC_A)
                acc += tl.where(rows[:, None] == m, y[None, :], 0.0)
    y_ok = (rows < M)[:, None] & col_ok[None, :]
    tl.store(
        Y + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty), mask=y_ok
    )


_fp8_gemv_launch = FastLaunch(_fp8_gemv_kernel)


def launch_fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    y: torch.Tensor,
    eps: float,
    input_scale: torch.Tensor | None = None,
) -> None:
    """Fill y [M, N] with `w8a8_block_fp8_linear(x, weight, weight_scale_inv, block_size)` for M
    of 1 to GEMV_MAX_ROWS rows: `fp8_gemm.py`'s launch for those rows, its arguments
    checked there. x [M, K] with a unit last-dim stride, weight [N, K] e4m3 with a unit last-dim
    stride, weight_scale_inv [ceil(N / bn), K / bk] fp32, bk a power of two; `input_scale`: the
    static activation scale (one fp32 element), else per token and group."""
    (M, K), N = x.shape, weight.shape[0]
    bn, bk = block_size
    block_m, block_n, block_g, g_tiles = fp8_gemv_tile(M, K, bk)
    scale = input_scale if input_scale is not None else weight_scale_inv  # (unread without)
    _fp8_gemv_launch[(cdiv(N, block_n),)](
        x, weight, weight_scale_inv, scale, y, M, N, K, float(eps),
        x.stride(0), weight.stride(0), weight_scale_inv.stride(0), weight_scale_inv.stride(1), y.stride(0),
        GROUP_N=bn, GROUP_K=bk, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_G=block_g, G_TILES=g_tiles,
        STATIC_A=input_scale is not None, num_warps=1 if interpreting() else NUM_WARPS, num_stages=1,
        **pdl_launch_kwargs(x.device),
    )  # fmt: skip
