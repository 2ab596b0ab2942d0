"""A linear layer of one row (decode of one sequence) or a few: y = x W^T with the weight streamed
at the copy rate, and the RMSNorm before it or the SiLU-and-mul after it in the same launch.

At one token a layer reads its whole weight for two FLOPs a weight element: its time is the
weight's bytes plus a fixed cost (the launch, the first loads' latency, the last program's
tail). A GEMM of 16-row tensor-core tiles walking K in a pipelined loop pays that latency once per
loop stage; here every program asks for all of its weight at once:

    program p:  w = W[p*BLOCK_N : (p+1)*BLOCK_N, :]        one load of [BLOCK_N, BLOCK_K] (K padded
                                                           to a power of two, the pad masked off)
                x = the input row [BLOCK_K]                (normalised first with NORM)
                y[p*BLOCK_N + j] = sum_k w[j, k] * x[k]     in fp32, rounded once (+ bias first)

Narrow programs (1-4 weight rows, 32-64 KB of weight) put many loads in flight on every SM at
once; the weight is loaded before x, so with NORM the input's loads and the row's mean square run
while the weight's bytes arrive. On an H100 a scratch prototype of this kernel ran Qwen3-0.6B's
layers at 3.9-6.5 us against 6.1-8.0 for cuBLAS, and the norm or the activation in the same
launch saves that launch (docs/benchmarks.md, "One-row linear layers"; the committed kernels are
not yet timed there).

With NORM, x is replaced by `fused.rms_norm`'s output as its kernel computes it: h = x (+ the
residual, rounded to x's dtype as an unfused add; program 0 stores h to RO), then
h * rsqrt(mean(h^2) + eps) * norm_weight rounded to x's dtype. With GATED, W holds 2N rows
[gate | up] and each program computes its columns of both products, rounded to y's dtype as this
kernel stores them, then silu(gate) * up as `fused.silu_and_mul` does. The tile depends on K
alone, so a column's sum runs in the same order whatever N is: the gated launch gives the bits
of the plain one followed by `silu_and_mul` (with NORM the launch has fewer warps, so its sums may
round differently from the plain launch's on the normalised row).

Steps of 2 to GEMV_MAX_ROWS rows run `_gemv_rows_kernel`, the same with each weight tile
multiplied by every row at once (a [BLOCK_M, BLOCK_N, BLOCK_K] product summed over K), so that
the rows share one pass over the weight.

The wrappers are `skinny.py`'s (`skinny_linear`, `skinny_linear_silu_and_mul`,
`skinny_rms_norm_linear`), which send their 16-bit calls of up to GEMV_MAX_ROWS rows here
(`launch_gemv`) up to `gemv_max_rows` rows: one on a CUDA device, unless `TILELLM_GEMV` says
otherwise. Its PyTorch twin is `F.linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilellm.kernels.config import cdiv, env_flag, interpreting, next_power_of_2
from tilellm.kernels.launch import FastLaunch
from tilellm.kernels.pdl import pdl_launch_kwargs, pdl_start

# A program's tile: [BLOCK_N, BLOCK_K] with BLOCK_K = K padded to a power of two (at most
# MAX_BLOCK_K; longer rows loop over K) and BLOCK_N = TILE_ELEMENTS // BLOCK_K rows, 1 to 4.
# Swept on an H100 over Qwen3-0.6B's layers (1-32 weight rows a program, 2-16 warps): 1-4 rows of
# 8 warps were within 3% of each other and the fastest; 8 or more rows, or 2-4 warps, slower. With the
# RMSNorm prologue 4 warps were faster (its row sum crosses fewer warps): 5.4 against 5.7 us on qkv.
TILE_ELEMENTS = 8192
MAX_BLOCK_K = 16384
MAX_BLOCK_N = 4
NUM_WARPS = 8
NUM_WARPS_NORM = 4
GEMV_DTYPES = (torch.float16, torch.bfloat16)
# Steps of 2 to GEMV_MAX_ROWS rows run the rows kernel: each program multiplies its weight tile by
# every row at once, a [BLOCK_M, BLOCK_N, BLOCK_K] product of at most ROWS_PRODUCT_ELEMENTS (64
# fp32 values a thread at 8 warps), so the rows share one pass over the weight. Timed in the
# engine at 8 rows, it is compute-bound and slower than cuBLAS (docs/benchmarks.md, "One-row
# linear layers"): only `TILELLM_GEMV=1` runs it.
GEMV_MAX_ROWS = 8
ROWS_PRODUCT_ELEMENTS = 16384
# Column tiles a program of the rows kernel takes one after the other, reading x (and normalising
# it) once for them all: at 8 rows of 1024 a [2, 1024] weight tile is 4 KB against x's 16 KB, so
# with one tile a program the programs read 4x the weight's bytes of x from L2. Not yet swept.
ROWS_N_TILES = 1

# TILELLM_GEMV: unset, these kernels (and `fp8_gemv.py`'s) run the one-row steps of a CUDA device:
# measured on an H100 (docs/benchmarks.md, "One-row linear layers"), Qwen3-0.6B's shape decodes a
# step at batch 1 in 1.00 ms with them against 1.39 ms without, while at batch 8 the rows kernel
# takes 2.98 ms against cuBLAS's 1.51-1.85. "1": also steps of 2 to GEMV_MAX_ROWS rows, on any
# device (to measure and test them); "0": never; any other value: as unset.
DEFAULT_GEMV_ROWS = 1
_gemv_all = env_flag("TILELLM_GEMV", "1")
_gemv_off = env_flag("TILELLM_GEMV", "0")


def gemv_max_rows(device: torch.device) -> int:
    """The most rows of a step these kernels (and `fp8_gemv.py`'s) run on `device`:
    GEMV_MAX_ROWS with `TILELLM_GEMV=1`, none with `TILELLM_GEMV=0`, else DEFAULT_GEMV_ROWS on a
    CUDA device and none elsewhere."""
    if _gemv_all():
        return GEMV_MAX_ROWS
    if _gemv_off():
        return 0
    return DEFAULT_GEMV_ROWS if device.type == "cuda" else 0


def gemv_runs(M: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `skinny.py`'s calls of M rows in `dtype` on `device` run these kernels: up to
    `gemv_max_rows(device)` rows in a 16-bit dtype (else `skinny.py`'s own kernel runs them)."""
    return 0 < M <= gemv_max_rows(device) and dtype in GEMV_DTYPES


def gemv_enabled(device: torch.device, M: int, dtype: torch.dtype) -> bool:
    """Whether linear layers' steps of M rows in `dtype` on `device` run these kernels rather than
    cuBLAS: a CUDA device and `gemv_runs(M, dtype, device)`."""
    return device.type == "cuda" and gemv_runs(M, dtype, device)


def gemv_tile(M: int, K: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, k_tiles) for M rows of x against weight rows of K: one row,
    BLOCK_K the power of two that holds K (at most MAX_BLOCK_K) and 1-4 weight rows of
    TILE_ELEMENTS; more rows, BLOCK_M = M padded to a power of two, and the product's
    [BLOCK_M, BLOCK_N, BLOCK_K] within ROWS_PRODUCT_ELEMENTS (K split into k_tiles steps where a
    row does not fit). The same tiles under the interpreter."""
    block_m = next_power_of_2(max(M, 1))
    if block_m == 1:
        block_k = min(MAX_BLOCK_K, next_power_of_2(max(K, 1)))
        block_n = max(1, min(MAX_BLOCK_N, TILE_ELEMENTS // block_k))
    else:
        block_k = min(ROWS_PRODUCT_ELEMENTS // block_m, next_power_of_2(max(K, 1)))
        block_n = max(1, min(MAX_BLOCK_N, ROWS_PRODUCT_ELEMENTS // (block_m * block_k)))
    return block_m, block_n, block_k, cdiv(K, block_k)


def gemv_fuses_norm(M: int, K: int) -> bool:
    """Whether the RMSNorm before a layer runs in its launch at M rows of K: the whole row in one
    tile (the norm needs the row's mean square before any product)."""
    return gemv_tile(M, K)[3] == 1


@triton.jit
def rounded_silu_and_mul(acc, acc_up, Y):
    """silu(gate) * up in fp32 from a gated layer's two fp32 products, each first rounded to Y's
    dtype as the plain layer would store it: what `fused.silu_and_mul` computes from the stored
    [gate | up], so the gated launch gives the bits of the two launches."""
    gate = acc.to(Y.dtype.element_ty).to(tl.float32)
    up = acc_up.to(Y.dtype.element_ty).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _weight_tiles(w_rows, u_rows, col_ok, k_cols, k_ok, EVEN_N: tl.constexpr, GATED: tl.constexpr):
    """The program's weight rows at columns `k_cols` [BLOCK_K] of K: (gate, up) [BLOCK_N, BLOCK_K]
    in the weight's dtype, 0 past N and K; with GATED the up rows (`u_rows`), else the gate rows
    twice (the second unused)."""
    ok = k_ok[None, :] if EVEN_N else col_ok[:, None] & k_ok[None, :]
    w = tl.load(w_rows + k_cols[None, :], mask=ok, other=0.0)
    if GATED:
        return w, tl.load(u_rows + k_cols[None, :], mask=ok, other=0.0)
    return w, w


@triton.jit
def input_row(X, R, NW, RO, ks, k_ok, K, eps, pid, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The product's input [BLOCK_K] in fp32, 0 past K: x as stored, or with NORM its RMSNorm
    (`fused._normed_rows` then the rounding of `rms_norm`'s store; with HAS_RESIDUAL x + R first,
    rounded to x's dtype and stored to RO by program 0)."""
    x = tl.load(X + ks, mask=k_ok, other=0.0)
    if NORM:
        nw = tl.load(NW + ks, mask=k_ok, other=0.0).to(tl.float32)
        h = x.to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(R + ks, mask=k_ok, other=0.0)
            s = (h + r.to(tl.float32)).to(RO.dtype.element_ty)
            tl.store(RO + ks, s, mask=k_ok & (ks * 0 + pid == 0))
            h = s.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / K + eps)
        return (h * rstd * nw).to(X.dtype.element_ty).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _gemv_kernel(
    X, W, B, Y, N, K, stride_wn,
    NW, R, RO, eps,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
    EVEN_N: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Y[0, cols] = X[0] W[cols]^T (module docstring) for this program's BLOCK_N columns; W [N, K]
    (GATED: [2N, K], the up rows N below the gate rows). K_TILES > 1 only without NORM."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_rows = W + cols.to(tl.int64)[:, None] * stride_wn
    u_rows = W + (cols + N).to(tl.int64)[:, None] * stride_wn
    if K_TILES == 1:
        k_ok = ks < K
        # the weight first: no kernel writes it, so its loads may start before the wait for the
        # kernel before (PDL), and they are in flight while x is read and normalised
        w, u = _weight_tiles(w_rows, u_rows, col_ok, ks, k_ok, EVEN_N, GATED)
        pdl_start(USE_PDL)
        x = input_row(X, R, NW, RO, ks, k_ok, K, eps, pid, NORM, HAS_RESIDUAL)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if GATED:
            acc_up = tl.sum(u.to(tl.float32) * x[None, :], axis=1)
    else:  # rows longer than MAX_BLOCK_K: large layers, where the loop's latency weighs little
        pdl_start(USE_PDL)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=2):
            k_ok = (k0 + ks) < K
            x = tl.load(X + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            w, u = _weight_tiles(w_rows, u_rows, col_ok, k0 + ks, k_ok, EVEN_N, GATED)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
            if GATED:
                acc_up += tl.sum(u.to(tl.float32) * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
        if GATED:
            acc_up += tl.load(B + N + cols, mask=col_ok, other=0.0).to(tl.float32)
    if GATED:
        acc = rounded_silu_and_mul(acc, acc_up, Y)
    tl.store(Y + cols, acc.to(Y.dtype.element_ty), mask=col_ok)


_gemv_launch = FastLaunch(_gemv_kernel)


@triton.jit
def _input_rows(
    X, R, NW, RO, rows64, row_ok, ks, k_ok, K, eps, pid, stride_xm, stride_rm, stride_om,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """`input_row` for the rows `rows64` [BLOCK_M] (int64): [BLOCK_M, BLOCK_K] fp32, 0 past M
    and K."""
    ok = row_ok[:, None] & k_ok[None, :]
    x = tl.load(X + rows64[:, None] * stride_xm + ks[None, :], mask=ok, other=0.0)
    if NORM:
        nw = tl.load(NW + ks, mask=k_ok, other=0.0).to(tl.float32)
        h = x.to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(R + rows64[:, None] * stride_rm + ks[None, :], mask=ok, other=0.0)
            s = (h + r.to(tl.float32)).to(RO.dtype.element_ty)
            first = (rows64 * 0 + pid == 0)[:, None]
            tl.store(RO + rows64[:, None] * stride_om + ks[None, :], s, mask=ok & first)
            h = s.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / K + eps)
        return (h * rstd[:, None] * nw[None, :]).to(X.dtype.element_ty).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def store_rows(
    acc, acc_up, B, Y, cols, col_ok, N, rows64, row_ok, stride_ym, HAS_BIAS: tl.constexpr, GATED: tl.constexpr
):  # fmt: skip
    """Y[rows, cols] = acc [BLOCK_M, BLOCK_N] (+ bias; GATED: silu(acc) * acc_up, each rounded to
    Y's dtype first, as `fused.silu_and_mul` computes it): the epilogue of the few-row linear
    kernels (these, `skinny.py`'s and `fp8_gemv.py`'s)."""
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(B + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = rounded_silu_and_mul(acc, acc_up, Y)
    y_ok = row_ok[:, None] & col_ok[None, :]
    tl.store(Y + rows64[:, None] * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty), mask=y_ok)


@triton.jit(do_not_specialize=["M"])
def _gemv_rows_kernel(
    X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
    NW, R, RO, stride_rm, stride_om, eps,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr, N_TILES: tl.constexpr, EVEN_N: tl.constexpr, GATED: tl.constexpr,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Y[rows, cols] = X[rows] W[cols]^T for M <= BLOCK_M rows: `_gemv_kernel` with each weight
    tile multiplied by every row at once, [BLOCK_M, BLOCK_N, BLOCK_K] summed over K. A program
    takes N_TILES column tiles one after the other, reading (and normalising) x once for all of
    them; K_TILES > 1 only with one column tile and without NORM."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    cols = pid * N_TILES * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_rows = W + cols.to(tl.int64)[:, None] * stride_wn
    u_rows = W + (cols + N).to(tl.int64)[:, None] * stride_wn
    if K_TILES == 1:
        k_ok = ks < K
        w, u = _weight_tiles(w_rows, u_rows, col_ok, ks, k_ok, EVEN_N, GATED)  # (first, as above)
        pdl_start(USE_PDL)
        x = _input_rows(
            X, R, NW, RO, rows64, row_ok, ks, k_ok, K, eps, pid, stride_xm, stride_rm, stride_om, NORM,
            HAS_RESIDUAL,
        )  # fmt: skip
        acc = tl.sum(w.to(tl.float32)[None, :, :] * x[:, None, :], axis=2)
        acc_up = acc
        if GATED:
            acc_up = tl.sum(u.to(tl.float32)[None, :, :] * x[:, None, :], axis=2)
        store_rows(acc, acc_up, B, Y, cols, col_ok, N, rows64, row_ok, stride_ym, HAS_BIAS, GATED)
        for t in tl.range(1, N_TILES, num_stages=2):  # the program's other column tiles, on the same x
            cols = (pid * N_TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            w_rows = W + cols.to(tl.int64)[:, None] * stride_wn
            u_rows = W + (cols + N).to(tl.int64)[:, None] * stride_wn
            w, u = _weight_tiles(w_rows, u_rows, col_ok, ks, k_ok, False, GATED)
            acc = tl.sum(w.to(tl.float32)[None, :, :] * x[:, None, :], axis=2)
            acc_up = acc
            if GATED:
                acc_up = tl.sum(u.to(tl.float32)[None, :, :] * x[:, None, :], axis=2)
            store_rows(acc, acc_up, B, Y, cols, col_ok, N, rows64, row_ok, stride_ym, HAS_BIAS, GATED)
    else:
        pdl_start(USE_PDL)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=2):
            k_ok = (k0 + ks) < K
            x_ok = row_ok[:, None] & k_ok[None, :]
            x = tl.load(X + rows64[:, None] * stride_xm + (k0 + ks)[None, :], mask=x_ok, other=0.0)
            x = x.to(tl.float32)
            w, u = _weight_tiles(w_rows, u_rows, col_ok, k0 + ks, k_ok, EVEN_N, GATED)
            acc += tl.sum(w.to(tl.float32)[None, :, :] * x[:, None, :], axis=2)
            if GATED:
                acc_up += tl.sum(u.to(tl.float32)[None, :, :] * x[:, None, :], axis=2)
        store_rows(acc, acc_up, B, Y, cols, col_ok, N, rows64, row_ok, stride_ym, HAS_BIAS, GATED)


_gemv_rows_launch = FastLaunch(_gemv_rows_kernel)


def launch_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    gated: bool,
    norm: tuple[torch.Tensor, float, torch.Tensor | None, torch.Tensor | None] | None = None,
) -> None:
    """Fill y [M, N] with x [M, K] weight^T (+ bias), M from 1 to GEMV_MAX_ROWS: `skinny.py`'s
    launch for those rows, its arguments checked there. weight [N, K] (gated: [2N, K]) with a unit
    last-dim stride, as x and y have; `norm`: (norm weight [K], eps, residual [M, K] or None,
    residual_out [M, K]) for the RMSNorm prologue (`gemv_fuses_norm(M, K)` must hold)."""
    (M, K), N = x.shape, y.shape[1]
    block_m, block_n, block_k, k_tiles = gemv_tile(M, K)
    if M > GEMV_MAX_ROWS:
        raise ValueError(f"gemv: at most {GEMV_MAX_ROWS} rows, got {M}")
    if norm is not None and k_tiles > 1:
        raise ValueError(
            f"gemv: the RMSNorm prologue needs each row in one tile ({block_k} wide), got K = {K}"
        )
    norm_w, eps, res, res_out = norm if norm is not None else (weight, 0.0, None, None)
    has_res = res is not None
    res, res_out = (res, res_out) if has_res else (x, x)  # (unread without a residual)
    # several rows: ROWS_N_TILES column tiles a program where the row is one tile (x read once)
    n_tiles = ROWS_N_TILES if block_m > 1 and k_tiles == 1 else 1
    grid = (cdiv(cdiv(N, block_n), n_tiles),)
    flags = dict(
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, K_TILES=k_tiles, EVEN_N=N % block_n == 0,
        GATED=gated, NORM=norm is not None, HAS_RESIDUAL=has_res,
        num_warps=1 if interpreting() else NUM_WARPS if norm is None or M > 1 else NUM_WARPS_NORM,
        num_stages=1, **pdl_launch_kwargs(x.device, M),
    )  # fmt: skip
    b = bias if bias is not None else weight
    if block_m == 1:
        _gemv_launch[grid](x, weight, b, y, N, K, weight.stride(0), norm_w, res, res_out, float(eps), **flags)
    else:
        _gemv_rows_launch[grid](
            x, weight, b, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
            norm_w, res, res_out, res.stride(0), res_out.stride(0), float(eps), BLOCK_M=block_m,
            N_TILES=n_tiles, **flags,
        )  # fmt: skip
