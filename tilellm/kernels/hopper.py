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

The work is cut into tiles = (query tile of 128 tokens, query head, request), numbered with the
query tiles fastest, longest first. The launch is persistent: one program per SM claims tiles
from a counter in that order (the SM that frees first takes the next longest, as the hardware
would hand out a grid) until none is left. Within a program the producer hands each tile to the
consumers through a ring of small records, loads warpgroup 0's Q and the first K/V tile as soon
as warpgroup 0 is done with the last tile's Q K^T, and claims the next tile while the consumers
drain the ring: the next tile's copies overlap the last one's products and its output's store,
which a fresh program per tile could not (one 224 KB program fills an SM's shared memory).

Query token t of a request sits at position `context + t` (context = keys cached before this
step: 0 for prefill) and sees keys 0..position. Key tiles wholly below every row's diagonal run
unmasked; tiles crossing it build the mask in registers; future tiles are never visited. The two
kernels differ only in where the producer finds K/V:

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

import functools
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

from tilellm.kernels.config import GLUON_KEY_TILE, GLUON_QUERY_TILE, cdiv, compile_gluon_for_sm90, num_sms
from tilellm.kernels.launch import FastLaunch

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


# A tile's coordinates travel from the producer to the consumers through a ring of shared-memory
# records: (tile id, first token, query head, q_start, q_len, context). Every thread holds the
# whole record (the producer's lanes write the same values; a consumer picks fields in registers).
RECORD = gl.constexpr(8)
RECORD_1: gl.constexpr = gl.BlockedLayout([RECORD], [32], [1], [0])  # the producer warp
RECORD_4: gl.constexpr = gl.BlockedLayout([RECORD], [32], [4], [0])  # a consumer warpgroup
# Records in flight: before writing tile n's record the producer has waited for both consumers to
# be done with tile n-2's Q (its Q copies for tile n-1), so both have read record n-2. Two slots
# would do; four cost 64 bytes more.
TILE_SLOTS = gl.constexpr(4)
LANES_1: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])


# What the partitions share, by name (a partition takes tuples, not constexprs).
class _Launch(NamedTuple):
    """The launch's arguments that the partitions read."""

    O: Any  # [T, Hq, D] output
    cu_seqlens_q: Any  # [B + 1] int32
    seq_lens: Any  # paged: [B] int32 keys per request, this step's included; packed: unread
    block_table: Any  # paged: [B, max_blocks] int32
    stats: Any  # int32 (full, masked) key tiles of each tile, written when record_stats
    tile_counter: Any  # [1] int32, zero at launch: the next tile to claim
    qk_scale: Any  # softmax scale times log2(e)
    stride_ot: Any
    stride_oh: Any
    stride_bt: Any
    page: Any  # keys per page (paged)
    oob_row: Any  # a cache row past the end: TMA reads zeros (paged)
    num_m_tiles: Any  # query tiles of the longest request
    num_heads: Any  # query heads
    num_reqs: Any
    group: Any  # query heads per KV head
    record_stats: Any


class _Descs(NamedTuple):
    q: Any  # TMA descriptors: boxes of [64, D] query rows
    k: Any  # and of [min(page, BLOCK_N) or BLOCK_N, D] key / value rows
    v: Any


class _Smem(NamedTuple):
    q: Any  # [2, 64, D]: each consumer warpgroup's half of the tile's Q
    k: Any  # [STAGES, BLOCK_N, D]: the K/V ring
    v: Any
    tile_info: Any  # [TILE_SLOTS, RECORD] int32: the tile records


class _Bars(NamedTuple):
    q_ready: Any  # [2]: a warpgroup's Q half landed
    q_free: Any  # [2]: a warpgroup is done with its Q half (every Q K^T of its tile issued and done)
    k_ready: Any  # [STAGES]: a slot's K landed
    v_ready: Any  # [STAGES]: its V landed
    empty: Any  # [STAGES]: both warpgroups are done with a slot
    turn: Any  # [2] with ping-pong ([1] without): whose turn it is to issue products
    info: Any  # [TILE_SLOTS]: a tile record is written


@gluon.jit
def _tile_coords(PAGED: gl.constexpr, t, args):
    """Virtual tile t -> (first token, query head, q_start, q_len, context). Tiles of one (query
    head, request) are consecutive, longest first (the one ending nearest the diagonal's end);
    the heads of one request follow each other, so a GQA group's K/V tiles come from L2."""
    cu_seqlens_q, seq_lens = args.cu_seqlens_q, args.seq_lens
    num_m_tiles, num_heads, num_reqs = args.num_m_tiles, args.num_heads, args.num_reqs
    m_tile = num_m_tiles - 1 - t % num_m_tiles
    rest = t // num_m_tiles
    head = rest % num_heads
    req = gl.minimum(rest // num_heads, num_reqs - 1)  # past the last tile: any request, unread
    q_start = gl.load(cu_seqlens_q + req)
    q_len = gl.load(cu_seqlens_q + req + 1) - q_start
    context = q_len * 0  # keys cached before this step's tokens: none in packed prefill
    if PAGED:
        context = gl.load(seq_lens + req) - q_len
    return m_tile * BLOCK_M, head, q_start, q_len, context


@gluon.jit
def _lane0_atomic(ptr, value, MAX: gl.constexpr):
    """One atomic on *ptr by lane 0, its old value in every lane (a scalar atomic would broadcast
    it through a CTA-wide barrier, which a warp-specialised partition cannot pass)."""
    lane = gl.arange(0, 32, layout=LANES_1)
    if MAX:
        old = gl.atomic_max(ptr + lane * 0, lane * 0 + value, mask=lane == 0)
    else:
        old = gl.atomic_add(ptr + lane * 0, lane * 0 + value, mask=lane == 0)
    return gl.max(gl.where(lane == 0, old, 0), 0)


@gluon.jit
def _claim(PAGED: gl.constexpr, args):
    """Producer: the launch's next tile with tokens and its coordinates; an id >= the tile count
    when none is left. The SM that frees first takes the next longest tile, as the hardware
    hands out a grid. A claim landing in a (head, request)'s empty tiles (past a short request's
    end) moves the counter to that pair's first real tile, so other programs skip the run too."""
    tile_counter = args.tile_counter
    num_m_tiles, num_heads, num_reqs = args.num_m_tiles, args.num_heads, args.num_reqs
    total = num_m_tiles * num_heads * num_reqs
    t = _lane0_atomic(tile_counter, 1, False)
    m_start, head, q_start, q_len, context = _tile_coords(PAGED, t, args)
    while (t < total) & (m_start >= q_len):
        _lane0_atomic(tile_counter, t - t % num_m_tiles + num_m_tiles - gl.cdiv(q_len, BLOCK_M), True)
        t = _lane0_atomic(tile_counter, 1, False)
        m_start, head, q_start, q_len, context = _tile_coords(PAGED, t, args)
    return t, m_start, head, q_start, q_len, context


@gluon.jit
def _publish(tile_info, info_bars, i, t, m_start, head, q_start, q_len, context):
    """Producer: tile i's record into its ring slot, then its barrier."""
    f = gl.arange(0, RECORD, layout=RECORD_1)
    rec = gl.where(f == 0, t, gl.where(f == 1, m_start, gl.where(f == 2, head, 0)))
    rec = gl.where(f == 3, q_start, gl.where(f == 4, q_len, gl.where(f == 5, context, rec)))
    tile_info.index(i % TILE_SLOTS).store(rec)
    mbarrier.arrive(info_bars.index(i % TILE_SLOTS), count=1)


@gluon.jit
def _field(rec, f, k: gl.constexpr):
    return gl.sum(gl.where(f == k, rec, 0), 0)  # within each thread's registers


@gluon.jit
def _read(tile_info, info_bars, i):
    """Consumer: tile i's record (tile id, first token, query head, q_start, q_len, context)."""
    mbarrier.wait(info_bars.index(i % TILE_SLOTS), (i // TILE_SLOTS) & 1)
    rec = tile_info.index(i % TILE_SLOTS).load(RECORD_4)
    f = gl.arange(0, RECORD, layout=RECORD_4)
    return (_field(rec, f, 0), _field(rec, f, 1), _field(rec, f, 2), _field(rec, f, 3), _field(rec, f, 4),
            _field(rec, f, 5))  # fmt: skip


@gluon.jit
def _load_kv(PAGED: gl.constexpr, j, it, descs, smem, bars, bt_row, page, oob, group, head, q_start, kv_end):
    """Producer: key tile j of the tile into ring slot (it + j) % STAGES once both consumers
    released it (prefill: one TMA box each for K and V; paged: one box per page through the
    block table, pages past the last needed key from past the cache's end, which reads zeros)."""
    k_desc, v_desc = descs.k, descs.v
    k_smem, v_smem = smem.k, smem.v
    k_bars, v_bars, empty_bars = bars.k_ready, bars.v_ready, bars.empty
    stages: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[2]
    BOX: gl.constexpr = k_desc.block_type.shape[0]  # keys per copy: BLOCK_N packed, min(page, BLOCK_N) paged
    kv_col = (head // group) * HEAD_DIM
    slot = (it + j) % stages
    # a fresh mbarrier counts as having completed the phase before 0: the first pass is free
    mbarrier.wait(empty_bars.index(slot), (((it + j) // stages) & 1) ^ 1)
    mbarrier.expect(k_bars.index(slot), k_desc.block_type.nbytes * (BLOCK_N // BOX))
    mbarrier.expect(v_bars.index(slot), v_desc.block_type.nbytes * (BLOCK_N // BOX))
    if PAGED:
        for b in gl.static_range(BLOCK_N // BOX):
            key = j * BLOCK_N + b * BOX
            needed = key < kv_end
            block = gl.load(bt_row + key // page, mask=needed, other=0)
            row = gl.where(needed, block * page + key % page, oob)
            tma_load(k_desc, [row, kv_col], k_bars.index(slot), k_smem.index(slot).slice(b * BOX, BOX))
            tma_load(v_desc, [row, kv_col], v_bars.index(slot), v_smem.index(slot).slice(b * BOX, BOX))
    else:
        row = q_start + j * BLOCK_N
        tma_load(k_desc, [row, kv_col], k_bars.index(slot), k_smem.index(slot))
        tma_load(v_desc, [row, kv_col], v_bars.index(slot), v_smem.index(slot))


@gluon.jit
def _load_q(w: gl.constexpr, i, descs, smem, bars, head, q_start, m_start):
    """Producer: warpgroup w's half of the tile's Q, once that warpgroup is done with the last tile's."""
    q_desc = descs.q
    q_smem = smem.q
    q_bars, q_free = bars.q_ready, bars.q_free
    half: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    mbarrier.wait(q_free.index(w), (i & 1) ^ 1)
    mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
    tma_load(q_desc, [q_start + m_start + w * half, head * HEAD_DIM], q_bars.index(w), q_smem.index(w))


@gluon.jit
def _produce(PAGED: gl.constexpr, descs, smem, bars, args):
    """Producer warp: claims tiles until none is left; for each, hands its record to the
    consumers and copies Q and every key tile's K and V. Warpgroup 0's Q and the first K/V tile
    go first, so warpgroup 0 can start while warpgroup 1 (half a key tile behind, ping-pong)
    still finishes the last tile; the next claim is made while the consumers drain the ring."""
    num_m_tiles, num_heads = args.num_m_tiles, args.num_heads
    BLOCK_N: gl.constexpr = smem.k.type.shape[1]
    total = num_m_tiles * num_heads * args.num_reqs
    it = 0  # key tiles copied so far: the ring position
    i = 0  # tiles taken so far
    t, m_start, head, q_start, q_len, context = _claim(PAGED, args)
    while t < total:
        kv_end = context + gl.minimum(m_start + BLOCK_M, q_len)
        n_tiles = gl.cdiv(kv_end, BLOCK_N)
        req = t // num_m_tiles // num_heads
        if args.record_stats != 0:
            # the kernel's own account, per tile: key tiles visible whole to its first row, and
            # the rest up to the diagonal (masked); later tiles are never visited
            n_full = (context + m_start + 1) // BLOCK_N
            tile = (req * num_heads + head) * num_m_tiles + m_start // BLOCK_M
            gl.store(args.stats + tile * 2, n_full)
            gl.store(args.stats + tile * 2 + 1, n_tiles - n_full)
        bt_row = args.block_table + req.to(gl.int64) * args.stride_bt
        kv = (bt_row, args.page, args.oob_row, args.group, head, q_start, kv_end)
        _publish(smem.tile_info, bars.info, i, t, m_start, head, q_start, q_len, context)
        _load_q(0, i, descs, smem, bars, head, q_start, m_start)
        _load_kv(PAGED, 0, it, descs, smem, bars, *kv)
        _load_q(1, i, descs, smem, bars, head, q_start, m_start)
        for j in range(1, n_tiles):
            _load_kv(PAGED, j, it, descs, smem, bars, *kv)
        it += n_tiles
        i += 1
        t, m_start, head, q_start, q_len, context = _claim(PAGED, args)
    _publish(smem.tile_info, bars.info, i, total, 0, 0, 0, 0, 0)  # an id past the end stops the consumers


@gluon.jit
def _load_packed(descs, smem, bars, args):
    _produce(False, descs, smem, bars, args)


@gluon.jit
def _load_paged(descs, smem, bars, args):
    _produce(True, descs, smem, bars, args)


@gluon.jit
def _consume(WG: gl.constexpr, smem, bars, args):
    """One consumer warpgroup: for each tile the producer hands over, its 64 query rows against
    every key tile, with the intra-warpgroup overlap, releasing each K/V slot to the producer
    when its products are done; the tile's output is stored while the producer already fills
    the ring with the next tile's."""
    q_smem, k_smem, v_smem, tile_info = smem
    q_bars, q_free, k_bars, v_bars, empty_bars, turn_bars, info_bars = bars
    O, qk_scale, stride_ot, stride_oh = args.O, args.qk_scale, args.stride_ot, args.stride_oh
    num_m_tiles, num_heads, num_reqs = args.num_m_tiles, args.num_heads, args.num_reqs
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
    s_zero = gl.zeros([half, BLOCK_N], gl.float32, s_layout)
    q = q_smem.index(WG)
    total = num_m_tiles * num_heads * num_reqs

    it = 0  # key tiles consumed so far: the ring position, and the ping-pong turn
    i = 0  # tiles taken so far
    t, m_start, head, q_start, q_len, context = _read(tile_info, info_bars, i)
    while t < total:
        row0 = m_start + WG * half  # this warpgroup's first token (local to the request's new tokens)
        n_full = (context + row0 + 1) // BLOCK_N  # key tiles every row of this warpgroup sees whole
        n_tiles = gl.cdiv(context + gl.minimum(m_start + BLOCK_M, q_len), BLOCK_N)
        q_pos = context + row0 + gl.arange(0, half, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([half, HEAD_DIM], gl.float32, o_layout)
        m_i = gl.full([half], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([half], gl.float32, gl.SliceLayout(1, s_layout))

        mbarrier.wait(q_bars.index(WG), i & 1)
        mbarrier.wait(k_bars.index(it % stages), (it // stages) & 1)
        if PINGPONG:  # warpgroup 0 goes first: its turn barrier counts as already passed
            mbarrier.wait(turn_bars.index(WG), (it & 1) ^ (1 - WG))
        k_t = k_smem.index(it % stages).permute((1, 0))
        s_tok = warpgroup_mma(q, k_t, s_zero, use_acc=False, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_bars.index(1 - WG), count=1)
        s = warpgroup_mma_wait(0, deps=(s_tok,))
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, q_pos, 0, n_full, qk_scale, BLOCK_N, s_layout)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, n_tiles):
            g = it + j  # this key tile's place in the ring's sequence
            slot = g % stages
            prev = (g - 1) % stages
            mbarrier.wait(k_bars.index(slot), (g // stages) & 1)
            mbarrier.wait(v_bars.index(prev), ((g - 1) // stages) & 1)
            if PINGPONG:
                mbarrier.wait(turn_bars.index(WG), (g & 1) ^ (1 - WG))
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
        mbarrier.arrive(q_free.index(WG), count=1)  # every Q K^T of the tile is done: Q's half is free
        last = it + n_tiles - 1
        mbarrier.wait(v_bars.index(last % stages), (last // stages) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(last % stages), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(o_tok,))
        mbarrier.arrive(empty_bars.index(last % stages), count=1)

        # Normalise and store this warpgroup's rows of one head; tokens past the request's end
        # belong to the next request and are not written.
        acc = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
        tok = row0 + gl.arange(0, half, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = O + (q_start + tok).to(gl.int64)[:, None] * stride_ot + head * stride_oh + cols[None, :]
        gl.store(o_ptrs, acc.to(dtype), mask=(tok < q_len)[:, None])
        it += n_tiles
        i += 1
        t, m_start, head, q_start, q_len, context = _read(tile_info, info_bars, i)


@gluon.jit
def _consume0(descs, smem, bars, args):
    _consume(0, smem, bars, args)


@gluon.jit
def _consume1(descs, smem, bars, args):
    _consume(1, smem, bars, args)


# As for paged.py's kernel: per-step values and index arrays (views into the step's payload) are
# not specialised on, or serving would compile a new variant whenever one changed divisibility
# by 16 or alignment.
@gluon.jit(
    do_not_specialize=["stride_bt", "page", "oob_row", "num_m_tiles", "num_heads", "num_reqs", "group"],
    do_not_specialize_on_alignment=["cu_seqlens_q", "seq_lens", "block_table", "stats", "tile_counter"],
)
def _attention_kernel(
    q_desc, k_desc, v_desc, O, cu_seqlens_q, seq_lens, block_table, stats, tile_counter,
    qk_scale, stride_ot, stride_oh, stride_bt, page, oob_row, num_m_tiles, num_heads, num_reqs, group,
    record_stats,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    PAGED: gl.constexpr, PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = q_desc.dtype
    half: gl.constexpr = BLOCK_M // 2
    q_smem = gl.allocate_shared_memory(dtype, [2, half, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    tile_info = gl.allocate_shared_memory(
        gl.int32, [TILE_SLOTS, RECORD], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    )
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    info_bars = gl.allocate_shared_memory(gl.int64, [TILE_SLOTS, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [2 if PINGPONG else 1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(q_free.index(i), count=1)  # one consumer warpgroup each
    for i in gl.static_range(TILE_SLOTS):
        mbarrier.init(info_bars.index(i), count=1)
    for i in gl.static_range(2 if PINGPONG else 1):
        mbarrier.init(turn_bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2)  # one arrival per consumer warpgroup
    fence_async_shared()
    cta_barrier()

    descs = _Descs(q_desc, k_desc, v_desc)
    smem = _Smem(q_smem, k_smem, v_smem, tile_info)
    bars = _Bars(q_bars, q_free, k_bars, v_bars, empty_bars, turn_bars, info_bars)
    args = _Launch(
        O, cu_seqlens_q, seq_lens, block_table, stats, tile_counter,
        qk_scale, stride_ot, stride_oh, stride_bt, page, oob_row,
        num_m_tiles, num_heads, num_reqs, group, record_stats,
    )  # fmt: skip
    if PAGED:
        gl.warp_specialize(
            [(_consume0, (descs, smem, bars, args)), (_consume1, (descs, smem, bars, args)),
             (_load_paged, (descs, smem, bars, args))],
            [4, 1], [CONSUMER_REGS, 24],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [(_consume0, (descs, smem, bars, args)), (_consume1, (descs, smem, bars, args)),
             (_load_packed, (descs, smem, bars, args))],
            [4, 1], [CONSUMER_REGS, 24],
        )  # fmt: skip


_attention_launch = FastLaunch(_attention_kernel)


def _check_pipeline(block_n: int, stages: int) -> None:
    # One slot deadlocks (a consumer frees tile j-1 only after tile j has arrived in the same
    # slot); four 128-key stages at D = 128 exceed the 227 KB of shared memory.
    if not 2 <= stages <= 3 or block_n not in (64, 128):
        raise ValueError(f"hopper: stages must be 2 or 3 and block_n 64 or 128, got {stages} and {block_n}")


def _descriptor(rows: torch.Tensor, block_rows: int, head_dim: int) -> TensorDescriptor:
    """TMA descriptor over a 2-D row view, boxes of [block_rows, head_dim], 128-byte swizzle."""
    return TensorDescriptor.from_tensor(
        rows, [block_rows, head_dim], _box_layout(block_rows, head_dim, rows.dtype)
    )


@functools.cache
def _box_layout(block_rows: int, head_dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a [block_rows, head_dim] box: a pure function of the box,
    computed once (Gluon's `get_default_for` takes about 6 us of host time a call, three a launch)."""
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([block_rows, head_dim], gl_dtype)


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
    [B * Hq * query tiles * 2], zeros) receives each tile's (full, masked) key-tile counts."""
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
    block_n: int = KEY_TILE,
    stages: int = 3,
    pingpong: bool = True,
    stats: torch.Tensor | None = None,
) -> None:
    """Paged attention of each request's new tokens over its whole context (no split-KV).

    q_rows: [T, Hq * D] view of the new tokens; k_cache, v_cache: [num_blocks, page, Hkv, D]
    contiguous, page a multiple of 16; o: [T, Hq, D]; `stats` as for `launch_prefill`.
    """
    num_blocks, page, num_kv_heads, head_dim = k_cache.shape
    _check_pipeline(block_n, stages)
    if page % 16 or (block_n % page and page % block_n):
        raise ValueError(f"hopper.launch_paged: pages of {page} keys do not tile {block_n}-key slots")
    rows = num_blocks * page  # a row coordinate of `rows` is past the cache: TMA reads zeros
    _run(
        q_rows, k_cache.view(rows, num_kv_heads * head_dim), v_cache.view(rows, num_kv_heads * head_dim),
        min(page, block_n), o, cu_seqlens_q, seq_lens, block_table, stats, scale_log2, max_seqlen_q, group,
        block_n, stages, pingpong, paged=(block_table.stride(0), page, rows),
    )  # fmt: skip


def _run(
    q_rows, k_rows, v_rows, box, o, cu_seqlens_q, seq_lens, block_table, stats, scale_log2, max_seqlen_q,
    group, block_n, stages, pingpong, *, paged,
):  # fmt: skip
    """One persistent launch over the tiles (query tile, query head, request): a program per SM,
    each claiming tiles from a counter until none is left, so the next tile's Q and K/V copies
    overlap the last one's products and its output's store. `paged` = (block-table row stride,
    page size, the out-of-bounds row) or None for packed K/V; K/V boxes of `box` rows."""
    num_heads, head_dim = o.shape[1], o.shape[2]
    num_m_tiles, num_reqs = cdiv(max(max_seqlen_q, 1), QUERY_TILE), cu_seqlens_q.numel() - 1
    total = num_m_tiles * num_heads * num_reqs
    if total == 0:
        return
    programs = min(total, num_sms(o.device.index))
    if total + programs >= 2**31:  # tile ids and the counter (which ends at total + programs) are int32
        raise ValueError(
            f"hopper: {num_m_tiles} query tiles x {num_heads} heads x {num_reqs} requests is more tiles than one "
            "launch numbers (2^31); split the batch, or pass the true max_seqlen_q"
        )
    tile_counter = torch.zeros(1, dtype=torch.int32, device=o.device)
    stride_bt, page, oob_row = paged if paged is not None else (0, 1, 0)
    _attention_launch[(programs,)](
        _descriptor(q_rows, QUERY_TILE // 2, head_dim), _descriptor(k_rows, box, head_dim),
        _descriptor(v_rows, box, head_dim), o, cu_seqlens_q, seq_lens, block_table,
        stats if stats is not None else cu_seqlens_q, tile_counter, scale_log2, o.stride(0), o.stride(1),
        stride_bt, page, oob_row, num_m_tiles, num_heads, num_reqs, group, int(stats is not None),
        HEAD_DIM=head_dim, BLOCK_N=block_n, STAGES=stages, PAGED=paged is not None, PINGPONG=pingpong,
        CONSUMER_REGS=CONSUMER_REGS, num_warps=4, maxnreg=MAX_REGS,
    )  # fmt: skip


def compile_for_sm90(
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    *,
    paged: bool = False,
    page: int = 16,
    block_n: int = KEY_TILE,
    stages: int = 3,
    pingpong: bool = True,
    record_stats: bool = False,
):
    """Compile a kernel for sm_90a without a GPU (Triton ships its own ptxas), for reading its
    TTGIR / PTX / SASS anywhere: `compile_for_sm90().asm["ptx"]`. Returns Triton's CompiledKernel.

    Run outside the Triton interpreter (TRITON_INTERPRET unset): the interpreter replaces the
    Gluon helpers with Python functions that cannot be compiled.
    """
    T, hq, hkv = 512, 8, 2  # shapes only name the signature: any will do
    q = torch.empty(T, hq * head_dim, dtype=dtype)
    kv = torch.empty(T, hkv * head_dim, dtype=dtype)
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
        tile_counter=torch.zeros(1, dtype=torch.int32),
        qk_scale=0.1,
        stride_ot=hq * head_dim,
        stride_oh=head_dim,
        stride_bt=4,
        page=page,
        oob_row=T,
        num_m_tiles=4,
        num_heads=hq,
        num_reqs=1,
        group=hq // hkv,
        record_stats=int(record_stats),
    )
    consts = dict(
        HEAD_DIM=head_dim, BLOCK_N=block_n, STAGES=stages, PAGED=paged, PINGPONG=pingpong,
        CONSUMER_REGS=CONSUMER_REGS,
    )  # fmt: skip
    return compile_gluon_for_sm90(_attention_kernel, args, consts, {"num_warps": 4, "maxnreg": MAX_REGS})
