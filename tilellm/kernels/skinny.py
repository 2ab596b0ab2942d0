"""A linear layer of a few rows (decode of a small batch) that streams its weight while the kernel
before it finishes.

At one to sixteen tokens y = x W^T reads the whole weight for almost no arithmetic: the layer
takes as long as its weight bytes take to arrive. Qwen3-0.6B's layers (2-6 MB in bf16) take
1-3 us to read at the copy rate but 5-9 us in cuBLAS (docs/benchmarks.md, "Where the time
goes"): each kernel starts only once the one before it has finished, then ramps its loads up.

Launched with programmatic dependent launch (`pdl.py`), each program of this kernel first asks
for its weight rows in L2 (`cp.async.bulk.prefetch.L2`, one instruction per thread for a part of
a row; no kernel writes the weight, so nothing it reads can change; a layer's requests are kept
to 16 MB of L2, so a large layer prefetches the start of each row), then waits for the kernel
before it (`griddepcontrol.wait`), lets the next kernel launch, and only then reads x. The
weight's bytes thus stream from HBM while the kernel before (an RMSNorm, an attention merge)
still runs, and the loop finds them in L2. Without PDL it is a plain GEMM of narrow column tiles.

Grid: (column tiles of BLOCK_N, row tiles of 16). A program walks K in BLOCK_K steps, one
`tl.dot` of [16, BLOCK_K] x [BLOCK_K, BLOCK_N] each (rows past M are loaded as zeros), and
rounds its fp32 sum (plus the bias) once to x's dtype. No split-K: the column tiles are chosen
narrow enough (64, 32 or 16 columns) that the grid covers about as many programs as the GPU has
SMs, so a program reads at most BLOCK_N rows of K values. Its PyTorch twin is `F.linear`.

Up to `gemv.gemv_max_rows` rows in 16 bits (one on a CUDA device; `TILELLM_GEMV=1`: up to
`gemv.GEMV_MAX_ROWS`) run `gemv.py`'s kernels instead, with the same prologue and epilogue: each of their programs loads its whole weight tile
at once, with no loop.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tilellm.kernels.config import cdiv, dot_precision, interpreting, next_power_of_2, num_sms
from tilellm.kernels.fused import rms_norm, silu_and_mul
from tilellm.kernels.gemv import gemv_fuses_norm, gemv_runs, launch_gemv, store_rows
from tilellm.kernels.launch import FastLaunch
from tilellm.kernels.pdl import pdl_launch_kwargs, pdl_start
from tilellm.kernels.reference.fused import check_rms_norm

SKINNY_MAX_ROWS = 16  # the linear layers of steps of up to this many tokens run here under PDL
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _prefetch_rows_l2(row_ptrs, row_ok, chunk_bytes, CHUNKS: tl.constexpr):
    """Ask for the first CHUNKS * chunk_bytes bytes of each of `row_ptrs` (16-byte aligned;
    chunk_bytes a multiple of 16) in L2: asynchronous bulk prefetches, no register written. The
    [rows, CHUNKS] requests are as many as the program's threads, so each thread issues one (a
    [rows] vector would be held, and prefetched, by every warp)."""
    chunk = tl.arange(0, CHUNKS)
    ptrs = row_ptrs[:, None] + (chunk * chunk_bytes)[None, :]
    ok = (row_ok[:, None] & (chunk >= 0)[None, :]).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r",
        [ptrs, chunk_bytes + tl.zeros_like(ok), ok],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _summed_rows(x_ptrs, r_ptrs, mask, HAS_RESIDUAL: tl.constexpr):
    """x where `mask` (0 elsewhere), plus the residual rounded to x's dtype as an unfused add
    (`fused.rms_norm`'s residual stream) with HAS_RESIDUAL; in x's dtype."""
    h = tl.load(x_ptrs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
    return h


@triton.jit(do_not_specialize=["M"])
def _skinny_linear_kernel(
    X, W, B, Y, M, N, K, chunk_bytes,
    stride_xm, stride_wn, stride_ym,
    R, NW, RO, stride_rm, stride_om, eps,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, PREFETCH_CHUNKS: tl.constexpr, USE_PDL: tl.constexpr,
    GATED: tl.constexpr = False, NORM: tl.constexpr = False, HAS_RESIDUAL: tl.constexpr = False,
):  # fmt: skip
    """y = x W^T (+ b), Y [M, N]; with GATED, W holds 2N rows [gate | up] and
    y = silu(x W_gate^T + b_gate) * (x W_up^T + b_up), each product rounded to Y's dtype first
    (what `skinny_linear` then `silu_and_mul` store).

    With NORM, x is first replaced by rms_norm(x) with weight NW [K] (with HAS_RESIDUAL:
    h = x + R rounded to x's dtype, stored to RO by the programs of the first column tile, then
    rms_norm(h)), as `fused.rms_norm` computes it: a first pass over the row tile's K sums the
    squares, the loop then scales each chunk and rounds it to x's dtype before its product."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    w_rows = W + cols.to(tl.int64) * stride_wn  # [BLOCK_N] the start of each weight row
    up_rows = W + (cols.to(tl.int64) + N) * stride_wn  # GATED: the up projection's rows, N below
    if PREFETCH_CHUNKS > 0:  # only the weight (no kernel writes it) is touched before the wait
        _prefetch_rows_l2(w_rows, col_ok, chunk_bytes, PREFETCH_CHUNKS)
        if GATED:
            _prefetch_rows_l2(up_rows, col_ok, chunk_bytes, PREFETCH_CHUNKS)
    # x (and the residual) are the kernels before's output: wait for them, then let the next
    # kernel launch (in that order: see `pdl_start`; measured, docs/benchmarks.md)
    pdl_start(USE_PDL)
    x_rows = X + rows64[:, None] * stride_xm
    r_rows = R + rows64[:, None] * stride_rm
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:  # the rows' mean square, and the new residual stream (one column tile stores it)
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        store_res = (row_ok & (rows * 0 + tl.program_id(0) == 0))[:, None]  # [BLOCK_M, 1]
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            cols_k = (k0 + offs_k)[None, :]
            h = _summed_rows(x_rows + cols_k, r_rows + cols_k, row_ok[:, None] & k_ok[None, :], HAS_RESIDUAL)
            if HAS_RESIDUAL:
                tl.store(RO + rows64[:, None] * stride_om + cols_k, h, mask=store_res & k_ok[None, :])
            h = h.to(tl.float32)
            sum_sq += tl.sum(h * h, axis=1)
        rstd = 1.0 / tl.sqrt(sum_sq / K + eps)
    x_ptrs = x_rows + offs_k[None, :]
    r_ptrs = r_rows + offs_k[None, :]
    w_ptrs = w_rows[:, None] + offs_k[None, :]
    u_ptrs = up_rows[:, None] + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # GATED only (else unused, removed)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x_ok = row_ok[:, None]
            w_ok = col_ok[:, None]
        else:
            k_ok = (k0 + offs_k) < K
            x_ok = row_ok[:, None] & k_ok[None, :]
            w_ok = col_ok[:, None] & k_ok[None, :]
        if NORM:  # rms_norm's value of this chunk, rounded as its kernel stores it
            h = _summed_rows(x_ptrs, r_ptrs, x_ok, HAS_RESIDUAL).to(tl.float32)
            nw = tl.load(NW + k0 + offs_k, mask=(k0 + offs_k) < K, other=0.0).to(tl.float32)
            x = (h * rstd[:, None] * nw[None, :]).to(X.dtype.element_ty)
            r_ptrs += BLOCK_K
        else:
            x = tl.load(x_ptrs, mask=x_ok, other=0.0)
        w = tl.load(w_ptrs, mask=w_ok, other=0.0)
        if GATED:
            u = tl.load(u_ptrs, mask=w_ok, other=0.0)
            acc_up = tl.dot(x, tl.trans(u), acc_up, input_precision=PRECISION)
            u_ptrs += BLOCK_K
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    store_rows(acc, acc_up, B, Y, cols, col_ok, N, rows64, row_ok, stride_ym, HAS_BIAS, GATED)


_skinny_launch = FastLaunch(_skinny_linear_kernel)


def skinny_config(M: int, N: int, K: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [M, K] x [N, K]^T product of few rows:
    the widest column tile of 64, 32 or 16 that still gives every SM a program (else 16), K in
    steps of 128. Under the interpreter: 16 x 32 tiles, one stage."""
    if interpreting():
        return 16, 32, 4, 1
    sms = num_sms()
    block_n = next((bn for bn in (64, 32) if cdiv(N, bn) >= sms), 16)
    block_k = min(128, max(16, next_power_of_2(K)))
    return block_n, block_k, 4, 4


# What a layer's programs may prefetch into L2 in all (of the H100/H200's 50 MB): its programs are
# usually all resident at once, and more would evict rows before the loops read them.
PREFETCH_BUDGET_BYTES = 16 << 20


@functools.lru_cache(maxsize=256)
def _plan(
    M: int, N: int, K: int, element_size: int, interpreting_: bool, weight_rows_per_col: int = 1
) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, prefetch chunks, bytes per chunk) of one shape:
    `skinny_config`, and each program's prefetch of its rows: [BLOCK_N, chunks] requests, one per
    thread, for each of its `weight_rows_per_col` weight rows per output column (2: gate and up),
    covering each row's first bytes within PREFETCH_BUDGET_BYTES over all programs (0 chunks: no
    prefetch)."""
    block_n, block_k, warps, stages = skinny_config(M, N, K)
    programs = cdiv(N, block_n) * cdiv(M, 16)
    row_bytes = min(K * element_size, PREFETCH_BUDGET_BYTES // (programs * block_n * weight_rows_per_col))
    chunks = max(1, warps * 32 // block_n)
    chunk_bytes = row_bytes // chunks // 16 * 16
    return block_n, block_k, warps, stages, (chunks if chunk_bytes > 0 else 0), chunk_bytes


def check_skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """`skinny_linear`'s argument checks: 2-D float x and weight sharing K, dtype and device, unit
    last-dim strides, a bias of N elements in the same dtype and device."""
    name = "skinny_linear"
    for arg, t, shape in (("x", x, "[M, K]"), ("weight", weight, "[N, K]")):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: {arg} must be a 2-D tensor {shape}, got {got}")
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name}: {arg} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name}: {arg}'s last dim must be contiguous, got strides {tuple(t.stride())}")
    if weight.shape[1] != x.shape[1] or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(
            f"{name}: weight {tuple(weight.shape)} {weight.dtype} on {weight.device} must match x "
            f"{tuple(x.shape)} {x.dtype} on {x.device} in K, dtype and device"
        )
    if bias is not None and (
        bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or bias.device != x.device
    ):
        raise ValueError(
            f"{name}: bias must be [N={weight.shape[0]}] in x's dtype and device, got "
            f"{tuple(bias.shape)} {bias.dtype} on {bias.device}"
        )


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T (+ bias): x [M, K], weight [N, K], bias [N] -> y [M, N] in x's dtype.

    Meant for few rows (decode of small batches; up to 2^20 rows run). Summed in fp32 and rounded
    once.
    With `TILELLM_PDL=1` on Hopper it launches with PDL and prefetches its weight into L2 before
    waiting for the kernel before it (module docstring).
    """
    check_skinny_linear(x, weight, bias)
    return _skinny(x, weight, bias, weight.shape[0], gated=False)


def skinny_linear_silu_and_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`silu_and_mul(skinny_linear(x, weight, bias))` in one launch, the same bits: x [M, K],
    weight [2I, K] = [gate | up] (a merged gate-up projection), bias [2I] -> [M, I] in x's dtype.

    Each program computes one column tile of both products, rounds each to x's dtype as
    `skinny_linear` stores it, and writes silu(gate) * up as `fused.silu_and_mul` does: the
    [M, 2I] product never goes through memory and the activation's launch is saved."""
    check_skinny_linear(x, weight, bias)
    if weight.shape[0] % 2:
        raise ValueError(
            f"skinny_linear_silu_and_mul: weight must hold [gate | up], an even number of rows, got "
            f"{tuple(weight.shape)}"
        )
    return _skinny(x, weight, bias, weight.shape[0] // 2, gated=True)


def skinny_rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    silu_and_mul: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`skinny_linear(rms_norm(x, norm_weight, eps, residual=residual), weight, bias)` in one
    launch (`silu_and_mul=True`: `skinny_linear_silu_and_mul`'s output): a pre-norm decoder's
    norm and the linear layer that reads it, without the normalised rows going through memory.

    x [M, K]; norm_weight [K]; weight [N, K] (or [2I, K] = [gate | up]) -> y [M, N] (or [M, I]).
    With `residual` [M, K]: h = x + residual (rounded to x's dtype) is normalised and also
    returned, written to `residual_out` [M, K] when given (a new tensor otherwise):
    (y, h). y differs from the two launches' only where the row's sum of squares, summed here
    in BLOCK_K chunks, rounds differently.
    """
    check_rms_norm(x, norm_weight, eps, residual)
    check_skinny_linear(x, weight, bias)
    if x.shape[1] == 0:
        raise ValueError("skinny_rms_norm_linear: x has no columns to normalise (K = 0)")
    if silu_and_mul and weight.shape[0] % 2:
        raise ValueError(
            f"skinny_rms_norm_linear: with silu_and_mul, weight must hold [gate | up], an even number of "
            f"rows, got {tuple(weight.shape)}"
        )
    if residual is None and residual_out is not None:
        raise ValueError("skinny_rms_norm_linear: residual_out is given without residual (nothing to store)")
    if residual is not None:
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        if residual_out is None:
            residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        elif (
            residual_out.shape != x.shape
            or residual_out.dtype != x.dtype
            or residual_out.device != x.device
            or residual_out.stride(-1) != 1
        ):
            raise ValueError(
                f"skinny_rms_norm_linear: residual_out must be [M, K]={tuple(x.shape)} {x.dtype} on "
                f"{x.device} with a contiguous last dim, got {tuple(residual_out.shape)} "
                f"{residual_out.dtype} on {residual_out.device}"
            )
        elif _overlaps(residual_out, x) or _overlaps(residual_out, residual):
            # (the launch reads x and residual again after the first column tile stored the sum)
            raise ValueError(
                "skinny_rms_norm_linear: residual_out must not share memory with x or residual "
                "(an in-place residual update): pass a new tensor, or none"
            )
    rows = weight.shape[0]
    n = rows // 2 if silu_and_mul else rows
    if x.shape[0] == 0 or n == 0:  # no product: the norm's own launch (the residual still comes out)
        normed = rms_norm(x, norm_weight, eps, residual=residual)
        if residual is not None:
            normed, h = normed
            residual_out.copy_(h)
        y = _skinny(normed, weight, bias, n, silu_and_mul)
    else:
        y = _skinny(
            x, weight, bias, n, silu_and_mul, (norm_weight.contiguous(), float(eps), residual, residual_out)
        )
    return y if residual is None else (y, residual_out)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes a and b may touch overlap (their spans in memory intersect)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        extent = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1
        return t.data_ptr(), t.data_ptr() + extent * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _skinny(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    N: int,
    gated: bool,
    norm: tuple[torch.Tensor, float, torch.Tensor | None, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """The launch of the wrappers: y [M, N] (N = weight's rows, or half of them when gated);
    `norm`: (norm weight, eps, residual or None, residual_out) for the RMSNorm prologue, for
    M, N, K > 0 only."""
    (M, K) = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:  # the products are the bias (or zeros)
        rows = weight.shape[0]
        prod = bias.expand(M, rows).clone() if bias is not None else y.new_zeros((M, rows))
        return silu_and_mul(prod) if gated else prod
    if gemv_runs(M, x.dtype, x.device) and (norm is None or gemv_fuses_norm(M, K)):
        # one row or a few: `gemv.py`'s kernels, which load each program's weight tile at once
        launch_gemv(x, weight, bias.contiguous() if bias is not None else None, y, gated, norm)
        return y
    pdl = pdl_launch_kwargs(x.device, M)
    block_n, block_k, warps, stages, chunks, chunk_bytes = _plan(
        M, N, K, weight.element_size(), interpreting(), 2 if gated else 1
    )
    aligned = weight.data_ptr() % 16 == 0 and weight.stride(0) * weight.element_size() % 16 == 0
    if norm is None:
        norm_w, eps, res, res_out = weight, 0.0, None, None
    else:
        norm_w, eps, res, res_out = norm
    has_res = res is not None
    res, res_out = (res, res_out) if has_res else (x, x)  # (unread without a residual)
    grid = (cdiv(N, block_n), cdiv(M, 16))
    _skinny_launch[grid](
        x, weight, bias.contiguous() if bias is not None else weight, y, M, N, K, chunk_bytes,
        x.stride(0), weight.stride(0), y.stride(0),
        res, norm_w, res_out, res.stride(0), res_out.stride(0), eps,
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0,
        PRECISION=dot_precision(x.dtype), PREFETCH_CHUNKS=chunks if pdl["USE_PDL"] and aligned else 0,
        GATED=gated, NORM=norm is not None, HAS_RESIDUAL=has_res,
        num_warps=warps, num_stages=stages, **pdl,
    )  # fmt: skip
    return y
