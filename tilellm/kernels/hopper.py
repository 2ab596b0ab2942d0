"""Attention kernels for Hopper (sm_90) written in Gluon: packed causal prefill, and paged
attention for prompt chunks over a cached prefix. The algorithm of `prefill.py` / `paged.py`
with FlashAttention-3's schedule, which Triton's `tl.dot` cannot express.

Why a second pair of kernels. In the Triton kernels each `tl.dot` waits for its tensor-core
result, so a program's softmax and its matrix products run in series; only a second program
on the same SM fills the tensor cores while the first computes exponentials. Hopper's
warpgroup MMA (`wgmma`) is asynchronous, its TMA engine copies tiles on its own, and warps can
be given different jobs. Gluon (`triton.experimental.gluon`, Triton's lower-level dialect)
exposes all three, so this kernel writes FlashAttention-3's schedule out:

- Warp specialisation. One producer warp issues the TMA copies of the Q tile and of every K/V
  tile into a ring of `STAGES` shared-memory slots. K and V of a slot have their own "ready"
  barriers (Q K^T can start before V lands); the slot has an "empty" barrier that both
  consumers arrive on when they are done with it. Two consumer warpgroups of 4 warps own 64
  query rows each; no CTA-wide barrier ties them in the loop.
- Intra-warpgroup overlap. Each consumer, per key tile j:

      issue  S_j  = Q K_j^T                 (async, tensor cores)
      issue  O   += P_{j-1} V_{j-1}         (async, queued behind S_j)
      wait for S_j only; softmax(S_j)       (CUDA cores and the SFU, while P V runs)
      wait for P V; release the slot; O *= alpha_j

- Ping-pong. The consumers take turns issuing their products (two "turn" barriers), so one's
  softmax tends to run while the other's products hold the tensor cores.

One program = (query tile of 128 tokens, query head, request); query tiles launch fastest,
longest first. Query token t of a request sits at position `context + t` (context = keys cached
before this step: 0 for prefill) and sees keys 0..position. Key tiles wholly below every row's
diagonal run unmasked; tiles crossing it build the mask in registers; future tiles are never
visited. The two kernels differ only in where the producer finds K/V:

- prefill: K/V rows are packed like Q ([T, Hkv * D]): one TMA box per tile.
- paged: key p of a request lives in cache row `block_table[req, p // page] * page + p % page`
  ([num_blocks * page, Hkv * D]): the producer reads the block table and copies each page of the
  tile with its own TMA box into consecutive rows of the slot (pages of 16 keys fill a 128-key
  slot in 8 copies, all completing on one barrier), so the consumers see one dense tile and one
  wgmma covers 128 keys. Pages the tile needs past the request's last key are copied from
  beyond the end of the cache, which TMA fills with zeros.

Cache contents: in a request's last page, the rows past its last key are copied too (a TMA box
cannot be cut short) and meet P = 0 in P V; they must hold finite values, or 0 x inf = NaN would
reach valid rows. The engine's pool starts zeroed and only ever holds stored K/V; `paged.py`
masks these loads instead.

GQA: a query head reads its KV head (`head // group`); heads of one group launch next to each
other, so their K/V tiles come from L2. On an H200 (`tilellm bench kernels`):
P2 607-611 TFLOP/s vs 527-536 for `prefill.py` and 581-595 for cuDNN; P1 480-482 vs 455 and
445-457; C1 618 vs 347 for `paged.py`. Without ping-pong P2 varied from 529 to 622 between runs;
an earlier lockstep version (one CTA barrier per tile, no producer warp) reached 508.
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

from tilellm.kernels.config import GLUON_KEY_TILE, GLUON_QUERY_TILE
from tilellm.kernels.fp8 import FP8_DTYPE

# Gluon's names moved between Triton releases; each alias takes what the installed one offers.
# A CTA-wide barrier: `gl.thread_barrier()` in Triton 3.6, `gl.barrier()` from 3.7 on.
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
# A TMA copy global -> shared: `async_copy_global_to_shared` up to 3.8, `async_load` from 3.8 on.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

QUERY_TILE = GLUON_QUERY_TILE  # query tokens per program: two consumer warpgroups of 64 (one wgmma's height)
BLOCK_M = gl.constexpr(QUERY_TILE)
KEY_TILE = GLUON_KEY_TILE  # keys per K/V tile (the launchers' default)
CONSUMER_REGS = 240  # registers a consumer thread gets once the producer gives its share back
# 4 + 4 consumer warps + 1 producer warp run as three warpgroups: 168 x 384 threads fit the
# 64K-register file before the producer shrinks to 24 and the consumers grow to 240.
MAX_REGS = 168
# An FP8 cache's producer is a whole warpgroup (its 4 warps widen the e4m3 tiles): it keeps
# more registers, and the consumers take fewer.
FP8_CONSUMER_REGS = 232
FP8_LOADER_REGS = 40
FP8_STAGES = 2  # K/V slots in each ring: 32 KB of Q + 2 x (64 KB 16-bit + 32 KB e4m3) = 224 KB


@gluon.jit
def _softmax_tile(s, m_i, l_i, q_pos, tile, n_full, qk_scale, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Online-softmax step on one score tile (fp32, base 2, scale folded into `qk_scale`).

    Tiles at or past `n_full` cross the diagonal: they mask `key > query` in registers. (Rows of
    tokens past the request's end are computed and never stored; every row sees key 0, so no
    row is all -inf.) Returns (p, alpha, new max, new sum).
    """
    if tile >= n_full:
        k_pos = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@gluon.jit
def _load_q(q_desc, q_smem, q_bars, q_start, m_start, head):
    half: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    for w in gl.static_range(2):
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
        tma_load(q_desc, [q_start + m_start + w * half, head * HEAD_DIM], q_bars.index(w), q_smem.index(w))


@gluon.jit
def _load_packed(descs, smem, bars, prog):
    """Producer warp (prefill): Q, then each key tile's K and V, one TMA box each, into the ring;
    a slot is refilled once both consumers have released it."""
    q_desc, k_desc, v_desc = descs
    q_smem, k_smem, v_smem = smem
    q_bars, k_bars, v_bars, empty_bars, turn_bars = bars
    (
        q_start,
        q_len,
        context,
        m_start,
        head,
        kv_col,
        qk_scale,
        o_scale,
        O,
        stride_ot,
        stride_oh,
        bt_row,
        page,
        oob,
    ) = prog
    _load_q(q_desc, q_smem, q_bars, q_start, m_start, head)
    stages: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    n_tiles = gl.cdiv(context + gl.minimum(m_start + BLOCK_M, q_len), BLOCK_N)
    for j in range(n_tiles):
        slot = j % stages
        # a fresh mbarrier counts as having completed the phase before 0: the first pass is free
        mbarrier.wait(empty_bars.index(slot), ((j // stages) & 1) ^ 1)
        row = q_start + j * BLOCK_N
        mbarrier.expect(k_bars.index(slot), k_desc.block_type.nbytes)
        tma_load(k_desc, [row, kv_col], k_bars.index(slot), k_smem.index(slot))
        mbarrier.expect(v_bars.index(slot), v_desc.block_type.nbytes)
        tma_load(v_desc, [row, kv_col], v_bars.index(slot), v_smem.index(slot))


@gluon.jit
def _copy_pages(k_desc, v_desc, k_dst, v_dst, k_bar, v_bar, j, kv_end, bt_row, page, oob, kv_col):
    """Key tile j of a paged request into (k_dst, v_dst), one TMA box per page, all completing
    on (k_bar, v_bar); pages past the request's last needed key come from past the cache's end
    (zeros)."""
    BLOCK_N: gl.constexpr = k_dst.type.shape[0]
    BOX: gl.constexpr = k_desc.block_type.shape[0]  # keys per copy: min(page, BLOCK_N)
    mbarrier.expect(k_bar, k_desc.block_type.nbytes * (BLOCK_N // BOX))
    mbarrier.expect(v_bar, v_desc.block_type.nbytes * (BLOCK_N // BOX))
    for i in gl.static_range(BLOCK_N // BOX):
        key = j * BLOCK_N + i * BOX
        needed = key < kv_end
        block = gl.load(bt_row + key // page, mask=needed, other=0)
        row = gl.where(needed, block * page + key % page, oob)
        tma_load(k_desc, [row, kv_col], k_bar, k_dst.slice(i * BOX, BOX))
        tma_load(v_desc, [row, kv_col], v_bar, v_dst.slice(i * BOX, BOX))


@gluon.jit
def _load_paged(descs, smem, bars, prog):
    """Producer warp (paged): Q, then each key tile assembled page by page through the block
    table (`_copy_pages`), into the ring."""
    q_desc, k_desc, v_desc = descs
    q_smem, k_smem, v_smem = smem
    q_bars, k_bars, v_bars, empty_bars, turn_bars = bars
    (
        q_start,
        q_len,
        context,
        m_start,
        head,
        kv_col,
        qk_scale,
        o_scale,
        O,
        stride_ot,
        stride_oh,
        bt_row,
        page,
        oob,
    ) = prog
    _load_q(q_desc, q_smem, q_bars, q_start, m_start, head)
    stages: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    kv_end = context + gl.minimum(m_start + BLOCK_M, q_len)
    n_tiles = gl.cdiv(kv_end, BLOCK_N)
    for j in range(n_tiles):
        slot = j % stages
        mbarrier.wait(empty_bars.index(slot), ((j // stages) & 1) ^ 1)
        _copy_pages(
            k_desc, v_desc, k_smem.index(slot), v_smem.index(slot), k_bars.index(slot), v_bars.index(slot),
            j, kv_end, bt_row, page, oob, kv_col,
        )  # fmt: skip


@gluon.jit
def _widen(src, dst):
    """An e4m3 tile in shared memory -> the MMA dtype in another (exact: every e4m3 value is a
    16-bit float), 16 rows at a time by the partition's 4 warps."""
    ROWS: gl.constexpr = 16
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    for c in gl.static_range(src.type.shape[0] // ROWS):
        x = src.slice(c * ROWS, ROWS).load(layout)
        dst.slice(c * ROWS, ROWS).store(x.to(dst.dtype))


@gluon.jit
def _load_paged_fp8(descs, smem, bars, prog):
    """Producer warpgroup (paged, FP8 cache): pages copied by TMA into a ring of e4m3 slots, then
    widened by these 4 warps into the consumers' 16-bit ring (wgmma takes no e4m3 operand beside
    a 16-bit one). Copies run `stages8` tiles ahead of the widening."""
    q_desc, k_desc, v_desc = descs
    q_smem, k_smem, v_smem, k8_smem, v8_smem = smem
    q_bars, k_bars, v_bars, empty_bars, turn_bars, k8_bars, v8_bars = bars
    (
        q_start,
        q_len,
        context,
        m_start,
        head,
        kv_col,
        qk_scale,
        o_scale,
        O,
        stride_ot,
        stride_oh,
        bt_row,
        page,
        oob,
    ) = prog
    _load_q(q_desc, q_smem, q_bars, q_start, m_start, head)
    stages: gl.constexpr = k_smem.type.shape[0]
    stages8: gl.constexpr = k8_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    kv_end = context + gl.minimum(m_start + BLOCK_M, q_len)
    n_tiles = gl.cdiv(kv_end, BLOCK_N)
    for j in gl.static_range(stages8):
        if j < n_tiles:
            _copy_pages(
                k_desc, v_desc, k8_smem.index(j), v8_smem.index(j), k8_bars.index(j), v8_bars.index(j),
                j, kv_end, bt_row, page, oob, kv_col,
            )  # fmt: skip
    for j in range(n_tiles):
        slot = j % stages
        slot8 = j % stages8
        phase8 = (j // stages8) & 1
        mbarrier.wait(empty_bars.index(slot), ((j // stages) & 1) ^ 1)
        mbarrier.wait(k8_bars.index(slot8), phase8)
        _widen(k8_smem.index(slot8), k_smem.index(slot))
        # every warp's rows written, and visible to the tensor cores' (async) reads, before the
        # one arrival that hands the slot over
        fence_async_shared()
        cta_barrier()
        mbarrier.arrive(k_bars.index(slot), count=1)
        mbarrier.wait(v8_bars.index(slot8), phase8)
        _widen(v8_smem.index(slot8), v_smem.index(slot))
        fence_async_shared()
        cta_barrier()
        mbarrier.arrive(v_bars.index(slot), count=1)
        if j + stages8 < n_tiles:  # the e4m3 slot is read: refill it
            _copy_pages(
                k_desc, v_desc, k8_smem.index(slot8), v8_smem.index(slot8), k8_bars.index(slot8),
                v8_bars.index(slot8), j + stages8, kv_end, bt_row, page, oob, kv_col,
            )  # fmt: skip


@gluon.jit
def _consume(WG: gl.constexpr, smem, bars, prog):
    """One consumer warpgroup: 64 query rows against every key tile, with the intra-warpgroup
    overlap, releasing each K/V slot to the producer when its products are done."""
    q_smem, k_smem, v_smem = smem
    q_bars, k_bars, v_bars, empty_bars, turn_bars = bars[0], bars[1], bars[2], bars[3], bars[4]
    (
        q_start,
        q_len,
        context,
        m_start,
        head,
        kv_col,
        qk_scale,
        o_scale,
        O,
        stride_ot,
        stride_oh,
        bt_row,
        page,
        oob,
    ) = prog
    half: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    stages: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    # Ping-pong: the warpgroups take turns issuing their products. Two turn barriers switch it
    # on (a partition takes no constexpr arguments, so the flag rides on the allocation).
    PINGPONG: gl.constexpr = turn_bars.type.shape[0] == 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    row0 = m_start + WG * half  # this warpgroup's first token (local to the request's new tokens)
    n_full = (context + row0 + 1) // BLOCK_N  # key tiles every row of this warpgroup sees whole
    n_tiles = gl.cdiv(context + gl.minimum(m_start + BLOCK_M, q_len), BLOCK_N)
    q = q_smem.index(WG)
    q_pos = context + row0 + gl.arange(0, half, layout=gl.SliceLayout(1, s_layout))
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
    p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, q_pos, 0, n_full, qk_scale, BLOCK_N, s_layout)
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
        # wgmma groups retire in order: one outstanding means S_j is done, P V may still run
        s = warpgroup_mma_wait(1, deps=(s_tok,))
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, q_pos, j, n_full, qk_scale, BLOCK_N, s_layout)
        acc = warpgroup_mma_wait(0, deps=(o_tok,))
        mbarrier.arrive(empty_bars.index(prev), count=1)  # K_{j-1}, V_{j-1} read: slot free
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    last = n_tiles - 1
    mbarrier.wait(v_bars.index(last % stages), (last // stages) & 1)
    o_tok = warpgroup_mma(p_op, v_smem.index(last % stages), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(o_tok,))

    # Normalise and store this warpgroup's rows of one head; tokens past the request's end
    # belong to the next request and are not written.
    acc = acc / gl.convert_layout(l_i / o_scale, gl.SliceLayout(1, o_layout))[:, None]
    tok = row0 + gl.arange(0, half, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = O + (q_start + tok).to(gl.int64)[:, None] * stride_ot + head * stride_oh + cols[None, :]
    gl.store(o_ptrs, acc.to(dtype), mask=(tok < q_len)[:, None])


@gluon.jit
def _consume0(descs, smem, bars, prog):
    _consume(0, smem, bars, prog)


@gluon.jit
def _consume1(descs, smem, bars, prog):
    _consume(1, smem, bars, prog)


# As for paged.py's kernel: per-step values and index arrays (views into the step's payload) are
# not specialised on, or serving would compile a new variant whenever one changed divisibility
# by 16 or alignment.
@gluon.jit(
    do_not_specialize=["stride_bt", "page", "oob_row"],
    do_not_specialize_on_alignment=["cu_seqlens_q", "seq_lens", "block_table", "stats", "k_scale", "v_scale"],
)
def _attention_kernel(
    q_desc, k_desc, v_desc, O, cu_seqlens_q, seq_lens, block_table, stats, k_scale, v_scale,
    qk_scale, stride_ot, stride_oh, stride_bt, page, oob_row,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    PAGED: gl.constexpr, PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr, RECORD_STATS: gl.constexpr,
    KV_FP8: gl.constexpr, KV_LAYOUT: gl.constexpr, LOADER_REGS: gl.constexpr,
):  # fmt: skip
    m_tile = gl.num_programs(0) - 1 - gl.program_id(0)  # longest-first
    head = gl.program_id(1)
    req = gl.program_id(2)
    q_start = gl.load(cu_seqlens_q + req)
    q_len = gl.load(cu_seqlens_q + req + 1) - q_start
    m_start = m_tile * BLOCK_M
    if m_start >= q_len:
        return  # this request has no tokens in this query tile
    if PAGED:
        context = gl.load(seq_lens + req) - q_len
        bt_row = block_table + req.to(gl.int64) * stride_bt
    else:
        context = 0
        bt_row = block_table  # unread
    if RECORD_STATS:
        # The kernel's own account, per program: key tiles visible whole to the tile's first
        # row, and the rest up to the diagonal (masked); later tiles are never visited.
        n_tiles = gl.cdiv(context + gl.minimum(m_start + BLOCK_M, q_len), BLOCK_N)
        n_full = (context + m_start + 1) // BLOCK_N
        pid = (req * gl.num_programs(1) + head) * gl.num_programs(0) + m_tile
        gl.store(stats + pid * 2, n_full)
        gl.store(stats + pid * 2 + 1, n_tiles - n_full)
    # An FP8 cache holds K / k_scale and V / v_scale: k_scale joins the softmax scale and v_scale
    # the output's normalisation (P V is linear in V).
    o_scale = 1.0
    if KV_FP8:
        qk_scale = qk_scale * gl.load(k_scale)
        o_scale = gl.load(v_scale)

    dtype: gl.constexpr = q_desc.dtype
    half: gl.constexpr = BLOCK_M // 2
    q_smem = gl.allocate_shared_memory(dtype, [2, half, HEAD_DIM], q_desc.layout)
    if KV_FP8:
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    else:
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [2 if PINGPONG else 1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(2 if PINGPONG else 1):
        mbarrier.init(turn_bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2)  # one arrival per consumer warpgroup
    if KV_FP8:
        # the e4m3 ring the TMA copies land in, as many slots as the 16-bit one
        k8_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v8_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        k8_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v8_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k8_bars.index(i), count=1)
            mbarrier.init(v8_bars.index(i), count=1)
    fence_async_shared()
    cta_barrier()

    descs = (q_desc, k_desc, v_desc)
    smem = (q_smem, k_smem, v_smem)
    bars = (q_bars, k_bars, v_bars, empty_bars, turn_bars)
    kv_col = (head // GROUP) * HEAD_DIM
    prog = (
        q_start,
        q_len,
        context,
        m_start,
        head,
        kv_col,
        qk_scale,
        o_scale,
        O,
        stride_ot,
        stride_oh,
        bt_row,
        page,
        oob_row,
    )
    if KV_FP8:
        smem8 = (q_smem, k_smem, v_smem, k8_smem, v8_smem)
        bars8 = (q_bars, k_bars, v_bars, empty_bars, turn_bars, k8_bars, v8_bars)
        gl.warp_specialize(
            [(_consume0, (descs, smem, bars, prog)), (_consume1, (descs, smem, bars, prog)),
             (_load_paged_fp8, (descs, smem8, bars8, prog))],
            [4, 4], [CONSUMER_REGS, LOADER_REGS],
        )  # fmt: skip
    elif PAGED:
        gl.warp_specialize(
            [(_consume0, (descs, smem, bars, prog)), (_consume1, (descs, smem, bars, prog)),
             (_load_paged, (descs, smem, bars, prog))],
            [4, 1], [CONSUMER_REGS, 24],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [(_consume0, (descs, smem, bars, prog)), (_consume1, (descs, smem, bars, prog)),
             (_load_packed, (descs, smem, bars, prog))],
            [4, 1], [CONSUMER_REGS, 24],
        )  # fmt: skip


def _check_pipeline(block_n: int, stages: int, *, kv_fp8: bool = False) -> None:
    # One slot deadlocks (a consumer frees tile j-1 only after tile j has arrived in the same
    # slot); four 128-key stages at D = 128 exceed the 227 KB of shared memory, and so do three
    # with an FP8 cache's second ring of e4m3 slots.
    most = 3 if not kv_fp8 or block_n == 64 else 2
    if not 2 <= stages <= most or block_n not in (64, 128):
        raise ValueError(
            f"hopper: stages must be 2..{most} and block_n 64 or 128, got {stages} and {block_n}"
            + (" (FP8 cache)" if kv_fp8 else "")
        )


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, FP8_DTYPE: gl.float8e4nv}


def _smem_layout(block_rows: int, head_dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The MMA-ready shared-memory layout of a [block_rows, head_dim] tile (128-byte swizzle)."""
    return gl.NVMMASharedLayout.get_default_for([block_rows, head_dim], _GL_DTYPES[dtype])


def _descriptor(rows: torch.Tensor, block_rows: int, head_dim: int) -> TensorDescriptor:
    """TMA descriptor over a 2-D row view, boxes of [block_rows, head_dim], 128-byte swizzle."""
    layout = _smem_layout(block_rows, head_dim, rows.dtype)
    return TensorDescriptor.from_tensor(rows, [block_rows, head_dim], layout)


def launch_prefill(
    q_rows: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    o: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    group: int,
    scale_log2: float,
    *,
    block_n: int = KEY_TILE,
    stages: int = 3,
    pingpong: bool = True,
    stats: torch.Tensor | None = None,
) -> None:
    """Causal prefill over the 2-D row views ([T, heads * D], heads packed) that `prefill.py`
    prepares. o: [T, Hq, D]; `scale_log2` is the softmax scale times log2(e); `stats` (int32,
    [B * Hq * query tiles * 2], zeros) receives each program's (full, masked) key-tile counts."""
    _check_pipeline(block_n, stages)
    # no cache: seq_lens and block_table are unread, K/V rows are found like Q's
    _run(
        q_rows, k_rows, v_rows, block_n, o, cu_seqlens, cu_seqlens, cu_seqlens, stats, scale_log2,
        max_seqlen, group, block_n, stages, pingpong, paged=None,
    )  # fmt: skip


def launch_paged(
    q_rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    o: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    group: int,
    scale_log2: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    block_n: int = KEY_TILE,
    stages: int | None = None,
    pingpong: bool = True,
    stats: torch.Tensor | None = None,
) -> None:
    """Paged attention of each request's new tokens over its whole context (no split-KV).

    q_rows: [T, Hq * D] view of the new tokens; k_cache, v_cache: [num_blocks, page, Hkv, D]
    contiguous, page a multiple of 16, in q's dtype or e4m3 (then `k_scale` / `v_scale`: [1]
    float32 dequantization scales, and `stages` K/V slots in each of the e4m3 and the 16-bit
    rings: 2 by default); o: [T, Hq, D]; `stats` as for `launch_prefill`.
    """
    num_blocks, page, num_kv_heads, head_dim = k_cache.shape
    kv_fp8 = k_cache.dtype == FP8_DTYPE
    if stages is None:
        stages = FP8_STAGES if kv_fp8 else 3
    _check_pipeline(block_n, stages, kv_fp8=kv_fp8)
    if page % 16 or (block_n % page and page % block_n):
        raise ValueError(f"hopper.launch_paged: pages of {page} keys do not tile {block_n}-key slots")
    if kv_fp8 and (k_scale is None or v_scale is None):
        raise ValueError("hopper.launch_paged: an FP8 cache needs k_scale and v_scale")
    rows = num_blocks * page  # a row coordinate of `rows` is past the cache: TMA reads zeros
    _run(
        q_rows, k_cache.view(rows, num_kv_heads * head_dim), v_cache.view(rows, num_kv_heads * head_dim),
        min(page, block_n), o, cu_seqlens_q, seq_lens, block_table, stats, scale_log2, max_seqlen_q, group,
        block_n, stages, pingpong, paged=(block_table.stride(0), page, rows), kv_scales=(k_scale, v_scale),
    )  # fmt: skip


def _run(
    q_rows, k_rows, v_rows, box, o, cu_seqlens_q, seq_lens, block_table, stats, scale_log2, max_seqlen_q,
    group, block_n, stages, pingpong, *, paged, kv_scales=(None, None),
):  # fmt: skip
    """One launch: grid (query tiles, query heads, requests); `paged` = (block-table row stride,
    page size, the out-of-bounds row) or None for packed K/V; K/V boxes of `box` rows."""
    num_heads, head_dim = o.shape[1], o.shape[2]
    grid = (triton.cdiv(max(max_seqlen_q, 1), QUERY_TILE), num_heads, cu_seqlens_q.numel() - 1)
    stride_bt, page, oob_row = paged if paged is not None else (0, 1, 0)
    kv_fp8 = k_rows.dtype == FP8_DTYPE
    k_scale, v_scale = kv_scales if kv_fp8 else (cu_seqlens_q, cu_seqlens_q)  # unread unless FP8
    _attention_kernel[grid](
        _descriptor(q_rows, QUERY_TILE // 2, head_dim), _descriptor(k_rows, box, head_dim),
        _descriptor(v_rows, box, head_dim), o, cu_seqlens_q, seq_lens, block_table,
        stats if stats is not None else cu_seqlens_q, k_scale, v_scale, scale_log2, o.stride(0), o.stride(1),
        stride_bt, page, oob_row, **_constexprs(q_rows.dtype, group, head_dim, block_n, stages, paged is not None,
        pingpong, stats is not None, kv_fp8), num_warps=4, maxnreg=MAX_REGS,
    )  # fmt: skip


def _constexprs(dtype, group, head_dim, block_n, stages, paged, pingpong, record_stats, kv_fp8) -> dict:
    return dict(
        GROUP=group, HEAD_DIM=head_dim, BLOCK_N=block_n, STAGES=stages, PAGED=paged, PINGPONG=pingpong,
        CONSUMER_REGS=FP8_CONSUMER_REGS if kv_fp8 else CONSUMER_REGS, RECORD_STATS=record_stats,
        KV_FP8=kv_fp8, KV_LAYOUT=_smem_layout(block_n, head_dim, dtype) if kv_fp8 else None,
        LOADER_REGS=FP8_LOADER_REGS if kv_fp8 else 24,
    )  # fmt: skip


def compile_for_sm90(
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    *,
    paged: bool = False,
    page: int = 16,
    block_n: int = KEY_TILE,
    stages: int | None = None,
    pingpong: bool = True,
    record_stats: bool = False,
    kv_fp8: bool = False,
):
    """Compile a kernel for sm_90a without a GPU (Triton ships its own ptxas), for reading its
    TTGIR / PTX / SASS anywhere: `compile_for_sm90().asm["ptx"]`. Returns Triton's CompiledKernel.

    Run outside the Triton interpreter (TRITON_INTERPRET unset): the interpreter replaces the
    Gluon helpers with Python functions that cannot be compiled.
    """
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    if stages is None:
        stages = FP8_STAGES if kv_fp8 else 3
    T, hq, hkv = 512, 8, 2  # shapes only name the signature: any will do
    q = torch.empty(T, hq * head_dim, dtype=dtype)
    kv = torch.empty(T, hkv * head_dim, dtype=FP8_DTYPE if kv_fp8 else dtype)
    box = min(page, block_n) if paged else block_n
    args = dict(
        q_desc=_descriptor(q, QUERY_TILE // 2, head_dim),
        k_desc=_descriptor(kv, box, head_dim),
        v_desc=_descriptor(kv, box, head_dim),
        O=torch.empty(T, hq, head_dim, dtype=dtype),
        cu_seqlens_q=torch.zeros(2, dtype=torch.int32),
        seq_lens=torch.zeros(1, dtype=torch.int32),
        block_table=torch.zeros(1, 4, dtype=torch.int32),
        stats=torch.zeros(2, dtype=torch.int32),
        k_scale=torch.ones(1),
        v_scale=torch.ones(1),
        qk_scale=0.1,
        stride_ot=hq * head_dim,
        stride_oh=head_dim,
        stride_bt=4,
        page=page,
        oob_row=T,
    )
    consts = _constexprs(
        dtype, hq // hkv, head_dim, block_n, stages, paged or kv_fp8, pingpong, record_stats, kv_fp8
    )
    fn = _attention_kernel
    signature = {n: "constexpr" if n in consts else mangle_type(args[n]) for n in fn.arg_names}
    constexprs = {(fn.arg_names.index(n),): v for n, v in consts.items()}
    src = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": MAX_REGS}
    )
