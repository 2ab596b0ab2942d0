"""Block-scaled FP8 (e4m3) GEMM for Hopper (sm_90) written in Gluon: the product of
`fp8_gemm.w8a8_block_fp8_matmul` for many tokens, with DeepSeek-V3's promotion written out.

    C[m, n] = sum_j a_s[m, j] * b_s[n // 128, j] * sum_{k in block j} a[m, k] * b[n, k]

Why a second kernel. Each k-block's product must leave the tensor cores' FP8 accumulator (which
keeps fewer bits than fp32) and be scaled into an fp32 sum on the CUDA cores: a wait on the
product every 128 values of K. In Triton's kernel that wait stops the program's tensor cores
while it scales; only another program on the SM fills them. Here the waits are scheduled by
hand (FlashAttention-3's and DeepGEMM's way of keeping the tensor cores busy):

- A producer warp copies, with TMA, each k-block's A tile [128, 128] and B tile [128, 128] into
  a ring of `STAGES` shared-memory slots ("ready" barriers count the bytes; an "empty" barrier
  per slot takes one arrival from each consumer).
- Two consumer warpgroups own rows [0, 64) and [64, 128) of the tile. A warpgroup issues the
  products of two k-blocks (asynchronous warpgroup MMAs, 4 x m64n128k32 each, into two fp32
  tiles), waits for the first only, scales it into its accumulator while the tensor cores run
  the second (acc += tile * a_s[rows, j] * b_s[n-block, j]), then scales the second. The other
  warpgroup's products fill the tensor cores during that second scaling. Registers: the
  accumulator and two product tiles, 3 x 64 a thread. The next pair's scales are loaded (from
  L2) while this pair is multiplied.
- Persistent: one program per SM walks the output tiles (GROUP_M row tiles across all column
  tiles, then the next group, so B's tiles are reused from L2); the producer copies the next
  tile's first k-blocks while the consumers store the last tile's output (through a staging tile
  per warpgroup and a TMA copy).

C is rounded once, at the store; rows past M and columns past N are copied in as zeros by TMA
and never stored. Measured against cuBLAS's block-scaled GEMM and the Triton kernel in
docs/benchmarks.md (G1); the PyTorch twin is `tilellm.kernels.reference.fp8_gemm`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tilellm.kernels.config import cdiv, compile_gluon_for_sm90, num_sms
from tilellm.kernels.hopper import cta_barrier, tma_load  # Gluon's names, as this Triton spells them
from tilellm.kernels.launch import FastLaunch

# A TMA copy shared -> global: `async_copy_shared_to_global` up to 3.8, `async_store` from 3.8 on.
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

BLOCK_M = gl.constexpr(128)  # two consumer warpgroups of 64 rows (one warpgroup MMA's height)
BLOCK_N = gl.constexpr(128)  # columns per tile: one row of b_s
BLOCK_K = gl.constexpr(128)  # one k-block of the scales
HALF = gl.constexpr(64)
STAGES = 4  # 32 KiB a slot: with the two 16 KiB staging tiles 160 KiB of shared memory (5: 192)
CONSUMER_REGS = 240  # registers a consumer thread gets once the producer gives its share back
MAX_REGS = 168  # 2 x 128 consumer threads + 32 producer threads at launch (see hopper.py)


class _Args(NamedTuple):
    A_s: Any  # [M, K // 128] float32
    B_s: Any  # [ceil(N / 128), K // 128] float32
    M: Any
    N: Any
    num_k_blocks: Any
    stride_asm: Any
    stride_ask: Any
    stride_bsn: Any
    stride_bsk: Any


@gluon.jit
def _tile_mn(t, num_m_tiles, num_n_tiles, GROUP_M):
    """Tile t -> (row tile, column tile): GROUP_M row tiles walk all column tiles together."""
    per_group = GROUP_M * num_n_tiles
    first_m = (t // per_group) * GROUP_M
    rows_here = gl.minimum(num_m_tiles - first_m, GROUP_M)
    return first_m + (t % per_group) % rows_here, (t % per_group) // rows_here


@gluon.jit
def _produce(a_desc, b_desc, a_smem, b_smem, ready, empty, num_m_tiles, num_n_tiles, num_k_blocks, GROUP_M):
    """Producer warp: every k-block of every tile of this program into the ring."""
    stages: gl.constexpr = a_smem.type.shape[0]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    it = 0
    for t in range(gl.program_id(0), num_m_tiles * num_n_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile_mn(t, num_m_tiles, num_n_tiles, GROUP_M)
        for kb in range(num_k_blocks):
            slot = it % stages
            # a fresh mbarrier counts as having completed the phase before 0: the first pass is free
            mbarrier.wait(empty.index(slot), ((it // stages) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), nbytes)
            tma_load(a_desc, [pid_m * BLOCK_M, kb * BLOCK_K], ready.index(slot), a_smem.index(slot))
            tma_load(b_desc, [pid_n * BLOCK_N, kb * BLOCK_K], ready.index(slot), b_smem.index(slot))
            it += 1


@gluon.jit
def _scales(args, rows, row_ok, pid_n, kb):
    """a_s [64] of this warpgroup's rows and the scalar b_s of the tile's columns at k-block kb
    (zeros past the last k-block: the prefetch after it)."""
    kb_ok = kb < args.num_k_blocks
    a_s = gl.load(args.A_s + rows.to(gl.int64) * args.stride_asm + kb * args.stride_ask, mask=row_ok & kb_ok,
                  other=0.0)  # fmt: skip
    b_s = gl.load(args.B_s + pid_n * args.stride_bsn + kb * args.stride_bsk, mask=kb_ok, other=0.0)
    return a_s, b_s


@gluon.jit
def _product(WG: gl.constexpr, a_smem, b_smem, ready, it, spare):
    """Issue k-block `it`'s product of this warpgroup's rows (asynchronous) once its tiles landed;
    `spare`: a register tile the MMA may write (its value is not read)."""
    stages: gl.constexpr = a_smem.type.shape[0]
    slot = it % stages
    mbarrier.wait(ready.index(slot), (it // stages) & 1)
    return warpgroup_mma(a_smem.index(slot).slice(WG * HALF, HALF), b_smem.index(slot).permute((1, 0)), spare,
                         use_acc=False, is_async=True)  # fmt: skip


@gluon.jit
def _mainloop(WG: gl.constexpr, a_smem, b_smem, ready, empty, args, rows, row_ok, pid_n, acc, spare, it):
    """The k-blocks of one tile, two at a time: both products are issued before the first is
    scaled, so the tensor cores run the second while the CUDA cores scale the first. Returns the
    accumulator, a free product tile and the ring position after the tile."""
    stages: gl.constexpr = a_smem.type.shape[0]
    num_k_blocks = args.num_k_blocks
    # the second product in flight gets registers of its own (two MMAs writing one tile value
    # is not something Gluon lowers)
    spare2 = gl.zeros_like(spare)
    a_s0, b_s0 = _scales(args, rows, row_ok, pid_n, 0)
    a_s1, b_s1 = _scales(args, rows, row_ok, pid_n, 1)
    for kb in range(0, num_k_blocks - 1, 2):
        # the next pair's scales are on their way while this pair is multiplied
        a_n0, b_n0 = _scales(args, rows, row_ok, pid_n, kb + 2)
        a_n1, b_n1 = _scales(args, rows, row_ok, pid_n, kb + 3)
        first = _product(WG, a_smem, b_smem, ready, it, spare)
        second = _product(WG, a_smem, b_smem, ready, it + 1, spare2)
        first = warpgroup_mma_wait(1, deps=(first,))  # k-block kb is done; kb + 1 may still run
        mbarrier.arrive(empty.index(it % stages), count=1)  # its A and B are read: the slot is free
        acc = acc + first * gl.expand_dims(a_s0 * b_s0, 1)
        second = warpgroup_mma_wait(0, deps=(second,))
        mbarrier.arrive(empty.index((it + 1) % stages), count=1)
        acc = acc + second * gl.expand_dims(a_s1 * b_s1, 1)
        spare = first
        spare2 = second
        a_s0, b_s0, a_s1, b_s1 = a_n0, b_n0, a_n1, b_n1
        it += 2
    if num_k_blocks % 2 == 1:  # the last k-block alone: its scales are a_s0, b_s0
        first = _product(WG, a_smem, b_smem, ready, it, spare)
        first = warpgroup_mma_wait(0, deps=(first,))
        mbarrier.arrive(empty.index(it % stages), count=1)
        acc = acc + first * gl.expand_dims(a_s0 * b_s0, 1)
        spare = first
        it += 1
    return acc, spare, it


@gluon.jit
def _consume(WG: gl.constexpr, c_desc, a_smem, b_smem, c_smem, ready, empty, args, num_m_tiles, num_n_tiles,
             GROUP_M):  # fmt: skip
    """Consumer warpgroup WG: its 64 rows of every tile of this program."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])  # fmt: skip
    # a product tile: its registers are the MMA's output, its old value unread (use_acc=False)
    spare = gl.zeros([HALF, BLOCK_N], gl.float32, acc_layout)
    r = gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
    c_buf = c_smem.index(WG)
    it = 0
    for t in range(gl.program_id(0), num_m_tiles * num_n_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile_mn(t, num_m_tiles, num_n_tiles, GROUP_M)
        rows = pid_m * BLOCK_M + WG * HALF + r
        acc = gl.zeros([HALF, BLOCK_N], gl.float32, acc_layout)
        acc, spare, it = _mainloop(
            WG, a_smem, b_smem, ready, empty, args, rows, rows < args.M, pid_n, acc, spare, it
        )
        # the output, rounded once, through this warpgroup's staging tile and TMA (rows past M and
        # columns past N are not written); the copy runs while the next tile's products start
        tma.store_wait(0)  # the last tile's copy has read the staging tile
        c_buf.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma_store(c_desc, [pid_m * BLOCK_M + WG * HALF, pid_n * BLOCK_N], c_buf)
    tma.store_wait(0)


@gluon.jit
def _consume0(
    a_desc, b_desc, c_desc, a_smem, b_smem, c_smem, ready, empty, args, num_m_tiles, num_n_tiles, GROUP_M
):
    _consume(0, c_desc, a_smem, b_smem, c_smem, ready, empty, args, num_m_tiles, num_n_tiles, GROUP_M)


@gluon.jit
def _consume1(
    a_desc, b_desc, c_desc, a_smem, b_smem, c_smem, ready, empty, args, num_m_tiles, num_n_tiles, GROUP_M
):
    _consume(1, c_desc, a_smem, b_smem, c_smem, ready, empty, args, num_m_tiles, num_n_tiles, GROUP_M)


@gluon.jit
def _load(
    a_desc, b_desc, c_desc, a_smem, b_smem, c_smem, ready, empty, args, num_m_tiles, num_n_tiles, GROUP_M
):
    _produce(
        a_desc, b_desc, a_smem, b_smem, ready, empty, num_m_tiles, num_n_tiles, args.num_k_blocks, GROUP_M
    )


# The token count and the tile counts change with every step: not specialised on.
@gluon.jit(do_not_specialize=["M", "N", "num_k_blocks", "num_m_tiles", "num_n_tiles"])
def _block_fp8_gemm_kernel(
    a_desc, b_desc, c_desc, A_s, B_s, M, N, num_k_blocks, num_m_tiles, num_n_tiles,
    stride_asm, stride_ask, stride_bsn, stride_bsk,
    STAGES: gl.constexpr, GROUP_M: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):  # fmt: skip
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    c_smem = gl.allocate_shared_memory(
        c_desc.dtype, [2, HALF, BLOCK_N], c_desc.layout
    )  # a staging tile per consumer
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    fence_async_shared()
    cta_barrier()
    args = _Args(A_s, B_s, M, N, num_k_blocks, stride_asm, stride_ask, stride_bsn, stride_bsk)
    parts = (
        a_desc,
        b_desc,
        c_desc,
        a_smem,
        b_smem,
        c_smem,
        ready,
        empty,
        args,
        num_m_tiles,
        num_n_tiles,
        GROUP_M,
    )
    gl.warp_specialize(
        [(_consume0, parts), (_consume1, parts), (_load, parts)],
        [4, 1],
        [CONSUMER_REGS, 24],
    )


_gemm_launch = FastLaunch(_block_fp8_gemm_kernel)


@functools.cache
def _layout(shape: tuple[int, int], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """A TMA box's shared-memory layout, built once (Gluon takes microseconds per call)."""
    gl_dtype = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[
        dtype
    ]
    return gl.NVMMASharedLayout.get_default_for(list(shape), gl_dtype)


def _descriptor(t: torch.Tensor, box: tuple[int, int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, list(box), _layout(box, t.dtype))


def supports(a: torch.Tensor, b: torch.Tensor, block_size: Sequence[int], output_dtype: torch.dtype) -> bool:
    """Operands this kernel takes: [128, 128] weight blocks, K a multiple of 128, rows of A and B
    contiguous with 16-byte-aligned starts and strides (TMA), and a 16-bit output whose rows are
    16-byte aligned too (N a multiple of 8)."""
    K, N = a.shape[1], b.shape[0]
    return (
        list(block_size) == [BLOCK_N.value, BLOCK_K.value]
        and a.dtype == b.dtype == torch.float8_e4m3fn
        and K % BLOCK_K.value == 0
        and N % 8 == 0
        and a.stride(1) == 1
        and b.stride(1) == 1
        and a.stride(0) % 16 == 0
        and b.stride(0) % 16 == 0
        and a.data_ptr() % 16 == 0
        and b.data_ptr() % 16 == 0
        and output_dtype in (torch.bfloat16, torch.float16)
    )


def launch_block_fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_s: torch.Tensor,
    b_s: torch.Tensor,
    c: torch.Tensor,
    *,
    stages: int = STAGES,
    group_m: int = 8,
) -> None:
    """c [M, N] (contiguous, bf16 or fp16) = the block-scaled product of a [M, K] and b [N, K]
    (e4m3) with a_s [M, K // 128] and b_s [ceil(N / 128), K // 128] (float32, any strides), as
    `fp8_gemm.w8a8_block_fp8_matmul` defines it; `supports(a, b, [128, 128], c.dtype)` must hold."""
    if not 2 <= stages <= 5:  # five 32 KiB slots and the staging tiles fill the 227 KiB
        raise ValueError(f"fp8_gemm_hopper: stages must be 2 to 5, got {stages}")
    M, K = a.shape
    N = b.shape[0]
    num_m_tiles, num_n_tiles = cdiv(M, BLOCK_M.value), cdiv(N, BLOCK_N.value)
    tiles = num_m_tiles * num_n_tiles
    if tiles == 0 or K == 0:
        return
    _gemm_launch[(min(tiles, num_sms(a.device.index)),)](
        _descriptor(a, (BLOCK_M.value, BLOCK_K.value)), _descriptor(b, (BLOCK_N.value, BLOCK_K.value)),
        _descriptor(c, (HALF.value, BLOCK_N.value)), a_s, b_s, M, N, K // BLOCK_K.value, num_m_tiles, num_n_tiles,
        a_s.stride(0), a_s.stride(1), b_s.stride(0), b_s.stride(1),
        STAGES=stages, GROUP_M=group_m, CONSUMER_REGS=CONSUMER_REGS, num_warps=4, maxnreg=MAX_REGS,
    )  # fmt: skip


def compile_for_sm90(stages: int = STAGES, output_dtype: torch.dtype = torch.bfloat16):
    """Compile the kernel for sm_90a without a GPU (Triton ships its own ptxas), to read its PTX /
    SASS anywhere: `compile_for_sm90().asm["ptx"]`. Run outside the Triton interpreter."""
    M, N, K = 256, 512, 512  # shapes only name the signature: any will do
    a = torch.empty(M, K, dtype=torch.float8_e4m3fn)
    b = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    c = torch.empty(M, N, dtype=output_dtype)
    args = dict(
        a_desc=_descriptor(a, (BLOCK_M.value, BLOCK_K.value)), b_desc=_descriptor(b, (BLOCK_N.value, BLOCK_K.value)),
        c_desc=_descriptor(c, (HALF.value, BLOCK_N.value)), A_s=torch.empty(M, K // 128),
        B_s=torch.empty(N // 128, K // 128), M=M, N=N, num_k_blocks=K // 128, num_m_tiles=2, num_n_tiles=4,
        stride_asm=1, stride_ask=M, stride_bsn=K // 128, stride_bsk=1,
    )  # fmt: skip
    consts = dict(STAGES=stages, GROUP_M=8, CONSUMER_REGS=CONSUMER_REGS)
    return compile_gluon_for_sm90(_block_fp8_gemm_kernel, args, consts, {"num_warps": 4, "maxnreg": MAX_REGS})
