"""Fused element-wise Triton ops of the decoder layer: RMSNorm (+ residual add), SiLU-and-mul, RoPE.

Each has a PyTorch twin with the same signature in `tilellm.kernels.reference.fused`, which also
holds the input checks both share. All math is in fp32; outputs take the input dtype.

- `rms_norm(x [N, H], weight [H], eps, *, residual=None)`: one program normalises a tile of
  BLOCK_N rows (several rows per program when H is small, e.g. Qwen3's per-head q/k norm).
  `rms_norm_per_token_group_quant_fp8(x, weight, eps, group_size, *, residual=None)`: y quantized
  to FP8 per token and group as `fp8_gemm.per_token_group_quant_fp8` does, in the same launch.
- `silu_and_mul(x [N, 2I]) -> [N, I]`: grid over (row tiles, column tiles);
  `silu_and_mul_per_token_group_quant_fp8(x, group_size)`: its output quantized to FP8 per token
  and group as `fp8_gemm.per_token_group_quant_fp8` does, in the same launch (grid: row tiles,
  groups).
- `apply_rotary(q, k, positions, cos_sin_cache, *, q_norm_weight=None, k_norm_weight=None, eps,
  v=None, k_cache=None, v_cache=None, slot_mapping=None, k_scale=None, v_scale=None) -> (q, k)`:
  q and k viewed as [T * H, D] rows (one per token and head); a program rotates a tile of rows,
  each with its token's cos/sin, after Qwen3's per-head RMSNorm when weights are given. With the
  cache arguments, k's programs also write their rotated rows, and the same rows of v, into the
  paged cache (`store_kvcache` in the same launch).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tilellm.kernels import validation
from tilellm.kernels.config import cdiv, next_power_of_2
from tilellm.kernels.fp8 import is_fp8, quantize_groups, to_cache, unit_scale
from tilellm.kernels.fp8_gemm import group_quant_outputs, group_quant_tile
from tilellm.kernels.launch import FastLaunch, LaunchKey
from tilellm.kernels.pdl import pdl_launch_kwargs, pdl_start
from tilellm.kernels.reference.fused import (
    check_apply_rotary,
    check_rms_norm,
    check_rms_norm_quant,
    check_rotary_store,
    check_silu_and_mul,
    check_silu_and_mul_quant,
)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# ----------------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------------


@triton.jit
def _normed_rows(
    x_ptr, res_ptr, w_ptr, res_out_ptr, rows64, cols, mask, stride_x, stride_res, stride_res_out, H, eps,
    HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """The rows `rows64` [BLOCK_N, 1] (int64) of x, lanes `cols` [BLOCK_H], normalised:
    y = x * rsqrt(mean(x^2) + eps) * w in fp32 [BLOCK_N, BLOCK_H] (0 where not `mask`). With
    HAS_RESIDUAL, x + residual first, rounded to the storage dtype like an unfused add and stored
    to res_out. The weight is loaded with x, not after the row sums: at decode sizes a program's
    time is its chain of dependent memory round trips."""
    x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows64 * stride_res + cols[None, :], mask=mask, other=0.0)
    x, w = x.to(tl.float32), w.to(tl.float32)
    if HAS_RESIDUAL:
        s = (x + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows64 * stride_res_out + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=1) / H
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    return x * rstd[:, None] * w[None, :]


@triton.jit(do_not_specialize=["N"])  # the token count changes every step
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr,
    stride_x, stride_res, stride_y, stride_res_out,
    N, H, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < N) & (cols[None, :] < H)
    rows64 = rows.to(tl.int64)[:, None]
    y = _normed_rows(
        x_ptr, res_ptr, w_ptr, res_out_ptr, rows64, cols, mask, stride_x, stride_res, stride_res_out, H, eps,
        HAS_RESIDUAL,
    )  # fmt: skip
    tl.store(y_ptr + rows64 * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


_rms_norm_launch = FastLaunch(_rms_norm_kernel)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim of x [N, H]; y has x's dtype.

    With `residual` [N, H]: residual = x + residual (rounded to x.dtype), y = norm(residual);
    returns (y, residual) as new tensors (the inputs are not modified).
    """
    check_rms_norm(x, weight, eps, residual)
    x = _last_dim_contiguous(x)
    weight = weight.contiguous()
    n, h = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if residual is not None:
        residual = _last_dim_contiguous(residual)
        res_out = torch.empty_like(y)
    else:
        residual, res_out = x, y  # unused (HAS_RESIDUAL=False)
    if n > 0:
        block_h = next_power_of_2(h)
        block_n = max(1, min(64, 4096 // block_h))
        grid = (cdiv(n, block_n),)
        scalars = (x.stride(0), residual.stride(0), y.stride(0), res_out.stride(0), n, h, float(eps))
        has_residual = res_out is not y
        pdl = pdl_launch_kwargs(x.device, n)
        _rms_norm_launch.run(
            grid,
            (x, residual, weight, y, res_out, *scalars),
            lambda: dict(
                HAS_RESIDUAL=has_residual, BLOCK_N=block_n, BLOCK_H=block_h,
                num_warps=4 if block_n * block_h <= 4096 else 8, **pdl,
            ),
            key=(x.device, has_residual, scalars[:4], h, pdl["USE_PDL"]),  # all but n; the blocks follow from h
        )  # fmt: skip
    return y if res_out is y else (y, res_out)


@triton.jit(do_not_specialize=["N"])
def _rms_norm_quant_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr,
    stride_x, stride_res, stride_q, stride_sn, stride_sg, stride_res_out,
    N, H, eps, quant_eps,
    HAS_RESIDUAL: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """`_rms_norm_kernel`'s y, rounded to x's dtype as it stores it, then `fp8_gemm`'s
    per-token-group quantization of y: the row of BLOCK_H lanes viewed as BLOCK_H / GROUP groups
    (the lanes past H, and the groups made only of them, are 0 and not stored)."""
    pdl_start(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < N
    mask = row_ok[:, None] & (cols[None, :] < H)
    rows64 = rows.to(tl.int64)[:, None]
    y = _normed_rows(
        x_ptr, res_ptr, w_ptr, res_out_ptr, rows64, cols, mask, stride_x, stride_res, stride_res_out, H, eps,
        HAS_RESIDUAL,
    ).to(x_ptr.dtype.element_ty).to(tl.float32)  # fmt: skip
    # -- one scale per row and GROUP-wide group: [BLOCK_N, BLOCK_H] as [BLOCK_N * groups, GROUP] --
    NUM_G: tl.constexpr = BLOCK_H // GROUP
    q, s = quantize_groups(tl.reshape(y, (BLOCK_N * NUM_G, GROUP)), quant_eps)
    tl.store(q_ptr + rows64 * stride_q + cols[None, :], tl.reshape(q, (BLOCK_N, BLOCK_H)), mask=mask)
    g = tl.arange(0, NUM_G)
    s_mask = row_ok[:, None] & (g[None, :] * GROUP < H)
    tl.store(
        s_ptr + rows64 * stride_sn + g[None, :] * stride_sg, tl.reshape(s, (BLOCK_N, NUM_G)), mask=s_mask
    )


_rms_norm_quant_launch = FastLaunch(_rms_norm_quant_kernel)


def rms_norm_per_token_group_quant_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    *,
    residual: torch.Tensor | None = None,
    quant_eps: float = 1e-10,
    column_major_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`per_token_group_quant_fp8(rms_norm(x, weight, eps, residual=residual), group_size,
    eps=quant_eps)` (`tilellm.kernels.fp8_gemm`): the same bits in one launch, the normalised rows
    never going through memory. The input of an FP8 linear layer after a decoder's norm.

    x [N, H] with H a multiple of `group_size`, a power of two -> (x_q [N, H] float8_e4m3fn,
    x_s [N, H // group_size] float32), plus the new residual [N, H] (x + residual in x's dtype)
    when `residual` is given; `column_major_scales`: x_s with strides (1, N), as cuBLAS reads it.
    """
    check_rms_norm_quant(x, weight, eps, residual, group_size, quant_eps)
    x = _last_dim_contiguous(x)
    weight = weight.contiguous()
    n, h = x.shape
    x_q, x_s = group_quant_outputs(n, h, group_size, x.device, column_major_scales)
    if residual is not None:
        residual = _last_dim_contiguous(residual)
        res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        residual = res_out = x  # unused (HAS_RESIDUAL=False)
    if n > 0:
        block_h = next_power_of_2(h)
        block_n = max(1, min(64, 4096 // block_h))  # rms_norm's tiles
        _rms_norm_quant_launch[(cdiv(n, block_n),)](
            x, residual, weight, x_q, x_s, res_out,
            x.stride(0), residual.stride(0), x_q.stride(0), x_s.stride(0), x_s.stride(1), res_out.stride(0),
            n, h, float(eps), float(quant_eps),
            HAS_RESIDUAL=res_out is not x, GROUP=group_size, BLOCK_N=block_n, BLOCK_H=block_h,
            num_warps=4 if block_n * block_h <= 4096 else 8, **pdl_launch_kwargs(x.device, n),
        )  # fmt: skip
    return (x_q, x_s) if res_out is x else (x_q, x_s, res_out)


# ----------------------------------------------------------------------------------------------
# SiLU-and-mul
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["N"])
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, N, I,
    BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows[:, None] < N) & (cols[None, :] < I)
    rows64 = rows.to(tl.int64)[:, None]
    gate = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + rows64 * stride_x + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # silu(g) = g * sigmoid(g)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rows64 * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


_silu_and_mul_launch = FastLaunch(_silu_and_mul_kernel)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2I] = [gate | up] -> silu(gate) * up, [N, I] in x's dtype."""
    check_silu_and_mul(x)
    x = _last_dim_contiguous(x)
    n, i = x.shape[0], x.shape[1] // 2
    out = torch.empty((n, i), dtype=x.dtype, device=x.device)
    if n > 0 and i > 0:
        # tiles of about 4K elements: several rows per program when I is small
        block_i = min(next_power_of_2(i), 2048)
        block_n = max(1, min(64, 4096 // block_i))
        grid = (cdiv(n, block_n), cdiv(i, block_i))
        scalars = (x.stride(0), out.stride(0), n, i)
        pdl = pdl_launch_kwargs(x.device, n)
        _silu_and_mul_launch.run(
            grid,
            (x, out, *scalars),
            lambda: dict(BLOCK_N=block_n, BLOCK_I=block_i, **pdl),
            key=(x.device, scalars[:2], i, pdl["USE_PDL"]),  # all but n; the blocks follow from i
        )
    return out


@triton.jit(do_not_specialize=["N"])
def _silu_and_mul_quant_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, stride_q, stride_sn, stride_sg, N, I, eps,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """a = silu(gate) * up rounded to x's dtype (what `_silu_and_mul_kernel` stores), then
    `fp8_gemm`'s per-token-group quantization of a: q = e4m3(a / s), s = max(amax |a|, eps) / 448
    over each row's GROUP-wide group (program (row tile, group))."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK_G)
    row_ok = rows < N
    mask = row_ok[:, None] & (tl.arange(0, BLOCK_G) < GROUP)[None, :]
    rows64 = rows.to(tl.int64)
    src = x_ptr + rows64[:, None] * stride_x + cols[None, :]
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + I, mask=mask, other=0.0).to(tl.float32)
    a = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    q, s = quantize_groups(a, eps)
    tl.store(q_ptr + rows64[:, None] * stride_q + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows64 * stride_sn + g * stride_sg, s, mask=row_ok)


_silu_and_mul_quant_launch = FastLaunch(_silu_and_mul_quant_kernel)


def silu_and_mul_per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int, *, eps: float = 1e-10, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, 2I] = [gate | up] -> (x_q [N, I] float8_e4m3fn, x_s [N, I // group_size] float32):
    `per_token_group_quant_fp8(silu_and_mul(x), group_size, ...)` (`tilellm.kernels.fp8_gemm`),
    the same bits in one launch, without silu_and_mul's output going through memory. The input of
    an FP8 down projection; `column_major_scales`: x_s with strides (1, N), as cuBLAS reads it.
    """
    check_silu_and_mul_quant(x, group_size, eps)
    x = _last_dim_contiguous(x)
    n, i = x.shape[0], x.shape[1] // 2
    x_q, x_s = group_quant_outputs(n, i, group_size, x.device, column_major_scales)
    if n > 0 and i > 0:
        block_g, block_n = group_quant_tile(group_size, n)  # per_token_group_quant_fp8's tiles
        _silu_and_mul_quant_launch[(cdiv(n, block_n), i // group_size)](
            x, x_q, x_s, x.stride(0), x_q.stride(0), x_s.stride(0), x_s.stride(1), n, i, float(eps),
            GROUP=group_size, BLOCK_G=block_g, BLOCK_N=block_n, num_warps=4,
        )  # fmt: skip
    return x_q, x_s


# ----------------------------------------------------------------------------------------------
# Rotary embedding (NeoX / "rotate_half" layout)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _rotate_rows(
    x_ptr, out_ptr, w_ptr, pos_ptr, cache_ptr, stride_xt, stride_xh, stride_ot, stride_oh, stride_cache,
    row0, num_rows, num_heads, half, eps,
    HAS_NORM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Rows row0..row0+BLOCK_R of x viewed as [T * H, D] (row = token * H + head):
    optionally x <- x * rsqrt(mean(x^2) + eps) * w, then
    [x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin] with the row's token's cos/sin; with
    INTERLEAVED, x1 and x2 are the row's even and odd dims (pairs (x0, x1), (x2, x3), ...), still
    stored as halves. Returns the two stored halves, in out's dtype ([BLOCK_R, BLOCK_HALF] each).

    Every load is issued before the first value is used: the positions, then x, the norm weights
    and the cos/sin rows (which wait only for the positions). At decode sizes a program's time is
    its chain of dependent memory round trips, not its bytes."""
    rows = row0 + tl.arange(0, BLOCK_R)  # int32: T * H is far below 2^31
    dims = tl.arange(0, BLOCK_HALF)
    row_ok = rows < num_rows
    dim_ok = dims < half
    mask = row_ok[:, None] & dim_ok[None, :]
    tok, head = (rows // num_heads).to(tl.int64), rows % num_heads
    pos = tl.load(pos_ptr + tok, mask=row_ok, other=0).to(tl.int64)
    src = x_ptr + tok[:, None] * stride_xt + head[:, None] * stride_xh + dims[None, :]
    if INTERLEAVED:
        src = src + dims[None, :]  # dim 2j and 2j + 1
        x1 = tl.load(src, mask=mask, other=0.0)
        x2 = tl.load(src + 1, mask=mask, other=0.0)
    else:
        x1 = tl.load(src, mask=mask, other=0.0)
        x2 = tl.load(src + half, mask=mask, other=0.0)
    if HAS_NORM:
        w_dims = 2 * dims if INTERLEAVED else dims  # the weights in the input's layout
        w1 = tl.load(w_ptr + w_dims, mask=dim_ok, other=0.0)
        w2 = tl.load(w_ptr + w_dims + (1 if INTERLEAVED else half), mask=dim_ok, other=0.0)
    # -- cos/sin of each row's position: cache row = [cos | sin] --
    cs = cache_ptr + pos[:, None] * stride_cache + dims[None, :]
    cos = tl.load(cs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cs + half, mask=mask, other=0.0).to(tl.float32)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        # -- per-head RMSNorm over the whole row [x1 | x2] --
        mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half)
        rstd = (1.0 / tl.sqrt(mean_sq + eps))[:, None]
        x1 = x1 * rstd * w1.to(tl.float32)[None, :]
        x2 = x2 * rstd * w2.to(tl.float32)[None, :]
    y1 = (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty)
    dst = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(dst, y1, mask=mask)
    tl.store(dst + half, y2, mask=mask)
    return y1, y2


@triton.jit
def _load_store_rows(
    v_ptr, slot_ptr, stride_vt, stride_vh, stride_cslot, row0, num_rows, num_heads, half,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Where rows row0..row0+BLOCK_R go in the cache and the v they store beside the rotated keys:
    (dst, mask, v1, v2), dst [BLOCK_R, BLOCK_HALF] the cache offsets of each row's first half
    (cache rows are [Hkv, D] contiguous), mask false for rows past the end and tokens of slot -1.
    v is loaded whatever the slot, so that its loads go out with the rotation's."""
    rows = row0 + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, BLOCK_HALF)
    row_ok = rows < num_rows
    tok, head = (rows // num_heads).to(tl.int64), rows % num_heads
    slot = tl.load(slot_ptr + tok, mask=row_ok, other=-1).to(tl.int64)
    in_v = row_ok[:, None] & (dims < half)[None, :]
    src = v_ptr + tok[:, None] * stride_vt + head[:, None] * stride_vh + dims[None, :]
    v1, v2 = tl.load(src, mask=in_v), tl.load(src + half, mask=in_v)
    dst = slot[:, None] * stride_cslot + head[:, None] * (2 * half) + dims[None, :]
    return dst, in_v & (slot >= 0)[:, None], v1, v2


@triton.jit
def _store_rows(
    k1, k2, v1, v2, dst, mask, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, half, QUANTIZE: tl.constexpr
):  # fmt: skip
    """The rotated k halves (k1, k2 [BLOCK_R, BLOCK_HALF] in k's dtype) and v's halves into the
    cache at `dst` where `mask` (`_load_store_rows`)."""
    k1, k2 = to_cache(k1, k_scale_ptr, QUANTIZE), to_cache(k2, k_scale_ptr, QUANTIZE)
    v1, v2 = to_cache(v1, v_scale_ptr, QUANTIZE), to_cache(v2, v_scale_ptr, QUANTIZE)
    tl.store(k_cache_ptr + dst, k1, mask=mask)
    tl.store(k_cache_ptr + dst + half, k2, mask=mask)
    tl.store(v_cache_ptr + dst, v1, mask=mask)
    tl.store(v_cache_ptr + dst + half, v2, mask=mask)


@triton.jit(
    do_not_specialize=["num_tokens", "num_q_programs"], do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"]
)
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, qw_ptr, kw_ptr, pos_ptr, cache_ptr,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache, stride_vt, stride_vh, stride_cslot,
    num_tokens, num_q_heads, num_k_heads, num_q_programs, half, eps,
    HAS_NORM: tl.constexpr, INTERLEAVED: tl.constexpr, STORE: tl.constexpr, QUANTIZE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """The first num_q_programs programs handle q's (token, head) rows, the rest k's; with STORE,
    a k program also writes its rotated rows and the same rows of v into the paged cache."""
    pdl_start(USE_PDL)
    pid = tl.program_id(0)
    if pid < num_q_programs:
        _rotate_rows(q_ptr, q_out_ptr, qw_ptr, pos_ptr, cache_ptr, stride_qt, stride_qh, stride_qot, stride_qoh,
                     stride_cache, pid * BLOCK_R, num_tokens * num_q_heads, num_q_heads, half, eps,
                     HAS_NORM=HAS_NORM, INTERLEAVED=INTERLEAVED, BLOCK_R=BLOCK_R,
                     BLOCK_HALF=BLOCK_HALF)  # fmt: skip
    else:
        row0 = (pid - num_q_programs) * BLOCK_R
        num_rows = num_tokens * num_k_heads
        if STORE:  # (issued before the rotation's loads: nothing waits for them until the store)
            dst, mask, v1, v2 = _load_store_rows(v_ptr, slot_ptr, stride_vt, stride_vh, stride_cslot, row0,
                                                 num_rows, num_k_heads, half, BLOCK_R=BLOCK_R,
                                                 BLOCK_HALF=BLOCK_HALF)  # fmt: skip
        k1, k2 = _rotate_rows(k_ptr, k_out_ptr, kw_ptr, pos_ptr, cache_ptr, stride_kt, stride_kh, stride_kot,
                              stride_koh, stride_cache, row0, num_rows, num_k_heads, half, eps,
                              HAS_NORM=HAS_NORM, INTERLEAVED=INTERLEAVED, BLOCK_R=BLOCK_R,
                              BLOCK_HALF=BLOCK_HALF)  # fmt: skip
        if STORE:
            _store_rows(k1, k2, v1, v2, dst, mask, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, half,
                        QUANTIZE=QUANTIZE)  # fmt: skip


_rotary_launch = FastLaunch(_rotary_kernel)


class _RotaryLaunch(NamedTuple):
    """`apply_rotary`'s launch for one layout of a call (every tensor's type, shape, strides,
    dtype and device, and the scalar arguments): what the checks passed and the planning found.
    A later eager call of that layout only allocates its outputs and launches (as the attention
    calls do, `paged._REMEMBERED`)."""

    grid: tuple[int]
    scalars: tuple  # the strides, token and head counts, programs of q, half the head dim, eps
    consts: dict  # the constexprs and launch options
    key: tuple  # `FastLaunch`'s key
    store: bool  # the rotated keys and v go to the paged cache
    quantize: bool  # ... an FP8 one, with scales
    unit: torch.Tensor | None  # 1.0 for an FP8 cache's scale not given

    def run(self, q, k, positions, cache, qw, kw, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
        """Launch over a call's tensors of the planned layout (`apply_rotary`'s arguments: q
        [T, Hq, D], k [T, Hkv, D], positions [T], cache [max_pos, D], the norm weights [D] or
        None, the store's v [T, Hkv, D], caches [blocks, page, Hkv, D], slot_mapping [T] and
        scales or None): (q_out [T, Hq, D], k_out [T, Hkv, D]), contiguous. The arguments the
        kernel does not read go as None (its binary was bound with None there)."""
        q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
        k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
        if not self.store:
            v = k_cache = v_cache = slot_mapping = None
        if not self.quantize:
            k_scale = v_scale = None
        elif self.unit is not None:
            k_scale = k_scale if k_scale is not None else self.unit
            v_scale = v_scale if v_scale is not None else self.unit
        _rotary_launch.run(
            self.grid,
            (q, k, q_out, k_out, qw, kw, positions, cache, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
             *self.scalars),
            self.consts,
            key=self.key,
        )  # fmt: skip
        return q_out, k_out


# The launches of eager `apply_rotary` calls by the call's layout (`validation.call_key`); only
# calls that copied no input are remembered (a copy's layout is not the argument's).
_ROTARY_REMEMBERED: dict[tuple, _RotaryLaunch] = {}


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    v: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX / HF "rotate_half" rotary embedding on q [T, Hq, D] and k [T, Hkv, D]; new tensors.

    cos_sin_cache [max_pos, D]: row p = [cos(p * f_0..f_{D/2-1}) | sin(p * f_0..f_{D/2-1})];
    positions [T] int32/int64 index its rows. With q_norm_weight and k_norm_weight [D] (Qwen3),
    each head is first RMS-normalised over D (eps) and scaled by its weight, in the same pass.
    q and k may be strided views (e.g. of a packed qkv projection) with a unit last-dim stride.

    With v, k_cache, v_cache and slot_mapping (and an FP8 cache's k_scale / v_scale), the same
    launch also does `store_kvcache(k_rotated, v, k_cache, v_cache, slot_mapping, ...)`: the
    rotated keys go to the paged cache from registers, one launch a layer instead of two.

    `interleaved`: q's and k's dims come in rotated pairs (x0, x1), (x2, x3), ... (DeepSeek's
    layout, GPT-J's), the norm weights too; the outputs are those of the call on q[..., perm],
    k[..., perm] and the weights [perm] with perm = [0, 2, ..., D - 2, 1, 3, ..., D - 1]: the
    pairs' halves in the NeoX layout, without the gathers.
    """
    tensors = (q, k, positions, cos_sin_cache, q_norm_weight, k_norm_weight, v, k_cache, v_cache, slot_mapping,
               k_scale, v_scale)  # fmt: skip
    call = validation.call_key("apply_rotary", tensors, (eps, interleaved))
    launch = validation.remembered(_ROTARY_REMEMBERED, call)
    if launch is not None and not validation.deep_checks_enabled(q):
        return launch.run(*tensors)
    check_apply_rotary(q, k, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps)
    store = check_rotary_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    args = (
        _last_dim_contiguous(q), _last_dim_contiguous(k), positions.contiguous(), _last_dim_contiguous(cos_sin_cache),
        q_norm_weight.contiguous() if q_norm_weight is not None else None,  # (None: unread)
        k_norm_weight.contiguous() if k_norm_weight is not None else None,
    )  # fmt: skip
    q, k, positions, cache, qw, kw = args
    t = q.shape[0]
    if t == 0:
        return (
            torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
        )
    launch = _plan_rotary(q, k, cache, v, k_cache, qw is not None, store, interleaved, eps, k_scale, v_scale)
    out = launch.run(q, k, positions, cache, qw, kw, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if all(a is b for a, b in zip(args, tensors)):
        validation.remember(_ROTARY_REMEMBERED, call, launch)
    return out


def _plan_rotary(
    q, k, cache, v, k_cache, has_norm, store, interleaved, eps, k_scale, v_scale
) -> _RotaryLaunch:
    """The rotary kernel's launch for these checked, last-dim contiguous tensors (q [T, Hq, D],
    k [T, Hkv, D], cache [max_pos, D]; v and k_cache as `apply_rotary`'s, read only to `store`),
    T > 0. `eps` is read here, once per layout: pass a float."""
    t, hq, d = q.shape
    hk = k.shape[1]
    quantize = store and is_fp8(k_cache)
    store_strides = (v.stride(0), v.stride(1), k_cache.stride(1)) if store else (0, 0, 0)  # (0: unread)
    half = d // 2
    block_half = next_power_of_2(half)
    # (token, head) rows per program: half-row tiles of about 2K elements
    block_r = max(1, min(256, 2048 // block_half))
    num_q_programs = cdiv(t * hq, block_r)
    # the outputs are new and contiguous: [T, H, D] strides
    scalars = (
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), hq * d, d, hk * d, d, cache.stride(0), *store_strides,
        t, hq, hk, num_q_programs, half, float(eps),
    )  # fmt: skip
    unit = unit_scale(k.device) if quantize and (k_scale is None or v_scale is None) else None
    pdl = pdl_launch_kwargs(q.device, t)
    return _RotaryLaunch(
        grid=(num_q_programs + cdiv(t * hk, block_r),),
        scalars=scalars,
        consts=dict(
            HAS_NORM=has_norm, INTERLEAVED=bool(interleaved), STORE=store, QUANTIZE=quantize, BLOCK_R=block_r,
            BLOCK_HALF=block_half, **pdl,
        ),
        # all but the token counts; the blocks follow from half
        key=LaunchKey(
            (q.device, has_norm, bool(interleaved), store, quantize, scalars[:12], hq, hk, half, pdl["USE_PDL"])
        ),
        store=store,
        quantize=quantize,
        unit=unit,
    )  # fmt: skip
