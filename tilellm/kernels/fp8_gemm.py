"""Block-scaled FP8 (e4m3) W8A8 GEMM in Triton, as DeepSeek-V3 / Qwen3-FP8 checkpoints need it.

A linear layer y = x @ W^T with W [N, K] stored as e4m3 values and one fp32 scale per
[bn, bk] = [128, 128] block (`weight_scale_inv`), and x quantized on the fly with one scale per
token and bk-wide group of channels. With j the k-block index (channels [j * bk, (j + 1) * bk)):

    x_s[m, j] = max(amax_{k in j} |x[m, k]|, eps) / 448,    x_q[m, k] = e4m3(x[m, k] / x_s[m, j])
    C[m, n]   = sum_j a_s[m, j] * b_s[n // bn, j] * sum_{k in j} a[m, k] * b[n, k]

1. `per_token_group_quant_fp8`: one program per BLOCK_M rows x one group. It loads the group in
   fp32, takes its amax, and divides with IEEE rounding (`tl.div_rn`: Triton's `/` on fp32 is an
   approximate division on the GPU) before the saturating cast `to_fp8`, so x_q and x_s are
   bit-identical to the PyTorch twin's.
2. `w8a8_block_fp8_matmul`: one program per BLOCK_M x BLOCK_N tile of C, BLOCK_K = bk, and
   BLOCK_N a divisor of bn, so the tile's columns share one row of b_s. It walks the K // bk
   k-blocks; each step is one fp8 x fp8 `tl.dot` into a fresh fp32 partial, multiplied by
   a_s[rows, j] * b_s[n-block, j] and added to the fp32 accumulator (DeepSeek-V3's scheme: the
   tensor cores' fp8 accumulation, which keeps fewer bits than fp32, never runs past one k-block).
   C is rounded once to `output_dtype`. Decode-sized steps split the k-blocks into runs
   (`split_k`), each its own program writing fp32 partials that `_split_k_sum_kernel` adds in
   order; `w8a8_block_fp8_linear` quantizes the activations inside the same kernel. Program ids walk GROUP_M row tiles across all column tiles
   before moving on (the L2-friendly order of Triton's matmul tutorial); rows and columns past M
   and N load wrapped, valid rows and are never stored. From `GLUON_MIN_TOKENS` tokens on Hopper
   the product runs `fp8_gemm_hopper.py` instead (Gluon: a producer warp and two consumer
   warpgroups, each scaling one k-block's product while the tensor cores run its next one),
   where it takes the operands.
Static activations (per-tensor checkpoints with `activation_scheme: "static"`): one calibrated
scale s (the layer's `input_scale`) stands for every x_s[m, j]. `scaled_fp8_quant(x, s)` writes
x_q = e4m3(x / s), saturated at +-448, and the GEMM reads a_s as s broadcast (strides (0, 0));
`w8a8_block_fp8_linear(..., input_scale=s)` quantizes x with s as it loads it (STATIC_A).

3. `scaled_mm_block_fp8`: the same product through `torch.nn.functional.scaled_mm` (cuBLASLt's
   block-scaled GEMM, "BlockWise1x128" activations x "BlockWise128x128" weights; sm_90 only),
   which FP8 linear layers run from 256 tokens a step (`tilellm.models.quantization`), and
   `benchmarks/fp8_gemm.py` compares.
4. `scaled_mm_fp8`: one activation scale and one weight scale per tensor or per output row (a
   per-tensor checkpoint's static layers), where the scales leave the sum:
   C = (a @ b^T) * s_a * s_b[n], through `torch._scaled_mm` (cuBLASLt's tensor-wise GEMM, or
   torch's row-wise GEMM on sm_90: cuBLASLt's or CUTLASS's, as torch was built).

The PyTorch twins, and the input checks both sides share, are in
`tilellm.kernels.reference.fp8_gemm`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tilellm.kernels.config import cdiv, gluon_module_ok, interpreting, launch_gluon, next_power_of_2, num_sms
from tilellm.kernels.fp8 import FP8_DTYPE, FP8_MAX_C, quantize_groups, to_fp8
from tilellm.kernels.fp8_gemv import fp8_gemv_quantizes_x, fp8_gemv_runs, launch_fp8_gemv
from tilellm.kernels.launch import FastLaunch
from tilellm.kernels.reference.fp8_gemm import (
    broadcast_input_scale,
    check_block_fp8_matmul,
    check_input_scale,
    check_per_token_group_quant,
    check_scaled_fp8_quant,
    check_scaled_mm_fp8,
    dynamic_per_tensor_scale,
)

# From this many tokens a step on Hopper runs the Gluon kernel of `fp8_gemm_hopper.py` (on an
# H100 at 1024 and 4096 tokens 1.29-1.61x the Triton kernel's speed on every Qwen3-0.6B and 8B
# layer; at 256 tokens the two were within each other's noise or the Triton kernel was faster).
GLUON_MIN_TOKENS = 1024
GLUON_MODULE = "fp8_gemm_hopper"


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The kernels' output allocations (the tests swap in NaN-filled ones, so unwritten outputs show)."""
    return torch.empty(shape, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------
# Activation quantization: one scale per token and group of channels
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M", "eps"])
def _per_token_group_quant_kernel(
    X, Q, S, M, eps,
    stride_xm, stride_qm, stride_sm, stride_sg,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Q[rows, group g] = to_fp8(X / s), S[rows, g] = s = max(amax |X[rows, group g]|, eps) / 448."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK_G)
    row_ok = rows < M
    ok = row_ok[:, None] & (tl.arange(0, BLOCK_G) < GROUP)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    q, s = quantize_groups(x, eps)
    tl.store(Q + rows64[:, None] * stride_qm + cols[None, :], q, mask=ok)
    tl.store(S + rows64 * stride_sm + g * stride_sg, s, mask=row_ok)


_per_token_group_quant_launch = FastLaunch(_per_token_group_quant_kernel)


def group_quant_outputs(
    m: int, k: int, group_size: int, device: torch.device, column_major_scales: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of quantizing [m, k] per token and group: x_q [m, k] e4m3 and x_s
    [m, k // group_size] fp32, with strides (1, m) when `column_major_scales`."""
    groups = k // group_size
    x_q = _empty((m, k), FP8_DTYPE, device)
    if column_major_scales:
        return x_q, _empty((groups, m), torch.float32, device).t()
    return x_q, _empty((m, groups), torch.float32, device)


def group_quant_tile(group_size: int, m: int) -> tuple[int, int]:
    """(BLOCK_G, BLOCK_M) of a per-token-group quantization program: whole groups of several rows,
    about 4K elements (16 rows of a 128-wide group; 64 under the interpreter, for speed)."""
    block_g = next_power_of_2(group_size)
    return block_g, min(max(1, 4096 // block_g), next_power_of_2(m), 16 if not interpreting() else 64)


def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int, *, eps: float = 1e-10, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32/float16/bfloat16 -> (x_q [M, K] float8_e4m3fn, x_s [M, K // group_size] float32).

    One scale per row and group of `group_size` consecutive channels:
    x_s = max(amax |x_group|, eps) / 448 and x_q = e4m3(x_group / x_s), so x ~ x_q * x_s.
    `column_major_scales`: x_s with strides (1, M) (the layout cuBLAS's block-scaled GEMM reads).
    """
    check_per_token_group_quant(x, group_size, eps)
    M, K = x.shape
    x_q, x_s = group_quant_outputs(M, K, group_size, x.device, column_major_scales)
    if M == 0 or K == 0:
        return x_q, x_s
    block_g, block_m = group_quant_tile(group_size, M)
    grid = (cdiv(M, block_m), K // group_size)
    _per_token_group_quant_launch[grid](
        x, x_q, x_s, M, float(eps),
        x.stride(0), x_q.stride(0), x_s.stride(0), x_s.stride(1),
        GROUP=group_size, BLOCK_G=block_g, BLOCK_M=block_m, num_warps=4,
    )  # fmt: skip
    return x_q, x_s


@triton.jit(do_not_specialize=["M"])
def _scaled_quant_kernel(
    X, Q, S, M, K, stride_xm, stride_qm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Q[rows, cols] = to_fp8(X[rows, cols] / S[0]): one scale for the whole tensor."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < M)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    s = tl.load(S)
    x = tl.load(X + rows64[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(Q + rows64[:, None] * stride_qm + cols[None, :], to_fp8(tl.div_rn(x, s)), mask=ok)


_scaled_quant_launch = FastLaunch(_scaled_quant_kernel)


def scaled_fp8_quant(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32/float16/bfloat16 -> (x_q [M, K] float8_e4m3fn, scale [1] float32).

    One scale for the whole tensor (vLLM's `scaled_fp8_quant`): `scale`, a static calibrated one
    (a checkpoint's `input_scale`, one float32 element on x's device), or when None
    max(amax |x|, 1e-10) / 448 computed on the device. x_q = e4m3(x / scale), saturated at +-448.
    """
    check_scaled_fp8_quant(x, scale)
    scale = dynamic_per_tensor_scale(x) if scale is None else scale.reshape(1)
    M, K = x.shape
    x_q = _empty((M, K), FP8_DTYPE, x.device)
    if M == 0 or K == 0:
        return x_q, scale
    block_k = min(1024, next_power_of_2(K))
    block_m = min(max(1, 4096 // block_k), next_power_of_2(M))
    grid = (cdiv(M, block_m), cdiv(K, block_k))
    _scaled_quant_launch[grid](
        x, x_q, scale, M, K, x.stride(0), x_q.stride(0), BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4
    )
    return x_q, scale


# ----------------------------------------------------------------------------------------------
# Block-scaled GEMM
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int  # rows of C per program
    block_n: int  # columns of C per program: a power of two dividing bn (one b_s row per tile)
    group_m: int  # row tiles per L2 group of the program order
    num_warps: int
    num_stages: int
    split_k: int = 1  # k-block runs per tile, each its own program (few tiles: fill the SMs)


_BLOCK_N_CHOICES = (128, 64, 32, 16)


def block_fp8_config(M: int, N: int, block_size: Sequence[int], K: int | None = None) -> Fp8GemmConfig:
    """Tiles for `w8a8_block_fp8_matmul` of an [M, K] x [N, K]^T product (BLOCK_K is bk).

    Decode (M <= 16) reads each weight byte once and is bound by how many bytes are in flight:
    16-row tiles (mma.sync: Hopper's warpgroup MMA needs 64 rows), 128 columns, 3 stages, and the
    k-blocks split (`split_k`, each run its own program, the fp32 partials summed after) by a
    power of two, at most 8 and at most one run per two k-blocks, until there are two
    programs per SM or the cap is reached: a 1-token step of Qwen3-8B's down_proj (32 column
    tiles) then has 256 programs instead of 32. Chosen from a sweep on the H200 of block_n
    {32, 64, 128} x stages {3, 5} x split_k {1, 2, 4, 8} at 1 and 16 tokens on Qwen3-0.6B's and
    8B's layers: this rule picks the best measured or one within 5% of it on each
    (docs/benchmarks.md, G1). 17-64 rows: 32-64-row tiles, 5 stages, the columns split finely
    enough (down to 32) that the grid covers every SM. Many rows are compute bound: 64 x 128 tiles
    of 4 warps up to 1023 rows, then 128 x 128 tiles of 8 warps (two warpgroups of Hopper's
    64-row MMA) 4 stages deep: 32 KiB of shared memory a stage. Built for sm_90a with Triton 3.6
    (bk = 128, bf16 out): 128 x 128 / 8 warps / 4 stages takes 128 KiB of shared memory and 177
    registers, 64 x 128 / 4 warps / 4 stages 96 KiB and 184, no spills.
    `benchmarks/fp8_gemm.py` times these against two alternatives. K (default: no split) gives
    the number of k-blocks a split may divide. Under the interpreter: 32 x 64 tiles (fewer
    programs run faster there), narrower than a 128-wide bn and small enough that the tests'
    shapes still span several tiles.
    """
    bn, bk = block_size[0], block_size[1]
    divisors = [c for c in _BLOCK_N_CHOICES if bn % c == 0]  # widest first
    if not divisors:
        raise ValueError(f"w8a8_block_fp8_matmul: bn = {bn} must be a multiple of 16 for the Triton kernel")
    if interpreting():
        return Fp8GemmConfig(block_m=32, block_n=min(64, divisors[0]), group_m=4, num_warps=4, num_stages=1)
    if M <= 16:
        block_n = divisors[0]
        tiles = cdiv(N, block_n)
        max_split = min(8, max(1, (K or 0) // bk // 2))  # at most one run per two k-blocks
        split_k = 1
        while split_k * 2 <= max_split and tiles * split_k < 2 * num_sms():
            split_k *= 2
        return Fp8GemmConfig(
            block_m=16, block_n=block_n, group_m=8, num_warps=4, num_stages=3, split_k=split_k
        )
    if M <= 32:
        block_m, warps, stages = 32, 4, 5
    elif M <= 64:
        block_m, warps, stages = 64, 4, 5
    elif M < 1024:
        block_m, warps, stages = 64, 4, 4
    else:
        block_m, warps, stages = 128, 8, 4
    wide = [c for c in divisors if c >= 32] or divisors[-1:]
    if M >= 256:
        block_n = wide[0]  # compute bound: the widest tile reuses each A tile the most
    else:
        # Bandwidth bound: the widest tile that still gives every SM a program, else the narrowest.
        row_tiles = cdiv(M, block_m)
        block_n = next((c for c in wide if row_tiles * cdiv(N, c) >= num_sms()), wide[-1])
    return Fp8GemmConfig(block_m=block_m, block_n=block_n, group_m=8, num_warps=warps, num_stages=stages)


@functools.lru_cache(maxsize=1024)
def _cached_config(M: int, N: int, K: int, bn: int, bk: int, interpreting_: bool) -> Fp8GemmConfig:
    """`block_fp8_config`, chosen once per shape: every linear layer of every step asks."""
    return block_fp8_config(M, N, (bn, bk), K)


@triton.jit(do_not_specialize=["M", "eps", "stride_c_split"])
def _w8a8_block_fp8_matmul_kernel(
    A, B, C, As, Bs, M, N, K, eps,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_as_m, stride_as_k, stride_bs_n, stride_bs_k, stride_c_split,
    GROUP_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, QUANT_A: tl.constexpr, STATIC_A: tl.constexpr,
):  # fmt: skip
    """C[rows, cols] = sum_j As[rows, j] * Bs[cols // GROUP_N, j] * (A[rows, block j] @ B[cols, block j]^T).

    A [M, K] e4m3, B [N, K] e4m3, As [M, K // BLOCK_K], Bs [ceil(N / GROUP_N), K // BLOCK_K]
    fp32; K a multiple of BLOCK_K, GROUP_N a multiple of BLOCK_N.
    QUANT_A: A holds the unquantized activations (fp32/fp16/bf16) and each [BLOCK_M, BLOCK_K]
    tile is quantized here, as `_per_token_group_quant_kernel` does it (As unread); with
    STATIC_A by the one static scale As[0] (As's strides are 0), as `_scaled_quant_kernel` does.
    SPLIT_K > 1: program (tile, s) takes the k-blocks [s * per, (s + 1) * per), per =
    ceil(K / BLOCK_K / SPLIT_K) (clipped to the K // BLOCK_K k-blocks), and writes its fp32 partial sums to C + s * stride_c_split ([SPLIT_K, M, N], summed after).
    """
    # -- program id -> (row tile, column tile), GROUP_M row tiles at a time --
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_m = (pid // pids_per_group) * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_per_group) % group_size
    pid_n = (pid % pids_per_group) // group_size

    # -- the tile's rows and columns; past M / N they wrap onto valid ones, never stored --
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_m % M).to(tl.int64)
    cols = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    b_ptrs = B + cols[None, :] * stride_bn + offs_k[:, None] * stride_bk  # [BLOCK_K, BLOCK_N]
    as_ptrs = As + rows * stride_as_m  # [BLOCK_M]: this tile's rows' scales of k-block 0
    bs_ptr = Bs + ((pid_n * BLOCK_N) // GROUP_N) * stride_bs_n  # one weight block row per tile

    # -- this program's k-blocks: all of them, or one of SPLIT_K equal runs --
    num_k_blocks = K // BLOCK_K
    per_split = tl.cdiv(num_k_blocks, SPLIT_K)
    first_j = tl.program_id(1) * per_split
    last_j = tl.minimum(first_j + per_split, num_k_blocks)
    a_ptrs += first_j * BLOCK_K * stride_ak
    b_ptrs += first_j * BLOCK_K * stride_bk

    # -- acc = sum over k-blocks of the scaled fp8 partial products, in fp32 --
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(first_j, last_j):
        b = tl.load(b_ptrs)
        b_s = tl.load(bs_ptr + j * stride_bs_k)
        if QUANT_A:  # the quantization of this k-block, bit for bit
            x = tl.load(a_ptrs).to(tl.float32)
            if STATIC_A:  # the calibrated scale, broadcast over the rows
                a_s = tl.load(as_ptrs + j * stride_as_k)
            else:  # per token and group
                a_s = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), eps), FP8_MAX_C)
            a = to_fp8(tl.div_rn(x, a_s[:, None]))
        else:
            a = tl.load(a_ptrs)
            a_s = tl.load(as_ptrs + j * stride_as_k)
        partial = tl.dot(a, b)  # exact e4m3 products, summed by the tensor cores over one block
        acc += partial * (a_s[:, None] * b_s)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # -- one rounding to C's dtype (split: fp32 partials, rounded by the reduction) --
    c_ptrs = C + tl.program_id(1).to(tl.int64) * stride_c_split
    c_ptrs += offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["MN"])
def _split_k_sum_kernel(P, C, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """C[i] = sum_s P[s, i] in split order, rounded once to C's dtype; P [SPLIT_K, MN] fp32."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(P + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(P + s * MN.to(tl.int64) + offs, mask=ok, other=0.0)
    tl.store(C + offs, acc.to(C.dtype.element_ty), mask=ok)


_w8a8_block_fp8_matmul_launch = FastLaunch(_w8a8_block_fp8_matmul_kernel)
_split_k_sum_launch = FastLaunch(_split_k_sum_kernel)


def w8a8_block_fp8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    a_s: torch.Tensor,
    b_s: torch.Tensor,
    block_size: list[int],
    output_dtype: torch.dtype = torch.bfloat16,
    *,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """C [M, N] = (a * a_s) @ (b * b_s)^T, block-scaled, in `output_dtype` (vLLM's argument order).

    Args:
        a: [M, K] float8_e4m3fn activations (from `per_token_group_quant_fp8(x, bk)`).
        b: [N, K] float8_e4m3fn weight (a checkpoint's `weight`).
        a_s: [M, K // bk] float32, one scale per token and k-block (any strides).
        b_s: [ceil(N / bn), K // bk] float32, one per weight block (`weight_scale_inv`).
        block_size: [bn, bk]; the Triton kernel needs bk a power of two >= 32 and bn a multiple of 16.
        output_dtype: float32 / float16 / bfloat16.
        config: tiles to use instead of `block_fp8_config(M, N, block_size, K)` (benchmark sweeps).

    Steps of a few rows (`fp8_gemv.fp8_gemv_runs`: one on a CUDA device by default) run
    `fp8_gemv.py`'s kernel instead, which takes any bn and a power-of-two bk; a `config` keeps
    them on the GEMM.

    Returns a new [M, N] tensor in `output_dtype`.
    """
    name = "w8a8_block_fp8_matmul"
    bn, bk = check_block_fp8_matmul(name, a, b, a_s, b_s, block_size, output_dtype)
    M, N = a.shape[0], b.shape[0]
    if config is None and _gemv_takes(a, b, bk):
        c = _empty((M, N), output_dtype, a.device)
        launch_fp8_gemv(a, b, b_s, (bn, bk), c, 1.0, x_s=a_s)
        return c
    return _matmul(name, a, b, a_s, b_s, bn, bk, output_dtype, config, quant_a=False, eps=0.0)


def w8a8_block_fp8_linear(
    x: torch.Tensor,
    b: torch.Tensor,
    b_s: torch.Tensor,
    block_size: list[int],
    output_dtype: torch.dtype | None = None,
    *,
    eps: float = 1e-10,
    input_scale: torch.Tensor | None = None,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """`w8a8_block_fp8_matmul(*per_token_group_quant_fp8(x, bk), ...)` in one kernel.

    x [M, K] float32/float16/bfloat16 is quantized per token and bk-wide group as the GEMM loads
    it (the same x_q and x_s bit for bit, so the same C), or with `input_scale` (one float32
    element: static activations) as `scaled_fp8_quant(x, input_scale)` quantizes it; b [N, K]
    e4m3 and b_s [ceil(N / bn), K // bk] fp32 as for `w8a8_block_fp8_matmul`; C [M, N] in
    `output_dtype` (default x's dtype). One launch and no x_q round trip through memory: what a
    decode step's small GEMMs want. Steps of a few rows (`fp8_gemv.fp8_gemv_runs`: one on a CUDA
    device by default) run `fp8_gemv.py`'s kernel instead, which quantizes x itself or after one
    quantization launch (`fp8_gemv_quantizes_x`); an explicit `config` keeps them on the GEMM.
    """
    name = "w8a8_block_fp8_linear"
    output_dtype = x.dtype if output_dtype is None else output_dtype
    bn, bk = check_block_fp8_matmul(name, x, b, None, b_s, block_size, output_dtype)
    if not (isinstance(eps, (int, float)) and eps > 0):  # x itself: checked just above
        raise ValueError(f"{name}: eps must be a positive number, got {eps!r}")
    if input_scale is not None:
        check_input_scale(name, x, input_scale)
    (M, K), N = x.shape, b.shape[0]
    if config is None and _gemv_takes(x, b, bk):
        c = _empty((M, N), output_dtype, x.device)
        if fp8_gemv_quantizes_x(M, K, bk):  # one launch
            launch_fp8_gemv(x, b, b_s, (bn, bk), c, eps, input_scale)
        else:  # x quantized once, then the GEMV on x_q
            if input_scale is None:
                x_q, x_s = per_token_group_quant_fp8(x, bk, eps=eps)
            else:
                x_q, x_s = scaled_fp8_quant(x, input_scale)[0], broadcast_input_scale(input_scale, M, K // bk)
            launch_fp8_gemv(x_q, b, b_s, (bn, bk), c, eps, x_s=x_s)
        return c
    a_s = None if input_scale is None else broadcast_input_scale(input_scale, M, K // bk)
    return _matmul(name, x, b, a_s, b_s, bn, bk, output_dtype, config, quant_a=True, eps=eps)


def _gemv_takes(a: torch.Tensor, b: torch.Tensor, bk: int) -> bool:
    """Whether `fp8_gemv.py` runs a checked call on a [M, K] and b [N, K]: a few rows
    (`fp8_gemv_runs`), unit last-dim strides, nothing empty."""
    (M, K), N = a.shape, b.shape[0]
    return N > 0 and K > 0 and a.stride(1) == 1 and b.stride(1) == 1 and fp8_gemv_runs(M, bk, a.device)


def _matmul(
    name: str,
    a: torch.Tensor,
    b: torch.Tensor,
    a_s: torch.Tensor | None,
    b_s: torch.Tensor,
    bn: int,
    bk: int,
    output_dtype: torch.dtype,
    config: Fp8GemmConfig | None,
    *,
    quant_a: bool,
    eps: float,
) -> torch.Tensor:
    """The checked GEMM's launch: a quantized with a_s, or quantized in the kernel (quant_a),
    per token and group (a_s None) or by the static scale that a_s broadcasts."""
    if bk < 32 or bk & (bk - 1):
        # tl.arange needs a power of two, and an fp8 tl.dot a reduction of at least 32
        raise ValueError(f"{name}: bk = {bk} must be a power of two >= 32 for the Triton kernel")
    (M, K), N = a.shape, b.shape[0]
    cfg = config or _cached_config(M, N, K, bn, bk, interpreting())
    if bn % cfg.block_n or cfg.block_n & (cfg.block_n - 1) or cfg.block_n < 16:
        raise ValueError(
            f"{name}: config.block_n = {cfg.block_n} must be a power of two >= 16 dividing bn = {bn}"
        )
    if M == 0 or N == 0 or K == 0:
        return torch.zeros((M, N), dtype=output_dtype, device=a.device)
    if not quant_a and config is None and M >= GLUON_MIN_TOKENS and gluon_module_ok(GLUON_MODULE):
        # Many tokens on Hopper: the Gluon kernel, whose tensor cores run while it scales
        # (fp8_gemm_hopper.py); the Triton kernel below where it does not take these operands.
        c = _empty((M, N), output_dtype, a.device)
        if launch_gluon(
            lambda gluon_gemm: _launch_gluon(gluon_gemm, a, b, a_s, b_s, (bn, bk), c), GLUON_MODULE
        ):
            return c
    # as many runs as the k-blocks fill: ceil(blocks / per-run) (no empty run)
    num_k_blocks = K // bk
    split_k = cdiv(num_k_blocks, cdiv(num_k_blocks, max(1, min(cfg.split_k, num_k_blocks))))
    c = _empty((M, N), output_dtype, a.device)
    out = c if split_k == 1 else _empty((split_k, M, N), torch.float32, a.device)
    # QUANT_A: the kernel never reads As; b_s stands in for the pointer argument
    scales = (0, 0) if a_s is None else (a_s.stride(0), a_s.stride(1))
    grid = (cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n), split_k)
    _w8a8_block_fp8_matmul_launch[grid](
        a, b, out, b_s if a_s is None else a_s, b_s, M, N, K, float(eps),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        *scales, b_s.stride(0), b_s.stride(1), M * N,
        GROUP_N=bn, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
        SPLIT_K=split_k, QUANT_A=quant_a, STATIC_A=quant_a and a_s is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split_k > 1:
        block = 1024
        _split_k_sum_launch[(cdiv(M * N, block),)](out, c, M * N, SPLIT_K=split_k, BLOCK=block)
    return c


def _launch_gluon(gluon_gemm, a, b, a_s, b_s, block_size, c) -> bool:
    """`fp8_gemm_hopper.py`'s launch into c; False (nothing launched) for operands it does not take."""
    if not gluon_gemm.supports(a, b, block_size, c.dtype):
        return False
    gluon_gemm.launch_block_fp8_gemm(a, b, a_s, b_s, c)
    return True


# ----------------------------------------------------------------------------------------------
# The same product through torch's block-scaled scaled_mm (cuBLASLt), where it exists
# ----------------------------------------------------------------------------------------------


def scaled_mm_block_unavailable(device: torch.device | str, block_size: Sequence[int], N: int) -> str | None:
    """Why `scaled_mm_block_fp8` cannot run here, or None.

    torch's block-wise recipes (1 x 128 activation groups, 128 x 128 weight blocks) run on sm_90
    only (cuBLASLt >= 12.9) and size the weight scales as N // 128, so N must be a multiple of 128.
    """
    device = torch.device(device)
    F = torch.nn.functional
    if not (hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    if not all(hasattr(F.ScalingType, r) for r in ("BlockWise1x128", "BlockWise128x128")):
        return f"torch {torch.__version__}'s scaled_mm has no BlockWise1x128 / BlockWise128x128 recipes"
    if device.type != "cuda" or interpreting():
        return f"block-wise scaled_mm needs a CUDA device, got {device.type}"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return f"block-wise scaled_mm needs an sm_90 GPU, got sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    if list(block_size) != [128, 128]:
        return f"block-wise scaled_mm needs block_size [128, 128], got {list(block_size)}"
    if N % 128:
        return f"block-wise scaled_mm needs N a multiple of 128, got {N}"
    return None


def scaled_mm_block_fp8(
    a: torch.Tensor,
    b: torch.Tensor,
    a_s: torch.Tensor,
    b_s: torch.Tensor,
    block_size: list[int],
    output_dtype: torch.dtype = torch.bfloat16,
    *,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """`w8a8_block_fp8_matmul` through `torch.nn.functional.scaled_mm` (cuBLASLt), same arguments.
    `use_fast_accum`: cuBLAS's fast FP8 accumulation flag, for `benchmarks/fp8_gemm.py` to measure.

    Raises RuntimeError where torch cannot run it (`scaled_mm_block_unavailable` says why). cuBLAS
    reads a_s column-major (strides (1, M): `per_token_group_quant_fp8(...,
    column_major_scales=True)` writes it so; other layouts are copied) and b_s as [L4, N // 128]
    with strides (1, L4), L4 = K // 128 rounded up to a multiple of 4: a contiguous b_s.t() when
    K // 128 is a multiple of 4 (every Qwen3 layer), else a padded copy.
    """
    name = "scaled_mm_block_fp8"
    check_block_fp8_matmul(name, a, b, a_s, b_s, block_size, output_dtype)
    reason = scaled_mm_block_unavailable(a.device, block_size, b.shape[0])
    if reason is not None:
        raise RuntimeError(f"{name}: {reason}")
    F = torch.nn.functional
    M = a.shape[0]
    kb = a_s.shape[1]
    scale_a = a_s if a_s.stride(0) == 1 and (a_s.stride(1) == M or kb == 1) else a_s.t().contiguous().t()
    l4 = -(-kb // 4) * 4
    if kb == l4 and b_s.stride(1) == 1 and b_s.stride(0) == l4:
        scale_b = b_s.t()  # [K // 128, N // 128], strides (1, K // 128)
    else:
        padded = torch.zeros((b_s.shape[0], l4), dtype=torch.float32, device=b_s.device)
        padded[:, :kb] = b_s
        scale_b = padded.t()  # [L4, N // 128], strides (1, L4); rows past K // 128 unread
    return F.scaled_mm(
        a,
        b.t(),  # [K, N] column-major, as cuBLAS wants the second operand
        scale_a,
        F.ScalingType.BlockWise1x128,
        scale_b,
        F.ScalingType.BlockWise128x128,
        output_dtype=output_dtype,
        # passed only when set: the default call stays the one the engine has always made
        **({"use_fast_accum": True} if use_fast_accum else {}),
    )


# ----------------------------------------------------------------------------------------------
# One scale per tensor (or per output row) through torch._scaled_mm
# ----------------------------------------------------------------------------------------------


def scaled_mm_fp8_unavailable(
    device: torch.device | str, output_dtype: torch.dtype, N: int, K: int, *, per_row: bool
) -> str | None:
    """Why `scaled_mm_fp8` cannot run an [M, K] x [N, K]^T product here, or None.

    torch._scaled_mm multiplies e4m3 operands with one scale each ("tensor-wise": cuBLASLt, sm_89
    and newer) or one per row of each operand ("row-wise": cuBLASLt's or torch's CUTLASS kernel,
    as torch was built; sm_90 and newer, bfloat16 output taken as the rule both allow), N and K
    multiples of 16; on the CPU torch runs tensor-wise in any float dtype, and row-wise where the
    build has it.
    """
    device = torch.device(device)
    if N % 16 or K % 16:
        return f"scaled_mm needs N and K multiples of 16, got N = {N}, K = {K}"
    if device.type == "cpu":
        return (
            None
            if not per_row or _cpu_row_wise()
            else f"torch {torch.__version__}'s CPU scaled_mm is tensor-wise only"
        )
    if device.type != "cuda":
        return f"scaled_mm runs on CUDA or the CPU, got {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"FP8 scaled_mm needs sm_89 or newer, got sm_{major}{minor}"
    if per_row and ((major, minor) < (9, 0) or output_dtype != torch.bfloat16):
        return f"row-wise scaled_mm needs sm_90 or newer and bfloat16 output, got sm_{major}{minor}, {output_dtype}"
    return None


@functools.cache
def _cpu_row_wise() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes row-wise scales (newer builds do; older ones
    assert that the CPU backend is tensor-wise only)."""
    a = torch.ones((1, 16), dtype=FP8_DTYPE)
    try:
        torch._scaled_mm(
            a, a.t(), scale_a=torch.ones(1, 1), scale_b=torch.ones(1, 1), out_dtype=torch.float32
        )
    except RuntimeError:
        return False
    return True


# device -> every [rows, 1] buffer of ones handed out, the largest last. Earlier ones stay alive:
# a CUDA graph captured with a slice of one keeps reading its address.
_unit_scales: dict[torch.device, list[torch.Tensor]] = {}


def _unit_row_scales(rows: int, device: torch.device) -> torch.Tensor:
    """[rows, 1] float32 ones, contiguous: the row-wise scale_a of an `a` whose one scale is
    folded into scale_b. A slice of a buffer kept per device: only a call of more rows than any
    before allocates and fills a larger one, which a CUDA graph capture must not do (its fill
    would only be recorded): the engine runs every captured size eagerly first."""
    buffers = _unit_scales.setdefault(device, [])
    if not buffers or buffers[-1].shape[0] < rows:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"scaled_mm_fp8: {rows} rows, more than any call before, inside a CUDA graph capture; "
                "run the same call once before capturing it"
            )
        size = max(rows, 2 * buffers[-1].shape[0] if buffers else 1024)
        buffers.append(torch.ones((size, 1), dtype=torch.float32, device=device))
    return buffers[-1][:rows]


def scaled_mm_fp8(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | None,
    scale_b: torch.Tensor,
    output_dtype: torch.dtype = torch.bfloat16,
    *,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """C [M, N] = (a @ b^T) * scale_a * scale_b through `torch._scaled_mm`, in `output_dtype`.

    a [M, K] e4m3 activations, scale_a their one float32 scale ([1]; None when it is already folded
    into scale_b, as a static layer does once at load); b [N, K] e4m3 weight as stored (read as the
    column-major [K, N] operand cuBLAS wants, no copy), scale_b float32 of one element or N (one per
    output row: row-wise, with scale_a folded in, since torch's row-wise GEMM takes a scale per row
    of a too). Raises RuntimeError where torch cannot run it (`scaled_mm_fp8_unavailable` says why).
    `use_fast_accum`: the whole of K summed in the FP8 tensor cores' own accumulator (fewer bits
    than fp32, as vLLM's CUTLASS FP8 GEMMs run) instead of promoted to fp32 along the way; off in
    the layers until `benchmarks/fp8_gemm.py` shows what it gains and costs.
    """
    name = "scaled_mm_fp8"
    check_scaled_mm_fp8(name, a, b, scale_a, scale_b, output_dtype)
    (M, K), N = a.shape, b.shape[0]
    per_row = scale_b.numel() > 1
    reason = scaled_mm_fp8_unavailable(a.device, output_dtype, N, K, per_row=per_row)
    if reason is not None:
        raise RuntimeError(f"{name}: {reason}")
    if M == 0:
        return torch.empty((0, N), dtype=output_dtype, device=a.device)
    if per_row:
        if scale_a is None:
            row_scales = _unit_row_scales(M, a.device)
        else:  # a copy per call: callers on a hot path fold scale_a into scale_b
            row_scales = scale_a.reshape(1, 1).expand(M, 1).contiguous()
        col_scales = scale_b.reshape(1, N).contiguous()
    else:
        row_scales = _unit_row_scales(1, a.device).reshape(1) if scale_a is None else scale_a.reshape(1)
        col_scales = scale_b.reshape(1)
    return torch._scaled_mm(
        a,
        b.t(),
        scale_a=row_scales,
        scale_b=col_scales,
        out_dtype=output_dtype,
        use_fast_accum=use_fast_accum,
    )
