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
the order of the fp32 sums differs). Rows longer than MAX_BLOCK_K channels loop over their groups
in chunks (without the norm, which needs the whole row). With a static input scale (`input_scale`)
every group's x_s is that scale.

Every program quantizes every row of x for its own few weight rows, so the quantization is
repeated N / BLOCK_N times. At one row against 8 weight rows a program that is 1/8 of the
weight's work and saves a launch; at more rows, or fewer weight rows a program (rows of more than
8192 channels), it becomes the kernel's bottleneck, so x is quantized once, in a launch of its
own or in the op before (`fp8_gemv_quantizes_x`), and the programs load x_q and its scales
instead (`w8a8_block_fp8_matmul`'s operands).

The weight is loaded before x, so the layer's neighbours fit in the launch as in `gemv.py`
(`fp8_gemv_linear`): the decoder's RMSNorm before qkv and gate-up (each program normalises x's
rows with `gemv.input_row`, `fused.rms_norm`'s bits, before quantizing them; program 0 stores the
new residual stream), and SiLU-and-mul after gate-up ([gate | up] weight rows; silu(gate) * up of
the rounded products). The tile depends on M, K and bk only, so these launches give the bits of
the separate launches.

Launched by `fp8_gemm.w8a8_block_fp8_linear` and `w8a8_block_fp8_matmul`, and by FP8 linear
layers (`Fp8LinearMethod`) through `fp8_gemv_linear`, for the steps `fp8_gemv_runs` gives it:
one row on a CUDA device (`TILELLM_GEMV`, the switch of `gemv.py`'s kernels, says otherwise).
Measured on an H100 at Qwen3's shapes, one row takes 0.6-0.8x the time of `fp8_gemm.py`'s GEMM;
at two rows it still wins at Qwen3-0.6B's shapes but not at 8B's, and at 4-8 rows it loses
(docs/benchmarks.md). Its PyTorch twin is `reference.fp8_gemm.w8a8_block_fp8_linear`
(followed by `reference.fused`'s RMSNorm before and SiLU-and-mul after).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from tilellm.kernels.config import cdiv, interpreting, next_power_of_2
from tilellm.kernels.fp8 import quantize_groups, to_fp8
from tilellm.kernels.gemv import GEMV_MAX_ROWS, gemv_max_rows, input_row, store_rows
from tilellm.kernels.launch import FastLaunch
from tilellm.kernels.pdl import pdl_launch_kwargs, pdl_start
from tilellm.kernels.reference.fp8_gemm import check_block_fp8_matmul, check_input_scale

# A program's tile: BLOCK_N weight rows (1 to MAX_BLOCK_N) of BLOCK_G groups of bk channels (the
# row's groups padded to a power of two, at most MAX_BLOCK_K channels), BLOCK_N * BLOCK_G * bk of
# at most TILE_ELEMENTS. Swept on an H100 at Qwen3-0.6B's and 8B's layer shapes
# (docs/benchmarks.md): 8 weight rows a program make one row's in-kernel quantization cheap
# (1/8 of the weight's work), and cost rows of x quantized before nothing measurable.
TILE_ELEMENTS = 32768
MAX_BLOCK_K = 16384
MAX_BLOCK_N = 8
NUM_WARPS = 8
# rows of x a program may quantize per weight row it reads (`fp8_gemv_quantizes_x`)
MAX_QUANT_ROWS_PER_WEIGHT_ROW = 0.25


def fp8_gemv_runs(M: int, bk: int, device: torch.device) -> bool:
    """Whether `w8a8_block_fp8_linear`'s steps of M rows in groups of bk on `device` run this
    kernel: up to `gemv.gemv_max_rows(device)` rows (one on a CUDA device by default, where it
    beats the GEMM at every measured shape; at 2 rows only at Qwen3-0.6B's) and bk a power of
    two."""
    return 0 < M <= gemv_max_rows(device) and bk > 0 and bk & (bk - 1) == 0


def fp8_gemv_tile(M: int, K: int, bk: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_G, g_tiles) for M rows of x against weight rows of K channels in
    groups of bk: BLOCK_M = M padded to a power of two, BLOCK_G groups a chunk (g_tiles chunks a
    row) and BLOCK_N weight rows a program."""
    groups = max(1, K // bk)
    block_g = min(max(1, MAX_BLOCK_K // bk), next_power_of_2(groups))
    block_n = max(1, min(MAX_BLOCK_N, TILE_ELEMENTS // (block_g * bk)))
    return next_power_of_2(max(M, 1)), block_n, block_g, cdiv(groups, block_g)


def fp8_gemv_quantizes_x(M: int, K: int, bk: int) -> bool:
    """Whether a step of M rows of K channels quantizes x in this kernel's programs (one launch)
    rather than in a launch of its own before it. Every program quantizes all M rows of x for its
    BLOCK_N weight rows, so the quantization (an IEEE division an element) is repeated
    N / BLOCK_N times: worth a launch saved only while it stays a fraction of the weight's work,
    M / BLOCK_N <= MAX_QUANT_ROWS_PER_WEIGHT_ROW."""
    block_n = fp8_gemv_tile(M, K, bk)[1]
    return M <= MAX_QUANT_ROWS_PER_WEIGHT_ROW * block_n


def fp8_gemv_fuses_norm(M: int, K: int, bk: int) -> bool:
    """Whether the RMSNorm before a layer runs in its launch at M rows of K: the whole row in one
    chunk (the norm needs the row's mean square before any group is quantized)."""
    return fp8_gemv_tile(M, K, bk)[3] == 1


@triton.jit
def _weight_tile(w_rows, bs_rows, g0, ks, gs, col_ok, g_ok, stride_bs_k):
    """The program's weight rows at groups g0 + gs: e4m3 [BLOCK_N, BLOCK_G, GROUP_K] and their
    block scales [BLOCK_N, BLOCK_G] fp32, 0 past N and past the row's groups."""
    w = tl.load(
        w_rows + g0 * ks.shape[1] + ks[None, :, :],
        mask=col_ok[:, None, None] & g_ok[None, :, None],
        other=0.0,
    )
    b_s = tl.load(bs_rows + (g0 + gs)[None, :] * stride_bs_k, mask=col_ok[:, None] & g_ok[None, :], other=0.0)
    return w, b_s


@triton.jit
def _quantized_row(
    X, Xs, R, NW, RO, As, m, M, g0, K, stride_xm, stride_xsm, stride_xsk, stride_rm, stride_om, eps,
    norm_eps, pid, BLOCK_G: tl.constexpr, GROUP_K: tl.constexpr, STATIC_A: tl.constexpr,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANTIZED_X: tl.constexpr,
):  # fmt: skip
    """Row m of x at groups g0 .. g0 + BLOCK_G (0 past K and for m >= M), normalised with NORM as
    `gemv.input_row` does it (`fused.rms_norm`'s bits), then quantized as `fp8_gemm`'s kernels
    quantize it: (x_q as fp32 [BLOCK_G, GROUP_K], x_s [BLOCK_G]). QUANTIZED_X: x is e4m3 already,
    with its scales in Xs [M, K / GROUP_K] (loaded, not computed)."""
    if QUANTIZED_X:
        gs = tl.arange(0, BLOCK_G)
        g_ok = (g0 + gs < K // GROUP_K) & (gs * 0 + m < M)
        ks2 = gs[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]
        x_q = tl.load(X + m * stride_xm + g0 * GROUP_K + ks2, mask=g_ok[:, None], other=0.0)
        x_s = tl.load(Xs + m * stride_xsm + (g0 + gs) * stride_xsk, mask=g_ok, other=0.0)
        return x_q.to(tl.float32), x_s
    ks = tl.arange(0, BLOCK_G * GROUP_K)
    k_ok = (g0 * GROUP_K + ks < K) & (ks * 0 + m < M)
    x = input_row(
        X + m * stride_xm + g0 * GROUP_K, R + m * stride_rm, NW, RO + m * stride_om, ks, k_ok, K, norm_eps, pid,
        NORM, HAS_RESIDUAL,
    )  # fmt: skip
    x = tl.reshape(x, (BLOCK_G, GROUP_K))
    if STATIC_A:  # the calibrated scale for every group
        a_s = tl.load(As)
        return to_fp8(tl.div_rn(x, a_s)).to(tl.float32), tl.zeros([BLOCK_G], dtype=tl.float32) + a_s
    x_q, a_s = quantize_groups(x, eps)  # groups past K: x = 0, so x_q = 0
    return x_q.to(tl.float32), a_s


@triton.jit
def _scaled_sum(w, b_s, x_q, a_s):
    """sum_j a_s[j] * b_s[:, j] * sum_{k in group j} x_q[j, k] * w[:, j, k]: [BLOCK_N] fp32."""
    return tl.sum(tl.sum(w * x_q[None, :, :], axis=2) * (a_s[None, :] * b_s), axis=1)


@triton.jit(do_not_specialize=["M", "eps", "norm_eps"])
def _fp8_gemv_kernel(
    X, Xs, W, Bs, As, Y, M, N, K, eps,
    stride_xm, stride_xsm, stride_xsk, stride_wn, stride_bs_n, stride_bs_k, stride_ym,
    NW, R, RO, stride_rm, stride_om, norm_eps,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr, G_TILES: tl.constexpr, STATIC_A: tl.constexpr, GATED: tl.constexpr,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANTIZED_X: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Y[rows, cols] for this program's BLOCK_N columns and every row of x (module docstring);
    W [N, K] e4m3 (GATED: [2N, K], the up rows N below the gate rows), Bs [ceil(rows of W /
    GROUP_N), K / GROUP_K] fp32, As the static scale (STATIC_A). NORM (G_TILES == 1 only): x is
    first replaced by its RMSNorm, as `gemv.py`'s kernels do it. QUANTIZED_X: X is x_q [M, K]
    e4m3 with its scales Xs [M, K / GROUP_K] fp32 (any strides)."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    gs = tl.arange(0, BLOCK_G)
    ks = gs[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]  # [BLOCK_G, GROUP_K]
    w_rows = W + cols.to(tl.int64)[:, None, None] * stride_wn
    u_rows = W + (cols + N).to(tl.int64)[:, None, None] * stride_wn
    bs_rows = Bs + (cols // GROUP_N).to(tl.int64)[:, None] * stride_bs_n
    bu_rows = Bs + ((cols + N) // GROUP_N).to(tl.int64)[:, None] * stride_bs_n
    rows = tl.arange(0, BLOCK_M)
    num_groups = K // GROUP_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if G_TILES == 1:
        g_ok = gs < num_groups
        # the weight and its scales first: no kernel writes them, so their loads may start before
        # the wait for the kernel before (PDL), and they are in flight while x is read
        w, b_s = _weight_tile(w_rows, bs_rows, 0, ks, gs, col_ok, g_ok, stride_bs_k)
        u, bu_s = w, b_s
        if GATED:
            u, bu_s = _weight_tile(u_rows, bu_rows, 0, ks, gs, col_ok, g_ok, stride_bs_k)
        pdl_start(USE_PDL)
        w = w.to(tl.float32)
        u = u.to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            x_q, a_s = _quantized_row(
                X, Xs, R, NW, RO, As, m, M, 0, K, stride_xm, stride_xsm, stride_xsk, stride_rm, stride_om, eps,
                norm_eps, pid, BLOCK_G, GROUP_K, STATIC_A, NORM, HAS_RESIDUAL, QUANTIZED_X,
            )  # fmt: skip
            acc = tl.where(rows[:, None] == m, _scaled_sum(w, b_s, x_q, a_s)[None, :], acc)
            if GATED:
                acc_up = tl.where(rows[:, None] == m, _scaled_sum(u, bu_s, x_q, a_s)[None, :], acc_up)
    else:  # rows of more than MAX_BLOCK_K channels: chunks of BLOCK_G groups
        pdl_start(USE_PDL)
        for g0 in range(0, G_TILES * BLOCK_G, BLOCK_G):
            g_ok = (g0 + gs) < num_groups
            w, b_s = _weight_tile(w_rows, bs_rows, g0, ks, gs, col_ok, g_ok, stride_bs_k)
            w = w.to(tl.float32)
            if GATED:
                u, bu_s = _weight_tile(u_rows, bu_rows, g0, ks, gs, col_ok, g_ok, stride_bs_k)
                u = u.to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                x_q, a_s = _quantized_row(
                    X, Xs, R, NW, RO, As, m, M, g0, K, stride_xm, stride_xsm, stride_xsk, stride_rm, stride_om,
                    eps, norm_eps, pid, BLOCK_G, GROUP_K, STATIC_A, False, False, QUANTIZED_X,
                )  # fmt: skip
                acc += tl.where(rows[:, None] == m, _scaled_sum(w, b_s, x_q, a_s)[None, :], 0.0)
                if GATED:
                    acc_up += tl.where(rows[:, None] == m, _scaled_sum(u, bu_s, x_q, a_s)[None, :], 0.0)
    store_rows(acc, acc_up, Y, Y, cols, col_ok, N, rows.to(tl.int64), rows < M, stride_ym, False, GATED)


_fp8_gemv_launch = FastLaunch(_fp8_gemv_kernel)


def launch_fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    y: torch.Tensor,
    eps: float,
    input_scale: torch.Tensor | None = None,
    gated: bool = False,
    norm: tuple[torch.Tensor, float, torch.Tensor | None, torch.Tensor | None] | None = None,
    x_s: torch.Tensor | None = None,
) -> None:
    """Fill y [M, N] with `w8a8_block_fp8_linear(x, weight, weight_scale_inv, block_size)` for M
    of 1 to GEMV_MAX_ROWS rows: the launch of `fp8_gemm.py` and of `fp8_gemv_linear` for those
    rows, their arguments checked there. x [M, K] with a unit last-dim stride, weight [N, K] e4m3
    (gated: [2N, K], y then silu(gate) * up) with a unit last-dim stride, weight_scale_inv
    [ceil(rows / bn), K / bk] fp32, bk a power of two; `input_scale`: the static activation scale
    (one fp32 element), else per token and group; `norm`: (norm weight [K], eps, residual [M, K]
    or None, residual_out [M, K]) for the RMSNorm prologue (`fp8_gemv_fuses_norm` must hold);
    `x_s` [M, K / bk] fp32 (any strides): x is x_q, e4m3 already, with these scales
    (`w8a8_block_fp8_matmul`'s operands), and neither `input_scale` nor `norm` applies."""
    (M, K), N = x.shape, y.shape[1]
    bn, bk = block_size
    block_m, block_n, block_g, g_tiles = fp8_gemv_tile(M, K, bk)
    if norm is not None and (g_tiles > 1 or x_s is not None):
        raise ValueError(f"fp8_gemv: the RMSNorm prologue needs each 16-bit row in one chunk, got K = {K}")
    quantized_x = x_s is not None
    x_s = x_s if quantized_x else weight_scale_inv  # (unread unless x is quantized)
    norm_w, norm_eps, res, res_out = norm if norm is not None else (x, 0.0, None, None)
    has_res = res is not None
    res, res_out = (res, res_out) if has_res else (x, x)  # (unread without a residual)
    scale = input_scale if input_scale is not None else weight_scale_inv  # (unread without)
    _fp8_gemv_launch[(cdiv(N, block_n),)](
        x, x_s, weight, weight_scale_inv, scale, y, M, N, K, float(eps),
        x.stride(0), x_s.stride(0), x_s.stride(1), weight.stride(0), weight_scale_inv.stride(0),
        weight_scale_inv.stride(1), y.stride(0),
        norm_w, res, res_out, res.stride(0), res_out.stride(0), float(norm_eps),
        GROUP_N=bn, GROUP_K=bk, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_G=block_g, G_TILES=g_tiles,
        STATIC_A=input_scale is not None and not quantized_x, GATED=gated, NORM=norm is not None,
        HAS_RESIDUAL=has_res, QUANTIZED_X=quantized_x,
        num_warps=1 if interpreting() else NUM_WARPS, num_stages=1, **pdl_launch_kwargs(x.device, M),
    )  # fmt: skip


def fp8_gemv_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: Sequence[int],
    *,
    input_scale: torch.Tensor | None = None,
    eps: float = 1e-10,
    silu_and_mul: bool = False,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`w8a8_block_fp8_linear(x, weight, weight_scale_inv, block_size)` on this kernel for x [M, K]
    of 1 to GEMV_MAX_ROWS rows, in x's dtype, with its neighbouring ops in the same launch:

    - `norm_weight` [K]: x is first replaced by `fused.rms_norm(x, norm_weight, norm_eps)` (with
      `residual` [M, K], of x + residual, which is stored to `residual_out`, allocated when None,
      and returned beside y), the bits of that kernel's output;
    - `silu_and_mul`: weight holds the [gate | up] rows [2N, K] and y [M, N] is silu(gate) * up,
      the bits of the plain launch followed by `fused.silu_and_mul`.

    `input_scale`: a static activation scale (one fp32 element), else per token and group (eps as
    `w8a8_block_fp8_linear`'s)."""
    name = "fp8_gemv_linear"
    bn, bk = check_block_fp8_matmul(name, x, weight, None, weight_scale_inv, block_size, x.dtype)
    (M, K), rows = x.shape, weight.shape[0]
    if not 0 < M <= GEMV_MAX_ROWS or bk & (bk - 1) or weight.stride(1) != 1:
        raise ValueError(
            f"{name}: takes 1 to {GEMV_MAX_ROWS} rows, a power-of-two bk and a weight with a contiguous "
            f"last dim, got x {tuple(x.shape)}, bk = {bk}, weight strides {tuple(weight.stride())}"
        )
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"{name}: eps must be a positive number, got {eps!r}")
    if input_scale is not None:
        check_input_scale(name, x, input_scale)
    if silu_and_mul and rows % 2:
        raise ValueError(f"{name}: silu_and_mul needs [gate | up] weight rows (an even count), got {rows}")
    if norm_weight is None and (residual is not None or residual_out is not None):
        raise ValueError(f"{name}: a residual is added only before the norm: pass norm_weight")
    norm = None
    if norm_weight is not None:
        if tuple(norm_weight.shape) != (K,) or norm_weight.device != x.device:
            raise ValueError(
                f"{name}: norm_weight must be [K] = [{K}] on x's device {x.device}, got "
                f"{tuple(norm_weight.shape)} on {norm_weight.device}"
            )
        if not fp8_gemv_fuses_norm(M, K, bk):
            raise ValueError(
                f"{name}: the RMSNorm runs in the launch only where a row fits one chunk of "
                f"{MAX_BLOCK_K} channels, got K = {K}: run the norm apart"
            )
        if residual is None and residual_out is not None:
            raise ValueError(f"{name}: residual_out is filled with x + residual: pass the residual")
        if residual is not None:
            residual_out = torch.empty_like(x) if residual_out is None else residual_out
            for what, t in (("residual", residual), ("residual_out", residual_out)):
                if t.shape != x.shape or t.dtype != x.dtype or t.device != x.device or t.stride(1) != 1:
                    raise ValueError(
                        f"{name}: {what} must be [M, K] = {list(x.shape)} in {x.dtype} on {x.device} with a "
                        f"contiguous last dim, got {list(t.shape)} in {t.dtype} on {t.device}, strides "
                        f"{tuple(t.stride())}"
                    )
        norm = (norm_weight, float(norm_eps), residual, residual_out)
    y = torch.empty((M, rows // 2 if silu_and_mul else rows), dtype=x.dtype, device=x.device)
    launch_fp8_gemv(x, weight, weight_scale_inv, (bn, bk), y, eps, input_scale, gated=silu_and_mul, norm=norm)
    return y if residual is None else (y, residual_out)
