"""Packed varlen causal prefill for Hopper (sm_90), written in Gluon: the algorithm of
`prefill.py` with FlashAttention-3's schedule, which Triton's `tl.dot` cannot express.

Why a second kernel. In `prefill.py` each `tl.dot` waits for its tensor-core result, so a
program's softmax and its matrix products run in series; only a second program on the same SM
fills the tensor cores while the first computes exponentials. Hopper's warpgroup MMA (`wgmma`)
is asynchronous, its TMA engine copies tiles on its own, and warps can be given different jobs.
Gluon (`triton.experimental.gluon`, Triton's lower-level dialect) exposes all three, so this
kernel writes FlashAttention-3's schedule out:

- Warp specialisation. One producer warp issues the TMA copies of the Q tile and of every K/V
  tile into a ring of `STAGES` shared-memory slots; K and V of a slot have their own "ready"
  barriers (Q K^T can start before V lands) and the slot has an "empty" barrier that both
  consumers arrive on when done with it. Two consumer warpgroups of 4 warps own 64 query rows
  each; no CTA-wide barrier ties them in the loop.
- Intra-warpgroup overlap. Each consumer, per key tile j:

      issue  S_j  = Q K_j^T                 (async, tensor cores)
      issue  O   += P_{j-1} V_{j-1}         (async, queued behind S_j)
      wait for S_j only; softmax(S_j)       (CUDA cores and the SFU, while P V runs)
      wait for P V; release the slot; O *= alpha_j

- Ping-pong. The consumers take turns issuing their products (two "turn" barriers), so one's
  softmax tends to run while the other's products hold the tensor cores.

Grid, launch order (query tiles fastest, longest first), the causal tile walk and the masking
are those of `prefill.py`: tiles wholly below the diagonal run unmasked, tiles crossing it build
the mask in registers from local positions, future tiles are never visited. On an H200 (run 33,
`benchmarks/prefill_hopper.py`): P2 607 TFLOP/s vs 536 for `prefill.py` and 595 for cuDNN; the
same kernel without ping-pong 529-565, in lockstep (one CTA barrier per tile, no producer warp)
508. `config.prefill_config` picks it for D = 128 batches longer than 1024 tokens on sm_90.
"""

from __future__ import annotations

import torch
import triton
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


@gluon.jit
def _softmax_tile(
    s, m_i, l_i, offs_m, tile, n_full, seq_len, qk_scale, BLOCK_N: gl.constexpr, s_layout: gl.constexpr
):
    """Online-softmax step on one score tile (fp32, base 2, scale folded into `qk_scale`).

    Tiles at or past `n_full` cross the diagonal: they mask `key > query` and keys past the
    request's end, in registers. Returns (p, alpha, new max, new sum).
    """
    if tile >= n_full:
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_n < seq_len)[None, :]
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@gluon.jit
def _ws_load(
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, turn_bars,
    seq_start, seq_len, m_start, head, kv_col, qk_scale, O, stride_ot, stride_oh,
):  # fmt: skip
    """Producer warp: the two Q halves, then every key tile's K and V into the ring, each slot
    reused once both consumer warpgroups have released it."""
    half: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    stages: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    for w in gl.static_range(2):
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            q_desc, [seq_start + m_start + w * half, head * HEAD_DIM], q_bars.index(w), q_smem.index(w)
        )
    n_tiles = gl.cdiv(gl.minimum(m_start + 2 * half, seq_len), BLOCK_N)
    for j in range(n_tiles):
        slot = j % stages
        # a fresh mbarrier counts as having completed the phase before 0: the first pass is free
        mbarrier.wait(empty_bars.index(slot), ((j // stages) & 1) ^ 1)
        row = seq_start + j * BLOCK_N
        mbarrier.expect(k_bars.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_bars.index(slot), k_smem.index(slot))
        mbarrier.expect(v_bars.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_bars.index(slot), v_smem.index(slot))


@gluon.jit
def _ws_consume(
    WG: gl.constexpr, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, turn_bars,
    seq_start, seq_len, m_start, head, qk_scale, O, stride_ot, stride_oh,
):  # fmt: skip
    """One consumer warpgroup: 64 query rows against every key tile, the intra-warpgroup
    overlap of `_prefill_hopper_kernel`, releasing each K/V slot to the producer when done."""
    half: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    stages: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    # Ping-pong (FlashAttention-3): the warpgroups take turns issuing their products, so one's
    # softmax runs while the other's products occupy the tensor cores. Two turn barriers turn
    # it on (a partition takes no constexpr arguments, so the flag rides on the allocation).
    PINGPONG: gl.constexpr = turn_bars.type.shape[0] == 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    row0 = m_start + WG * half
    n_full = (row0 + 1) // BLOCK_N
    n_tiles = gl.cdiv(gl.minimum(m_start + 2 * half, seq_len), BLOCK_N)
    q = q_smem.index(WG)
    offs_m = row0 + gl.arange(0, half, layout=gl.SliceLayout(1, s_layout))
    s_zero = gl.zeros([half, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([half, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([half], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([half], gl.float32, gl.SliceLayout(1, s_layout))

    mbarrier.wait(q_bars.index(WG), 0)
    mbarrier.wait(k_bars.index(0), 0)
    if PINGPONG:  # warpgroup 0 goes first: its turn barrier counts as already passed
        mbarrier.wait(turn_bars.index(WG), 1 - WG)
    s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn_bars.index(1 - WG), count=1)
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, offs_m, 0, n_full, seq_len, qk_scale, BLOCK_N, s_layout)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    for j in range(1, n_tiles):
        slot = j % stages
        prev = (j - 1) % stages
        mbarrier.wait(k_bars.index(slot), (j // stages) & 1)
        mbarrier.wait(v_bars.index(prev), ((j - 1) // stages) & 1)
        if PINGPONG:
            mbarrier.wait(turn_bars.index(WG), (j & 1) ^ (1 - WG))
        s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_bars.index(1 - WG), count=1)
        s = warpgroup_mma_wait(1, deps=(s_tok,))
        p, alpha, m_i, l_i = _softmax_tile(
            s, m_i, l_i, offs_m, j, n_full, seq_len, qk_scale, BLOCK_N, s_layout
        )
        acc = warpgroup_mma_wait(0, deps=(o_tok,))
        mbarrier.arrive(empty_bars.index(prev), count=1)  # K_{j-1}, V_{j-1} read: slot free
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    last = n_tiles - 1
    mbarrier.wait(v_bars.index(last % stages), (last // stages) & 1)
    o_tok = warpgroup_mma(p_op, v_smem.index(last % stages), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(o_tok,))

    acc = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    rows = row0 + gl.arange(0, half, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = O + (seq_start + rows).to(gl.int64)[:, None] * stride_ot + head * stride_oh + cols[None, :]
    gl.store(o_ptrs, acc.to(dtype), mask=(rows < seq_len)[:, None])


@gluon.jit
def _ws_consume0(
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, turn_bars,
    seq_start, seq_len, m_start, head, kv_col, qk_scale, O, stride_ot, stride_oh,
):  # fmt: skip
    _ws_consume(
        0, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, turn_bars,
        seq_start, seq_len, m_start, head, qk_scale, O, stride_ot, stride_oh,
    )  # fmt: skip


@gluon.jit
def _ws_consume1(
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, turn_bars,
    seq_start, seq_len, m_start, head, kv_col, qk_scale, O, stride_ot, stride_oh,
):  # fmt: skip
    _ws_consume(
        1, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, turn_bars,
        seq_start, seq_len, m_start, head, qk_scale, O, stride_ot, stride_oh,
    )  # fmt: skip


@gluon.jit
def _prefill_hopper_kernel(
    q_desc, k_desc, v_desc, O, cu_seqlens,
    qk_scale, stride_ot, stride_oh,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr,
):  # fmt: skip
    """FlashAttention-3's warp specialisation: a producer warp issues the TMA copies; two
    consumer warpgroups (64 query rows each) share the K/V ring and run unsynchronised, so one's
    softmax overlaps the other's matrix products (no CTA-wide barrier in the loop)."""
    m_tile = gl.num_programs(0) - 1 - gl.program_id(0)  # longest-first
    head = gl.program_id(1)
    req = gl.program_id(2)
    seq_start = gl.load(cu_seqlens + req)
    seq_len = gl.load(cu_seqlens + req + 1) - seq_start
    m_start = m_tile * BLOCK_M
    if m_start >= seq_len:
        return

    dtype: gl.constexpr = q_desc.dtype
    half: gl.constexpr = BLOCK_M // 2
    q_smem = gl.allocate_shared_memory(dtype, [2, half, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [2 if PINGPONG else 1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 if PINGPONG else 1):
        mbarrier.init(turn_bars.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2)  # one arrival per consumer warpgroup
    fence_async_shared()
    gl.thread_barrier()

    args = (
        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, turn_bars,
        seq_start, seq_len, m_start, head, (head // GROUP) * HEAD_DIM, qk_scale, O, stride_ot, stride_oh,
    )  # fmt: skip
    gl.warp_specialize(
        [(_ws_consume0, args), (_ws_consume1, args), (_ws_load, args)], [4, 1], [CONSUMER_REGS, 24]
    )


def _descriptor(rows: torch.Tensor, block_rows: int, head_dim: int) -> TensorDescriptor:
    gl_dtype = gl.bfloat16 if rows.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, head_dim], gl_dtype)
    return TensorDescriptor.from_tensor(rows, [block_rows, head_dim], layout)


def launch(
    q_rows: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    o: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    group: int,
    scale_log2: float,
    *,
    block_m: int = 128,
    block_n: int = 128,
    stages: int = 3,
    pingpong: bool = True,
) -> None:
    """Launch over the 2-D row views ([T, heads * D], heads packed) that `prefill.py` prepares.

    o: [T, Hq, D] output; `scale_log2` is the softmax scale times log2(e); block_m is split
    between the two consumer warpgroups (64 rows each: the height of one wgmma).
    """
    _, num_heads, head_dim = o.shape
    if block_m != 128:
        raise ValueError(f"prefill_hopper: block_m must be 128 (two warpgroups of 64 rows), got {block_m}")
    grid = (triton.cdiv(max(max_seqlen, 1), block_m), num_heads, cu_seqlens.numel() - 1)
    # Warps: 4 consumers (the default partition) + 4 consumers + 1 producer, padded to three
    # warpgroups. maxnreg 168 x 384 threads fits the 64K-register file; the producer gives its
    # share back (24 a thread) and each consumer warpgroup takes 240.
    _prefill_hopper_kernel[grid](
        _descriptor(q_rows, block_m // 2, head_dim), _descriptor(k_rows, block_n, head_dim),
        _descriptor(v_rows, block_n, head_dim), o, cu_seqlens,
        scale_log2, o.stride(0), o.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
        CONSUMER_REGS=240, PINGPONG=pingpong, num_warps=4, maxnreg=168,
    )  # fmt: skip


def compile_for_sm90(
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    *,
    block_n: int = 128,
    stages: int = 3,
    pingpong: bool = True,
):
    """Compile the kernel for sm_90a without a GPU (Triton ships its own ptxas), for reading its
    TTGIR / PTX / SASS anywhere: `compile_for_sm90().asm["ptx"]`. Returns Triton's CompiledKernel.

    Run outside the Triton interpreter (TRITON_INTERPRET unset): the interpreter replaces the
    Gluon helpers with Python functions that cannot be compiled.
    """
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    T, hq, hkv = 512, 8, 2  # shapes only name the signature: any will do
    q = torch.empty(T, hq * head_dim, dtype=dtype)
    kv = torch.empty(T, hkv * head_dim, dtype=dtype)
    args = dict(
        q_desc=_descriptor(q, 64, head_dim),
        k_desc=_descriptor(kv, block_n, head_dim),
        v_desc=_descriptor(kv, block_n, head_dim),
        O=torch.empty(T, hq, head_dim, dtype=dtype),
        cu_seqlens=torch.zeros(2, dtype=torch.int32),
        qk_scale=0.1,
        stride_ot=hq * head_dim,
        stride_oh=head_dim,
    )
    consts = dict(
        GROUP=hq // hkv, HEAD_DIM=head_dim, BLOCK_M=128, BLOCK_N=block_n, STAGES=stages,
        CONSUMER_REGS=240, PINGPONG=pingpong,
    )  # fmt: skip
    fn = _prefill_hopper_kernel
    signature = {n: "constexpr" if n in consts else mangle_type(args[n]) for n in fn.arg_names}
    constexprs = {(fn.arg_names.index(n),): v for n, v in consts.items()}
    src = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 168})
