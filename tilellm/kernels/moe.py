"""Fused mixture-of-experts layer (the routed experts of DeepSeek-V2/V3, Qwen3-MoE) in Triton.

    out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x_t) * (w13[e, I:] @ x_t)),
    e = topk_ids[t, k]

Shapes: hidden_states x [T, H]; w13 [E, 2I, H] (rows [0, I) gate_proj, [I, 2I) up_proj: HF's fused
gate_up_proj); w2 [E, H, I] (down_proj); topk_weights [T, K] float32; topk_ids [T, K] int. A
tensor-parallel rank passes its shard of I (both halves of w13, the columns of w2) and all-reduces
the partial sums itself. The design is vLLM's / SGLang's fused_moe: the T*K (token, k) pairs, pair
p = t * K + k, are grouped by expert so that each program multiplies a block of rows that all
belong to one expert by that expert's weights.

1. `moe_align_block_size` (torch ops on the device, no host sync, so CUDA graphs can capture it):
   sorted_token_ids [max_padded] int32 lists the pairs expert by expert, each expert's group
   padded with the invalid pair T*K to a multiple of block_m; expert_ids [max_blocks] int32 is
   the expert of each block of block_m entries; num_tokens_post_padded [1] int32 the padded total.
   The buffers are sized by the bound max_padded = T*K + min(E, T*K) * (block_m - 1) (at most
   min(E, T*K) experts receive pairs, each pads by block_m - 1 at most), known on the host.
2. `_fused_moe_kernel`, GATED: inter [T*K, I] = silu(x[p // K] @ w13[e, :I]^T) * (x[p // K] @ w13[e, I:]^T).
   One program = one block of block_m sorted pairs x one tile of BLOCK_N intermediate columns; it
   walks H in BLOCK_K steps with two fp32 accumulators (gate rows n, up rows I + n of the same
   expert), applies SiLU-and-mul in the epilogue and writes row p of inter (in x's dtype).
3. `_fused_moe_kernel` again, with the routing weight: down [T*K, H] = topk_weights[p] *
   (inter[p] @ w2[e]^T), scaled in fp32 before rounding to x's dtype. With K = 1 the rows are the
   tokens and it writes `out` directly.
4. `_moe_sum_kernel`: out [T, H] = sum_k down[t * K + k] in fp32, rounded once to x's dtype.

Grid of both GEMMs: cdiv(max_padded, block_m) x cdiv(N, BLOCK_N) programs, fixed by T, K, E and
the config; programs whose block starts past num_tokens_post_padded (the bound's slack) return at
once. Program ids walk GROUP_M row blocks across all column tiles before moving on (the
L2-friendly order of Triton's matmul tutorial). Experts that receive no pair own no block.

Block-quantized FP8 experts (DeepSeek-V3's checkpoints; vLLM's `use_fp8_w8a8` with a
`block_shape`): w13 and w2 are float8_e4m3fn with one fp32 scale per [bn, bk] block (w13_scale
[E, cdiv(2I, bn), cdiv(H, bk)], w2_scale [E, cdiv(H, bn), cdiv(I, bk)]; dequantized weight =
stored * its block's scale). Each GEMM's input (x for the first, inter for the second) is
quantized per token and per group of bk channels (`per_token_group_quant_fp8`: a_q fp8, a_s
[rows, K / bk]), and each output element is the block-scaled W8A8 product

    C[p, n] = sum_kb a_s[p, kb] * w_s[e, n // bn, kb] * (a_q[p, kb-th bk slice] . w_q[e, n, same slice])

accumulated in fp32: BLOCK_K = bk, so one k step is one scale block, its fp8 x fp8 `tl.dot` is
scaled by the a_s column and the w_s entries of that block and added to the accumulator (on
Hopper the MMA's own accumulation then never spans more than bk products). BLOCK_N is a power
of two dividing bn (at most 64 for the gated GEMM on the GPU, whose four live fp32 tiles spill at
128 columns). The epilogues are the bf16 path's; inter stays in x's dtype and is quantized
between the GEMMs, as vLLM does. A constexpr selects the path, so the bf16 kernel is unchanged.
Static activations (per-tensor checkpoints with `activation_scheme: "static"`; vLLM's a1_scale /
a2_scale): x and inter are each quantized by one calibrated scale (`scaled_fp8_quant`), which
the kernel reads as an a_s of strides (0, 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tilellm.kernels import validation
from tilellm.kernels.config import cdiv, dot_precision, interpreting, next_power_of_2
from tilellm.kernels.fp8 import is_fp8
from tilellm.kernels.launch import FastLaunch


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # sorted pairs per program (one expert each); the alignment of moe_align_block_size
    block_n: int  # output columns per program (for the gated GEMM: gate and up columns each)
    block_k: int  # reduction step (H for the first GEMM, I for the second)
    group_m: int  # row blocks per L2 group of the program order
    num_warps: int
    num_stages: int


# Tiles by the average number of pairs per expert, T * K / E: that is the row count of an
# expert's GEMM, so it decides how much of a block_m block is padding. Decode (a few rows per
# expert) reads every touched expert's weights once and is bandwidth bound: 16-row blocks (the
# smallest tl.dot) keep the padding low and long BLOCK_K loads keep bytes in flight. As rows per
# expert grow the GEMMs become compute bound: 64/128-row blocks reuse each weight tile across
# more rows and let Hopper's warpgroup MMA (64 rows per warpgroup) run at full width. Shared
# memory per stage (gated GEMM, bf16): (block_m + 2 * block_n) * block_k * 2 bytes, <= 48 KiB,
# so 3 stages fit in an H200's 227 KiB. Starting points near vLLM's tuned H200 tables for
# these shapes (whose first GEMM is unfused: one [block_n, block_k] weight tile where ours reads
# two), not yet swept on the GPU: `tilellm.bench.moe` times them.
#   max rows/expert  block_m block_n block_k group_m warps stages
MOE_CONFIGS = (
    (16, MoeConfig(16, 64, 128, 1, 4, 3)),
    (64, MoeConfig(32, 64, 128, 8, 4, 3)),
    (256, MoeConfig(64, 128, 64, 8, 4, 3)),
    (None, MoeConfig(128, 128, 64, 8, 8, 3)),
)


def moe_config(num_tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    """The tile config for T tokens routed to K of E experts (see MOE_CONFIGS)."""
    rows_per_expert = num_tokens * top_k / num_experts
    for limit, cfg in MOE_CONFIGS:
        if limit is None or rows_per_expert <= limit:
            return cfg
    raise AssertionError("unreachable: the last entry has no limit")


# ----------------------------------------------------------------------------------------------
# Alignment: the (token, k) pairs grouped by expert, each group padded to a multiple of block_m
# ----------------------------------------------------------------------------------------------


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups the pairs p = t * K + k of topk_ids [T, K] by expert, each group padded to block_m.

    Returns (sorted_token_ids [max_padded] int32, expert_ids [max_blocks] int32,
    num_tokens_post_padded [1] int32), max_padded = T*K + min(E, T*K) * (block_m - 1) and
    max_blocks = cdiv(max_padded, block_m). Within an expert the pairs keep their order; padding
    entries (and everything past num_tokens_post_padded) are T*K. expert_ids[b] is the expert of
    entries [b * block_m, (b + 1) * block_m); blocks past num_tokens_post_padded hold E. Torch ops
    only, no host sync; ids must lie in [0, E) (checked by `fused_moe` under TILELLM_DEBUG=1).
    """
    flat = topk_ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    max_padded = n + min(num_experts, n) * (block_m - 1)
    max_blocks = cdiv(max_padded, block_m)
    # scatter_add_, not bincount: CUDA's bincount reads max(ids) on the host
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    # -- pair order[j] goes to its expert's padded start + its rank among that expert's pairs --
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[experts]
    dest = (padded_end - padded)[experts] + rank
    sorted_token_ids = torch.full((max_padded,), n, dtype=torch.int32, device=dev)
    sorted_token_ids.scatter_(0, dest, order.to(torch.int32))
    # -- block b starts at entry b * block_m: its expert is the first whose padded end lies past it --
    block_starts = torch.arange(max_blocks, device=dev) * block_m
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    num_tokens_post_padded = padded_end[-1:].to(torch.int32)
    return sorted_token_ids, expert_ids, num_tokens_post_padded


# ----------------------------------------------------------------------------------------------
# Grouped GEMM over the sorted pairs
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _fused_moe_kernel(
    A, B, C, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
    A_scale, B_scale,
    N, K, num_pairs, num_blocks_m,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_SCALED: tl.constexpr, GROUP_N: tl.constexpr,
    UPCAST_FP8: tl.constexpr,
):  # fmt: skip
    """C[p, :N] = A[p // A_ROW_DIV] @ B[e, :N]^T for the block's sorted pairs p of expert e.

    A [rows, K], B [E, N (x2 if GATED), K], C [num_pairs, N]. GATED: B holds N gate rows then N
    up rows and C = silu(A @ gate^T) * (A @ up^T). MUL_ROUTED_WEIGHT: C rows scaled by topk_weights[p].
    BLOCK_SCALED: A and B are fp8 with A_scale [rows, K / BLOCK_K] (one per row and k step) and
    B_scale [E, cdiv(N (x2 if GATED), GROUP_N), K / BLOCK_K] (one per GROUP_N rows and k step);
    each k step's dot is scaled by both before it is accumulated. UPCAST_FP8: the fp8 tiles go
    through fp32 first (the CPU interpreter has no fp8 dot). Otherwise A_scale / B_scale and
    their strides are unused.
    """
    # -- program id -> (row block, column tile), GROUP_M row blocks at a time --
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_m = (pid // pids_per_group) * GROUP_M
    group_size = min(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_per_group) % group_size
    pid_n = (pid % pids_per_group) // group_size
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded):
        return  # past the padded total: the slack of the grid's upper bound

    # -- the block's pairs (padding = num_pairs) and its expert --
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_token_ids + offs_m)
    pair_ok = pairs < num_pairs
    expert = tl.load(expert_ids + pid_m).to(tl.int64)
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_bn = offs_n % N  # wrapped columns past N load valid rows and are never stored
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = (
        B + expert * stride_be + offs_bn[None, :] * stride_bn + offs_k[:, None] * stride_bk
    )  # [BLOCK_K, BLOCK_N]

    # -- acc [BLOCK_M, BLOCK_N] = A rows @ B[e]^T over K (for GATED, the up rows into acc_up) --
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BLOCK_SCALED:
        # per-row activation scales and per-column weight scales of k step 0 (the columns of a
        # tile share one block row of w_s when BLOCK_N divides GROUP_N, but the up rows N + n
        # need not start on a block boundary, so both are gathered per column)
        as_ptrs = A_scale + a_rows * stride_asm
        bs_ptrs = B_scale + expert * stride_bse + (offs_bn // GROUP_N) * stride_bsn
        bs_up_ptrs = B_scale + expert * stride_bse + ((offs_bn + N) // GROUP_N) * stride_bsn
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if BLOCK_SCALED:
            a_s = tl.load(as_ptrs + k * stride_ask, mask=pair_ok, other=0.0)
            b_s = tl.load(bs_ptrs + k * stride_bsk)
            acc += _fp8_dot(a, b, UPCAST_FP8) * a_s[:, None] * b_s[None, :]
            if GATED:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None], other=0.0)
                b_up_s = tl.load(bs_up_ptrs + k * stride_bsk)
                acc_up += _fp8_dot(a, b_up, UPCAST_FP8) * a_s[:, None] * b_up_s[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if GATED:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None], other=0.0)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # -- epilogue in fp32: SiLU-and-mul or the routing weight, one rounding to C's dtype --
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up  # silu(g) = g * sigmoid(g)
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights + pairs, mask=pair_ok, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = C + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=pair_ok[:, None] & (offs_n < N)[None, :])


_fused_moe_launch = FastLaunch(_fused_moe_kernel)


@triton.jit
def _fp8_dot(a, b, UPCAST: tl.constexpr):
    """a [M, K] @ b [K, N] of fp8 tiles, in fp32 (a fresh accumulator: the caller scales it)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit(do_not_specialize=["T"])
def _moe_sum_kernel(
    X, Out, T, H, stride_xt, stride_xk, stride_ot,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Out[t] = sum_k X[t, k] for X [T, K, H], in fp32, rounded once to Out's dtype."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = (rows < T)[:, None] & (cols < H)[None, :]
    x_ptrs = X + rows.to(tl.int64)[:, None] * stride_xt + cols[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(x_ptrs + k * stride_xk, mask=ok, other=0.0).to(tl.float32)
    o_ptrs = Out + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=ok)


_moe_sum_launch = FastLaunch(_moe_sum_kernel)


# ----------------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------------


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: list[int] | tuple[int, int] | None = None,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts of a MoE layer, no host sync (CUDA-graph safe).

    Args:
        hidden_states: [T, H] float32/float16/bfloat16.
        w13: [E, 2I, H], hidden dtype or float8_e4m3fn: rows [0, I) gate_proj, rows [I, 2I) up_proj.
        w2: [E, H, I], w13's dtype: down_proj of each expert.
        topk_weights: [T, K] float32 routing weights (already normalised / scaled by the router).
        topk_ids: [T, K] int32/int64 expert ids in [0, E).
        out: optional [T, H] output buffer (hidden dtype, last dim contiguous).
        w13_scale: with fp8 experts, [E, cdiv(2I, bn), cdiv(H, bk)] float32, one per [bn, bk]
            block of w13 (checkpoints' `weight_scale_inv`: dequantized = stored * scale).
        w2_scale: with fp8 experts, [E, cdiv(H, bn), cdiv(I, bk)] float32, w2's block scales.
        block_shape: with fp8 experts, [bn, bk]: bn a multiple of 16, bk a power of two >= 16
            dividing H and I (activations are quantized per token in groups of bk channels).
        a1_scale, a2_scale: with fp8 experts, static activation scales (one float32 element
            each, both or neither): x quantized by a1_scale, the SiLU-and-mul output by a2_scale,
            instead of per token and group.

    Returns out [T, H] = sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x_t) * (w13[e, I:] @ x_t)),
    with fp8 experts the block-scaled W8A8 form of it (module docstring).
    """
    check_fused_moe(
        hidden_states, w13, w2, topk_weights, topk_ids, out,
        w13_scale=w13_scale, w2_scale=w2_scale, block_shape=block_shape,
        a1_scale=a1_scale, a2_scale=a2_scale,
    )  # fmt: skip
    T, H = hidden_states.shape
    E, I, K = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    dtype, dev = hidden_states.dtype, hidden_states.device
    if out is None:
        out = torch.empty((T, H), dtype=dtype, device=dev)
    if T * K == 0:
        return out.zero_()
    cfg = moe_config(T, K, E)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, E, cfg.block_m)
    routing = (topk_weights.reshape(-1), sorted_ids, expert_ids, num_post)
    inter = torch.empty((T * K, I), dtype=dtype, device=dev)
    down = out if K == 1 else torch.empty((T * K, H), dtype=dtype, device=dev)
    if is_fp8(w13):
        static = None if a1_scale is None else (a1_scale, a2_scale)
        _fp8_gemms(
            hidden_states, w13, w2, w13_scale, w2_scale, tuple(block_shape), inter, down, routing, cfg, static
        )
    else:
        _grouped_gemm(hidden_states, w13, inter, routing, cfg, a_row_div=K, gated=True)
        _grouped_gemm(inter, w2, down, routing, cfg, a_row_div=1, mul_routed_weight=True)
    if K > 1:
        _moe_sum(down.view(T, K, H), out)
    return out


def _fp8_gemms(
    x,
    w13,
    w2,
    w13_scale,
    w2_scale,
    block_shape,
    inter,
    down,
    routing,
    cfg: MoeConfig,
    static: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """The two grouped GEMMs on block-quantized experts, each input quantized per token-group of
    bk, or by its static scale (`static` = (a1_scale, a2_scale))."""
    # imported here: fp8_gemm imports the reference package, whose __init__ imports the twin of
    # this module, which imports this module's checks
    from tilellm.kernels.fp8_gemm import (
        broadcast_input_scale,
        per_token_group_quant_fp8,
        scaled_fp8_quant,
    )

    def quantize(a, static_scale):  # a [rows, K] -> (a_q fp8, a_s [rows, K / bk])
        if static_scale is None:
            return per_token_group_quant_fp8(a, bk)
        a_q, scale = scaled_fp8_quant(a, static_scale)
        return a_q, broadcast_input_scale(scale, a.shape[0], a.shape[1] // bk)

    a1_scale, a2_scale = static or (None, None)
    bk, top_k = block_shape[1], inter.shape[0] // x.shape[0]
    x_q, x_s = quantize(x, a1_scale)  # [T, H] fp8, [T, H / bk]
    scales = (x_s, w13_scale, block_shape)
    _grouped_gemm(x_q, w13, inter, routing, cfg, a_row_div=top_k, gated=True, scales=scales)
    inter_q, inter_s = quantize(inter, a2_scale)  # [T*K, I] fp8, [T*K, I / bk]
    scales = (inter_s, w2_scale, block_shape)
    _grouped_gemm(inter_q, w2, down, routing, cfg, a_row_div=1, mul_routed_weight=True, scales=scales)


def _grouped_gemm(
    a, w, c, routing, cfg: MoeConfig, *, a_row_div: int, gated=False, mul_routed_weight=False, scales=None
):
    """c [pairs, N] = a[pair // a_row_div] @ w[e]^T (see `_fused_moe_kernel`); N = c.shape[1].

    scales: None, or (a_scale [rows, K / bk], w_scale [E, cdiv(rows of w, bn), cdiv(K, bk)],
    (bn, bk)) for fp8 a and w.
    """
    topk_weights, sorted_ids, expert_ids, num_post = routing
    n, k = c.shape[1], a.shape[1]
    # Tiles no wider than the problem (tiny test models have H, I of 16..64); tl.dot needs >= 16.
    block_n = max(16, min(cfg.block_n, next_power_of_2(n)))
    block_k = max(16, min(cfg.block_k, next_power_of_2(k)))
    if a.element_size() == 4 and not interpreting():
        block_k = max(16, block_k // 2)  # fp32 operands: the same shared memory per stage as bf16
    if scales is None:
        # unused by the kernel (BLOCK_SCALED=False): any tensor for the pointers, zero strides
        a_scale = w_scale = topk_weights
        scale_strides, group_n = (0, 0, 0, 0, 0), 1
    else:
        a_scale, w_scale, (group_n, block_k) = scales  # one k step per scale block
        block_n = min(block_n, group_n & -group_n)  # a power of two dividing bn
        if gated and not interpreting():
            # four live [block_m, block_n] fp32 tiles (gate and up accumulators, each k step's two
            # scaled dots): 64 columns keep them in 128 registers a thread where 128 spill (sm_90a)
            block_n = min(block_n, 64)
        scale_strides = (a_scale.stride(0), a_scale.stride(1), *w_scale.stride())
    num_blocks_m = expert_ids.numel()
    grid = (num_blocks_m * cdiv(n, block_n),)
    _fused_moe_launch[grid](
        a, w, c, topk_weights, sorted_ids, expert_ids, num_post, a_scale, w_scale,
        n, k, topk_weights.numel(), num_blocks_m,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        *scale_strides,
        A_ROW_DIV=a_row_div, GATED=gated, MUL_ROUTED_WEIGHT=mul_routed_weight,
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m,
        PRECISION=dot_precision(a.dtype), BLOCK_SCALED=scales is not None, GROUP_N=group_n,
        UPCAST_FP8=interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _moe_sum(down: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, H] = down [T, K, H] summed over K; tiles of about 4K elements."""
    T, K, H = down.shape
    block_h = min(1024, next_power_of_2(H))
    block_t = min(max(1, 4096 // block_h), next_power_of_2(T))
    grid = (cdiv(T, block_t), cdiv(H, block_h))
    _moe_sum_launch[grid](
        down, out, T, H, down.stride(0), down.stride(1), out.stride(0),
        TOP_K=K, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Input checks (shared with the PyTorch twin)
# ----------------------------------------------------------------------------------------------


def check_fused_moe(
    hidden_states, w13, w2, topk_weights, topk_ids, out, name: str = "fused_moe",
    *, w13_scale=None, w2_scale=None, block_shape=None, a1_scale=None, a2_scale=None,
) -> None:  # fmt: skip
    """Shapes, dtypes and devices of `fused_moe`'s arguments; expert ids in range under deep checks.

    Layouts: hidden_states [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights / topk_ids [T, K];
    with float8_e4m3fn experts also block_shape [bn, bk], w13_scale [E, cdiv(2I, bn), cdiv(H, bk)]
    and w2_scale [E, cdiv(H, bn), cdiv(I, bk)] float32.
    """
    _check_tensor(name, "hidden_states", hidden_states, 2, "[T, H]")
    _check_tensor(name, "w13", w13, 3, "[E, 2 * I, H]")
    _check_tensor(name, "w2", w2, 3, "[E, H, I]")
    _check_tensor(name, "topk_weights", topk_weights, 2, "[T, K]")
    _check_tensor(name, "topk_ids", topk_ids, 2, "[T, K]")
    _check_dtypes(name, hidden_states, w13, w2, topk_weights, topk_ids)
    _check_devices(name, hidden_states, w13, w2, topk_weights, topk_ids)
    _check_shapes(name, hidden_states, w13, w2, topk_weights, topk_ids)
    _check_block_scales(name, hidden_states, w13, w13_scale, w2_scale, block_shape)
    _check_static_scales(name, hidden_states, w13, a1_scale, a2_scale)
    T, H = hidden_states.shape
    if out is not None:
        validation.check_out(name, out, (T, H), hidden_states.dtype, hidden_states.device)
    if topk_ids.numel() and validation.deep_checks_enabled(topk_ids):
        _check_ids_in_range(name, topk_ids, w13.shape[0])


def _check_tensor(name, arg, t, ndim, layout) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: {arg} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: {arg} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def _check_dtypes(name, hidden_states, w13, w2, topk_weights, topk_ids) -> None:
    if hidden_states.dtype not in validation.FLOAT_DTYPES:
        raise ValueError(
            f"{name}: hidden_states must be float16, bfloat16 or float32, got {hidden_states.dtype}"
        )
    if is_fp8(w13) or is_fp8(w2):
        if w13.dtype != w2.dtype:
            raise ValueError(
                f"{name}: w2 dtype {w2.dtype} differs from w13 dtype {w13.dtype} "
                "(block-quantized experts have both in float8_e4m3fn)"
            )
    else:
        for arg, w in (("w13", w13), ("w2", w2)):
            if w.dtype != hidden_states.dtype:
                raise ValueError(
                    f"{name}: {arg} dtype {w.dtype} differs from hidden_states dtype {hidden_states.dtype}"
                )
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"{name}: topk_weights must be float32, got {topk_weights.dtype}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: topk_ids must be int32 or int64, got {topk_ids.dtype}")


def _check_devices(name, hidden_states, w13, w2, topk_weights, topk_ids) -> None:
    others = {"w13": w13, "w2": w2, "topk_weights": topk_weights, "topk_ids": topk_ids}
    for arg, t in others.items():
        if t.device != hidden_states.device:
            raise ValueError(f"{name}: {arg} is on {t.device} but hidden_states is on {hidden_states.device}")


def _check_shapes(name, hidden_states, w13, w2, topk_weights, topk_ids) -> None:
    T, H = hidden_states.shape
    E, two_i, w13_h = w13.shape
    if E < 1:
        raise ValueError(f"{name}: w13 [E, 2 * I, H] needs at least one expert, got shape {tuple(w13.shape)}")
    if two_i < 2 or two_i % 2:
        raise ValueError(
            f"{name}: w13 [E, 2 * I, H] must have an even, positive dim 1 (gate rows then up rows), "
            f"got shape {tuple(w13.shape)}"
        )
    if w13_h != H:
        raise ValueError(f"{name}: w13 [E, 2 * I, H] has H = {w13_h}, but hidden_states [T, H] has H = {H}")
    expected_w2 = (E, H, two_i // 2)
    if tuple(w2.shape) != expected_w2:
        raise ValueError(
            f"{name}: w2 must be [E, H, I] = {expected_w2} (E, I from w13 [E, 2 * I, H], H from hidden_states), "
            f"got {tuple(w2.shape)}"
        )
    if topk_ids.shape[0] != T:
        raise ValueError(
            f"{name}: topk_ids [T, K] must have T = {T} rows (one per token), got {topk_ids.shape[0]}"
        )
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"{name}: topk_weights [T, K] shape {tuple(topk_weights.shape)} must equal topk_ids shape "
            f"{tuple(topk_ids.shape)}"
        )


def _check_static_scales(name, hidden_states, w13, a1_scale, a2_scale) -> None:
    """Static activation scales: both or neither, fp8 experts only, one float32 element each."""
    if a1_scale is None and a2_scale is None:
        return
    if not is_fp8(w13):
        raise ValueError(f"{name}: a1_scale / a2_scale are only for float8_e4m3fn experts, got {w13.dtype}")
    if a1_scale is None or a2_scale is None:
        raise ValueError(
            f"{name}: static activations need both a1_scale (the experts' input) and a2_scale "
            "(the SiLU-and-mul output); give both or neither"
        )
    for arg, scale in (("a1_scale", a1_scale), ("a2_scale", a2_scale)):
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
            got = (
                f"{scale.dtype} of shape {tuple(scale.shape)}"
                if isinstance(scale, torch.Tensor)
                else type(scale).__name__
            )
            raise ValueError(f"{name}: {arg} must be a float32 tensor of one element, got {got}")
        if scale.device != hidden_states.device:
            raise ValueError(
                f"{name}: {arg} is on {scale.device} but hidden_states is on {hidden_states.device}"
            )


def _check_block_scales(name, hidden_states, w13, w13_scale, w2_scale, block_shape) -> None:
    """fp8 experts need block_shape and both scale tensors; other experts take none of them."""
    given = {"w13_scale": w13_scale, "w2_scale": w2_scale, "block_shape": block_shape}
    if not is_fp8(w13):
        for arg, value in given.items():
            if value is not None:
                raise ValueError(
                    f"{name}: {arg} is only for float8_e4m3fn experts, but w13 and w2 are {w13.dtype}"
                )
        return
    if block_shape is None:
        raise ValueError(
            f"{name}: block_shape [bn, bk] is required with float8_e4m3fn w13 / w2 "
            "(the block of weights each w13_scale / w2_scale entry scales)"
        )
    bn, bk = check_block_shape(name, block_shape)
    H, E, I = hidden_states.shape[1], w13.shape[0], w13.shape[1] // 2
    for dim, size in (("H", H), ("I", I)):
        if size % bk:
            raise ValueError(
                f"{name}: {dim} = {size} must be a multiple of block_shape[1] = {bk} "
                "(each GEMM's input is quantized per token in groups of bk channels)"
            )
    for arg, scale, rows, cols, layout in (
        ("w13_scale", w13_scale, 2 * I, H, "[E, cdiv(2 * I, bn), cdiv(H, bk)]"),
        ("w2_scale", w2_scale, H, I, "[E, cdiv(H, bn), cdiv(I, bk)]"),
    ):
        if scale is None:
            raise ValueError(f"{name}: {arg} {layout} float32 is required with float8_e4m3fn w13 / w2")
        _check_tensor(name, arg, scale, 3, layout)
        if scale.dtype != torch.float32:
            raise ValueError(f"{name}: {arg} must be float32, got {scale.dtype}")
        if scale.device != hidden_states.device:
            raise ValueError(
                f"{name}: {arg} is on {scale.device} but hidden_states is on {hidden_states.device}"
            )
        expected = (E, cdiv(rows, bn), cdiv(cols, bk))
        if tuple(scale.shape) != expected:
            raise ValueError(
                f"{name}: {arg} must be {layout} = {expected} for block_shape [{bn}, {bk}], "
                f"got {tuple(scale.shape)}"
            )


def check_block_shape(name, block_shape) -> tuple[int, int]:
    """(bn, bk): bn a multiple of 16 (column tiles divide it), bk a power of two >= 16 (one k step)."""
    ok = isinstance(block_shape, list | tuple | torch.Size) and len(block_shape) == 2
    ok = ok and all(isinstance(b, int) and not isinstance(b, bool) for b in block_shape)
    if not ok:
        raise ValueError(f"{name}: block_shape must be two ints [bn, bk], got {block_shape!r}")
    bn, bk = block_shape
    if bn < 16 or bn % 16:
        raise ValueError(f"{name}: block_shape[0] (bn) must be a positive multiple of 16, got {bn}")
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"{name}: block_shape[1] (bk) must be a power of two >= 16, got {bk}")
    return bn, bk


def _check_ids_in_range(name, topk_ids, num_experts) -> None:
    ids = topk_ids.cpu().long()
    bad = (ids < 0) | (ids >= num_experts)
    if bool(bad.any()):
        t, k = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{name}: topk_ids[{t}, {k}] = {int(ids[t, k])} is out of range [0, {num_experts}) (E from w13)"
        )
