"""Paged decode (and verification of a few tokens) over an FP8 (e4m3) KV cache, written in
Gluon for sm_90: the decode case of `paged.py` with no shared memory in its loop.

Why a second kernel. An FP8 cache halves the bytes a decode step reads, so the kernel must do
its work per key in half the time to stay at the copy rate. In `paged.py` Triton copies an e4m3
tile into shared memory, then reads it back in the tensor cores' operand layout, two bytes at a
time, and widens it there: about 36 warp-instructions a key on sm_90, against 7 for a bf16
cache. Here every thread loads, from global memory, exactly the bytes its tensor-core operand
registers hold, 16 contiguous bytes a load, widens them in place (`cvt.rn.f16x2.e4m3x2`, one
instruction per two values) and multiplies: no shared memory, no `ldmatrix`.

Two facts make that possible.

- A dot product does not care in which order it sums. The m16n8k16 operand gives a thread the
  reduction indices {2c, 2c+1, 2c+8, 2c+9} of each 16-wide step (c = lane % 4). Relabelling the
  head dimension (`_k_index_to_d`) makes a thread's indices over all steps 16 contiguous bytes
  of a key row; the queries are read in the same order, so the scores are unchanged.
- The output's columns can be relabelled the same way (`_v_index_to_d`): the thread that holds
  output column m holds 16 contiguous bytes of each value row, and the store puts column m back
  at its head dimension d.

The products run transposed, keys in the MMA's 16 rows and the GQA group's query heads in its 8
columns (groups of up to 8 heads): S^T = K Q^T [BLOCK_N, 8], then O^T += V^T P^T [D, 8]. A
decode group has 1-8 heads, so 16-row tiles of heads (as `paged.py` packs them) would be mostly
padding; in this orientation the accumulator is [D, 8], 32 fp32 registers a thread.

Verification (a few new tokens a request, `paged_attention` with `cu_seqlens_q`) uses the same
products with more columns: a request's query rows are its new tokens x the group's heads, row
t * GROUP + h in column order, COLS = 8 or 16 of them a program (more rows: more programs, each
reading the same keys). Each column sees the keys before its own token's end
(causal), so a column may have none in a tile, or in a whole segment (its lse is then -inf).

One program = (KV head x column group, request, key segment), one warp: a request's column
groups are neighbours in launch order, so that the later ones find its keys in L2. The next
tile's bytes are loaded into registers before this tile is computed (its latency hides behind
this tile's products and softmax, and behind the other programs on the SM). The running
maximum moves only when a head's maximum grows past 2^8 of it (FlashAttention-4's lazy
rescaling: probabilities stay below 256, exact to fp16's precision, and most tiles skip the
rescale). `qk_scale * k_scale`
scales the scores, `v_scale` the output; the last tile of a segment is masked in its loads and
scores. Split-KV partials use `paged.py`'s layout and merge (`merge.merge_into`).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from tilellm.kernels.config import DECODE_FP8_MAX_ROWS, compile_gluon_for_sm90
from tilellm.kernels.launch import FastLaunch
from tilellm.kernels.schedule import decode_fp8_grid, fp8_query_columns

# cp.async into shared memory: `async_copy_global_to_shared` in Triton 3.6, `async_load` from 3.7 on
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

LN_2 = gl.constexpr(0.6931471805599453)  # the base-2 log-sum-exp to natural log
MAX_GROUP = 8  # query heads per KV head: the MMA's 8 columns
HEAD_DIMS = (64, 128)
BLOCK_N = 32  # keys per tile: two MMAs of 16 rows
STAGES = 3  # a cp.async ring of this many tiles (0: the next tile prefetched into registers)
# the ring's rows of 16-byte chunks, XOR-swizzled by row: a quarter-warp's 16-byte reads (two
# rows of 64 bytes) fall in distinct banks
RING_LAYOUT = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])


@functools.cache  # (Gluon checks a linear layout in Python as it builds it: once per shape, not per launch)
def _k_load_layout(block_n: int, head_dim: int) -> gl.DistributedLinearLayout:
    """The key tile as stored, [block_n, head_dim / 4] 32-bit words of four e4m3 values (key,
    word): each thread holds the bytes of the A operand (keys x relabelled head dims) it
    multiplies. Registers 0-1 walk the word's low two bits (16 contiguous bytes), lanes 0-1 its
    bits 2-3, lanes 2-4 the key's low bits."""
    regs = [[0, 1], [0, 2]] + ([[0, 16]] if head_dim == 128 else [])
    regs += [[8, 0]] + ([[16, 0]] if block_n == 32 else [])
    lanes = [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [block_n, head_dim // 4])


@functools.cache
def _v_load_layout(block_n: int, head_dim: int) -> gl.DistributedLinearLayout:
    """The value tile as stored, [block_n, head_dim / 4] 32-bit words (key, word): each thread
    holds the bytes of the A operand V^T (relabelled head dims x keys) it multiplies. Registers
    walk the word's low bits (16 contiguous bytes at head dim 128, 8 at 64), then the key's bits
    0 and 3 (the operand's register pairs); lanes 0-1 the key's bits 1-2, lanes 2-4 the word's
    high three bits."""
    low = (head_dim // 32).bit_length() - 1  # word bits held in registers: 2 (128) or 1 (64)
    regs = [[0, 1 << b] for b in range(low)] + [[1, 0], [8, 0]] + ([[16, 0]] if block_n == 32 else [])
    lanes = [[2, 0], [4, 0]] + [[0, 1 << (low + b)] for b in range(3)]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [block_n, head_dim // 4])


@gluon.jit
def _k_index_to_d(k):
    """The head dim d read at reduction index k of S^T = K Q^T: k's bits (6 5 4 3 2 1 0) are d's
    bits (6 3 2 1 5 4 0), so a thread's indices {2c, 2c+1, 2c+8, 2c+9} + 16 s are 16 bytes."""
    return (
        (k & 64)
        + ((k >> 1) & 3) * 16
        + ((k >> 5) & 1) * 8
        + ((k >> 4) & 1) * 4
        + ((k >> 3) & 1) * 2
        + (k & 1)
    )


@gluon.jit
def _v_index_to_d(m, HEAD_DIM: gl.constexpr):
    """The head dim d of output column m of O^T = V^T P^T: m = 8 * lo + hi holds d = hi * D / 8 + lo."""
    return (m % 8) * (HEAD_DIM // 8) + m // 8


@gluon.jit
def _widen(words, N: gl.constexpr, D: gl.constexpr):
    """32-bit words of four e4m3 values [N, D / 4] -> fp16 [N, D]: two `cvt`s a word, whose
    values stay in the thread that loaded them (the loop carries words, not bytes: bytes would
    each take a register)."""
    h0, h1, h2, h3 = gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
        "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
        "=h,=h,=h,=h,r",
        [words],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True,
        pack=1,
    )
    # join appends its new dimension: x[..., j, i] = h(2j + i), so the reshape puts word w's
    # four values at d = 4w .. 4w + 3, in the registers the cvts wrote (no repacking)
    x = gl.join(gl.join(h0, h2), gl.join(h1, h3))
    return gl.reshape(x, [N, D])


@gluon.jit
def _row_ptrs(cache, bt_row, offs_n, offs_d, n, key_end, head_off, stride_cb, stride_cs, PAGE: gl.constexpr):
    """Pointers to the 32-bit words of keys n + offs_n through the block table, [len(offs_n),
    len(offs_d)] in the layout `offs_n` / `offs_d` slice (strides in words), and which keys are
    before `key_end`."""
    k_pos = n + offs_n
    ok = k_pos < key_end
    block = gl.load(bt_row + k_pos // PAGE, mask=ok, other=0)
    # int64: block * stride overflows int32 in large pools.
    row = block.to(gl.int64) * stride_cb + (k_pos % PAGE) * stride_cs + head_off
    return cache + gl.expand_dims(row, 1) + gl.expand_dims(offs_d, 0), gl.expand_dims(ok, 1)


@gluon.jit
def _load_tile(
    K_cache, V_cache, bt_row, offs_kn, offs_kd, offs_vn, offs_vd, n, key_end, head_off, stride_cb, stride_cs,
    PAGE: gl.constexpr,
):  # fmt: skip
    """The K and V words of keys [n, n + BLOCK_N) into registers, each in its operand's load
    layout; keys at or past `key_end` read as zeros."""
    ptrs, ok = _row_ptrs(K_cache, bt_row, offs_kn, offs_kd, n, key_end, head_off, stride_cb, stride_cs, PAGE)
    k = gl.load(ptrs, mask=ok, other=0)
    ptrs, ok = _row_ptrs(V_cache, bt_row, offs_vn, offs_vd, n, key_end, head_off, stride_cb, stride_cs, PAGE)
    v = gl.load(ptrs, mask=ok, other=0)
    return k, v


@gluon.jit
def _copy_tile(
    k_ring, v_ring, slot, K_cache, V_cache, bt_row, offs_kn, offs_kd, offs_vn, offs_vd, n, key_end, head_off,
    stride_cb, stride_cs, PAGE: gl.constexpr,
):  # fmt: skip
    """cp.async the K and V words of keys [n, n + BLOCK_N) into ring slot `slot` (16 bytes a
    copy) as one commit group; keys at or past `key_end` are zero-filled."""
    ptrs, ok = _row_ptrs(K_cache, bt_row, offs_kn, offs_kd, n, key_end, head_off, stride_cb, stride_cs, PAGE)
    _cp_async(k_ring.index(slot), ptrs, mask=ok)
    ptrs, ok = _row_ptrs(V_cache, bt_row, offs_vn, offs_vd, n, key_end, head_off, stride_cb, stride_cs, PAGE)
    _cp_async(v_ring.index(slot), ptrs, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _attend(
    k_raw, v_raw, q_t, acc, m_i, l_i, n, hi, col_hi, scale, offs_s,
    BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, COLS: gl.constexpr, VERIFY: gl.constexpr,
    A_OP: gl.constexpr, B_OP: gl.constexpr, S_ZERO_LAYOUT: gl.constexpr,
):  # fmt: skip
    """One key tile [n, n + BLOCK_N) of the online softmax, from its words in registers. A
    decode program's keys end at `hi` for every column; a verification program's column sees
    keys before its own `col_hi` (causal), so a column may have none yet (its max is -inf)."""
    # K [keys, D] -> A operand, head dims relabelled (d = _k_index_to_d(k)): registers only
    k = gl.reshape(
        _widen(k_raw, BLOCK_N, HEAD_DIM), [BLOCK_N, HEAD_DIM // 64, 4, 4, 2, 2]
    )  # key, d6, d5d4, d3d2, d1, d0
    k = gl.reshape(gl.permute(k, [0, 1, 3, 4, 2, 5]), [BLOCK_N, HEAD_DIM])
    k = gl.convert_layout(k, A_OP, assert_trivial=True)
    # V^T [D, keys] -> A operand, head dims relabelled (d = _v_index_to_d(m)): registers only
    v = gl.reshape(
        _widen(v_raw, BLOCK_N, HEAD_DIM), [BLOCK_N, 8, HEAD_DIM // 8]
    )  # key, d's high 3 bits, low bits
    v = gl.reshape(gl.permute(v, [2, 1, 0]), [HEAD_DIM, BLOCK_N])
    v = gl.convert_layout(v, A_OP, assert_trivial=True)

    s = mma_v2(k, q_t, gl.zeros([BLOCK_N, COLS], gl.float32, S_ZERO_LAYOUT))  # S^T [keys, query rows]
    if VERIFY:
        s = gl.where(gl.expand_dims(n + offs_s, 1) < gl.expand_dims(col_hi, 0), s * scale, float("-inf"))
    else:
        s = gl.where(gl.expand_dims(n + offs_s < hi, 1), s * scale, float("-inf"))
    # decode: finite (a tile holds at least one key); verification: -inf for a column that has
    # seen no key yet
    m_new = gl.maximum(m_i, gl.max(s, 0))
    # Lazy rescaling: the running max moves only when some column's max grows past 2^8 of it;
    # acc and l share the stale max, so the result is unchanged. A column's first keys always
    # move its max (from -inf); one with none yet stays at -inf, neither rescaled nor counted.
    grown = m_new - m_i
    if VERIFY:
        grown = gl.where(m_new == float("-inf"), 0.0, grown)
    if gl.max(grown, 0) > 8.0:
        alpha = gl.exp2(m_i - m_new)
        if VERIFY:
            alpha = gl.where(m_new == float("-inf"), 1.0, alpha)
        acc = acc * gl.expand_dims(alpha, 0)
        l_i = l_i * alpha
        m_i = m_new
    m_ref = m_i
    if VERIFY:
        m_ref = gl.where(m_i == float("-inf"), 0.0, m_i)
    p = gl.exp2(s - gl.expand_dims(m_ref, 0))
    l_i = l_i + gl.sum(p, 0)
    acc = mma_v2(v, gl.convert_layout(p.to(gl.float16), B_OP), acc)
    return acc, m_i, l_i


@gluon.jit(
    do_not_specialize=["num_tokens", "stride_bt", "num_splits", "min_split_keys", "col_groups"],
    # a mixed step's verification half starts its batch tensors at any request (one binary for all)
    do_not_specialize_on_alignment=["block_table", "seq_lens", "cu_seqlens_q", "k_scale", "v_scale"],
)
def _decode_fp8_kernel(
    Q, K_cache, V_cache, O, O_parts, LSE_parts,  # tensors
    k_scale, v_scale,  # [1] float32 dequantization scales
    block_table, seq_lens, cu_seqlens_q,  # batch description (cu_seqlens_q: VERIFY only)
    qk_scale, num_tokens, num_q_heads,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
    num_splits, min_split_keys, col_groups,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
    SPLIT: gl.constexpr, K_LOAD: gl.constexpr, V_LOAD: gl.constexpr, STAGES: gl.constexpr, RING: gl.constexpr,
    COLS: gl.constexpr = 8, VERIFY: gl.constexpr = False,
):  # fmt: skip
    # (schedule.decode_fp8_grid)
    kv_head = gl.program_id(0) // col_groups
    col_group = gl.program_id(0) % col_groups
    req = gl.program_id(1)
    split = gl.program_id(2)

    # -- layouts: one warp; keys (or head dims) in the MMA's rows, query rows in its COLS columns --
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    q_load: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, 1], [0, 1])

    # -- this program's keys: one segment of the request's seq_len keys --
    seq_len = gl.load(seq_lens + req)
    if SPLIT:
        seg = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        seg = gl.maximum(seg, gl.cdiv(min_split_keys, BLOCK_N) * BLOCK_N)  # short requests: fewer segments
        lo = split * seg
        hi = gl.minimum(lo + seg, seq_len)
    else:
        lo = 0
        hi = seq_len

    # -- the program's query rows, as columns: (new token t, head h of the group) at column
    # t * GROUP + h of the request's rows, COLS of them per column group. Decode: one token.
    if VERIFY:
        q_start = gl.load(cu_seqlens_q + req)
        q_len = gl.load(cu_seqlens_q + req + 1) - q_start
        if col_group * COLS >= q_len * GROUP:
            return  # a request of fewer new tokens than the batch's most: no row here
    else:
        q_start = req
        q_len = 1
    # -- Q^T [D, COLS], head dims in the keys' relabelled order --
    k_idx = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, q_load))
    q_cols = col_group * COLS + gl.arange(0, COLS, layout=gl.SliceLayout(0, q_load))
    q_rows = (q_start + q_cols // GROUP).to(gl.int64) * stride_qt + (
        kv_head * GROUP + q_cols % GROUP
    ) * stride_qh
    q_ptrs = Q + gl.expand_dims(q_rows, 0) + gl.expand_dims(_k_index_to_d(k_idx), 1)
    q = gl.load(q_ptrs, mask=gl.expand_dims(q_cols < q_len * GROUP, 0), other=0.0)
    # fp16 dots: e4m3 -> fp16 is one instruction per two values (-> bf16 goes through fp32);
    # every e4m3 value is exact in fp16
    q_t = gl.convert_layout(q.to(gl.float16), b_op)

    cols = col_group * COLS + gl.arange(0, COLS, layout=gl.SliceLayout(0, mma))
    col_ok = cols < q_len * GROUP
    if VERIFY:
        # causal: token t sees the keys before seq_len - q_len + 1 + t (its own among them);
        # padding columns see the segment's keys, as a decode column does
        col_hi = gl.where(col_ok, gl.minimum(seq_len - q_len + 1 + cols // GROUP, hi), hi)
    else:
        col_hi = hi
    m_i = gl.full([COLS], float("-inf"), gl.float32, gl.SliceLayout(0, mma))
    l_i = gl.zeros([COLS], gl.float32, gl.SliceLayout(0, mma))
    acc = gl.zeros([HEAD_DIM, COLS], gl.float32, mma)  # O^T, rows in the values' relabelled order
    scale = qk_scale * gl.load(k_scale)  # scores of stored keys times k_scale, in base 2

    bt_row = block_table + req.to(gl.int64) * stride_bt
    head_off = kv_head * stride_ch
    offs_kn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, K_LOAD))
    offs_kd = gl.arange(0, HEAD_DIM // 4, layout=gl.SliceLayout(0, K_LOAD))
    offs_vn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, V_LOAD))
    offs_vd = gl.arange(0, HEAD_DIM // 4, layout=gl.SliceLayout(0, V_LOAD))
    offs_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    if STAGES == 0:
        # registers: the next tile's words are on their way while this one is computed
        k_raw, v_raw = _load_tile(
            K_cache, V_cache, bt_row, offs_kn, offs_kd, offs_vn, offs_vd, lo, hi, head_off, stride_cb, stride_cs,
            PAGE,
        )  # fmt: skip
        for n in range(lo, hi, BLOCK_N):
            k_cur, v_cur = k_raw, v_raw
            k_raw, v_raw = _load_tile(
                K_cache, V_cache, bt_row, offs_kn, offs_kd, offs_vn, offs_vd, n + BLOCK_N, hi, head_off,
                stride_cb, stride_cs, PAGE,
            )  # fmt: skip
            acc, m_i, l_i = _attend(
                k_cur, v_cur, q_t, acc, m_i, l_i, n, hi, col_hi, scale, offs_s, BLOCK_N, HEAD_DIM, COLS, VERIFY,
                a_op, b_op, mma,
            )  # fmt: skip
    else:
        # a ring of STAGES tiles in shared memory, filled by cp.async: each thread reads back
        # the words it copied itself (the same layout), so only its own copies' completion is
        # waited for (wait_group)
        k_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, HEAD_DIM // 4], RING)
        v_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, HEAD_DIM // 4], RING)
        for i in gl.static_range(STAGES - 1):
            _copy_tile(
                k_ring, v_ring, i, K_cache, V_cache, bt_row, offs_kn, offs_kd, offs_vn, offs_vd, lo + i * BLOCK_N,
                hi, head_off, stride_cb, stride_cs, PAGE,
            )  # fmt: skip
        slot = 0
        for n in range(lo, hi, BLOCK_N):
            async_copy.wait_group(STAGES - 2)
            k_cur = k_ring.index(slot).load(K_LOAD)
            v_cur = v_ring.index(slot).load(V_LOAD)
            # refill the slot read last iteration with the tile STAGES - 1 ahead
            _copy_tile(
                k_ring, v_ring, (slot + STAGES - 1) % STAGES, K_cache, V_cache, bt_row, offs_kn, offs_kd, offs_vn,
                offs_vd, n + (STAGES - 1) * BLOCK_N, hi, head_off, stride_cb, stride_cs, PAGE,
            )  # fmt: skip
            acc, m_i, l_i = _attend(
                k_cur, v_cur, q_t, acc, m_i, l_i, n, hi, col_hi, scale, offs_s, BLOCK_N, HEAD_DIM, COLS, VERIFY,
                a_op, b_op, mma,
            )  # fmt: skip
            slot = (slot + 1) % STAGES
        async_copy.wait_group(0)
    acc = acc * gl.load(v_scale)

    m_idx = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, mma))
    d = gl.expand_dims(_v_index_to_d(m_idx, HEAD_DIM), 1)
    token = q_start + cols // GROUP
    head = kv_head * GROUP + cols % GROUP
    if SPLIT:
        # this segment's normalised output and natural-log lse (-inf if it holds no key)
        empty = l_i == 0.0
        o = acc / gl.expand_dims(gl.where(empty, 1.0, l_i), 0)
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * LN_2)
        part_row = split.to(gl.int64) * num_tokens + token
        o_ptrs = O_parts + gl.expand_dims((part_row * num_q_heads + head) * HEAD_DIM, 0) + d
        gl.store(o_ptrs, o, mask=gl.expand_dims(col_ok, 0))
        gl.store(LSE_parts + part_row * num_q_heads + head, lse, mask=col_ok)
    else:
        o = acc / gl.expand_dims(l_i, 0)
        o_ptrs = O + gl.expand_dims(token.to(gl.int64) * stride_ot + head * stride_oh, 0) + d
        gl.store(o_ptrs, o.to(O.dtype.element_ty), mask=gl.expand_dims(col_ok, 0))


_decode_fp8_launch = FastLaunch(_decode_fp8_kernel)


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, max_seqlen_q: int = 1) -> bool:
    """Whether this kernel takes the batch: 16-bit queries over an e4m3 cache, head dim 64 or
    128, at most 8 query heads per KV head, rows of contiguous head dims, and at most
    `config.DECODE_FP8_MAX_ROWS` query rows (new tokens x the group's heads) a request."""
    head_dim = q.shape[-1]
    group = q.shape[1] // k_cache.shape[2]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and k_cache.dtype == torch.float8_e4m3fn
        and v_cache.dtype == torch.float8_e4m3fn
        and head_dim in HEAD_DIMS
        and group <= MAX_GROUP
        and max(max_seqlen_q, 1) * group <= DECODE_FP8_MAX_ROWS
        and q.stride(-1) == 1
        and k_cache.stride(-1) == 1
        and v_cache.stride() == k_cache.stride()
    )


def launch_decode_fp8(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    o: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    qk_scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    num_splits: int,
    min_split_keys: int,
    o_parts: torch.Tensor | None = None,
    lse_parts: torch.Tensor | None = None,
    block_n: int = BLOCK_N,
    stages: int = STAGES,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int = 1,
    cols: int | None = None,
    maxnreg: int | None = None,
) -> None:
    """Launch over q [T, Hq, D], caches [num_blocks, page, Hkv, D] e4m3, o [T, Hq, D].

    Decode (`cu_seqlens_q` None): T = B, one new token a request. Verification: `cu_seqlens_q`
    [B + 1] int32 bounds each request's new tokens in q (at most `max_seqlen_q`), each seeing the
    request's keys up to its own position (causal); `seq_lens` counts them. `qk_scale` is the
    softmax scale times log2(e); with `num_splits` > 1 the programs write `o_parts` [splits, T,
    Hq, D] and `lse_parts` [splits, T, Hq] (float32) for the caller's merge. `cols` forces the
    MMA columns a program (8 or 16; default `schedule.fp8_query_columns`); `maxnreg` caps the
    registers a thread (benchmarks; default: as many as the compiler takes).
    """
    if block_n not in (16, 32) or stages == 1 or stages < 0:
        raise ValueError(f"block_n must be 16 or 32 and stages 0 or at least 2, got {block_n} and {stages}")
    T, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    B = seq_lens.shape[0]
    group = Hq // Hkv
    verify = cu_seqlens_q is not None
    rows = (max(max_seqlen_q, 1) if verify else 1) * group
    if cols is None:
        cols = fp8_query_columns(max_seqlen_q if verify else 1, group)[0]
    elif cols not in (8, 16):
        raise ValueError(f"cols must be 8 or 16, got {cols}")
    col_groups = -(-rows // cols)
    split = num_splits > 1
    if not split:
        o_parts = lse_parts = o  # unread
    # the caches as 32-bit words of four e4m3 values (strides in words)
    k_words, v_words = k_cache.view(torch.int32), v_cache.view(torch.int32)
    scalars = (
        qk_scale, T, Hq, q.stride(0), q.stride(1), o.stride(0), o.stride(1), block_table.stride(0),
        k_words.stride(0), k_words.stride(1), k_words.stride(2), num_splits, min_split_keys, col_groups,
    )  # fmt: skip
    consts = (q.device, group, D, page, block_n, split, stages, cols, verify, maxnreg)
    regs = {} if maxnreg is None else {"maxnreg": maxnreg}
    _decode_fp8_launch.run(
        decode_fp8_grid(Hkv, B, col_groups, num_splits),
        (q, k_words, v_words, o, o_parts, lse_parts, k_scale, v_scale, block_table, seq_lens,
         cu_seqlens_q if verify else seq_lens, *scalars),
        lambda: dict(
            GROUP=group, HEAD_DIM=D, PAGE=page, BLOCK_N=block_n, SPLIT=split,
            K_LOAD=_k_load_layout(block_n, D), V_LOAD=_v_load_layout(block_n, D),
            STAGES=stages, RING=RING_LAYOUT, COLS=cols, VERIFY=verify, num_warps=1, **regs,
        ),
        key=(consts, scalars[2:7], scalars[8:11]),  # the launch key: Hq and the strides but block_table's
    )  # fmt: skip


def compile_for_sm90(
    head_dim: int = 128,
    group: int = 2,
    page: int = 16,
    block_n: int = BLOCK_N,
    split: bool = False,
    stages: int = STAGES,
    cols: int = 8,
    verify: bool = False,
):
    """Compile the kernel for sm_90a without a GPU (Triton ships its own ptxas), to read its
    PTX / SASS anywhere: `compile_for_sm90().asm["ptx"]`. Run outside the Triton interpreter."""
    B, hkv = 4, 2
    hq = hkv * group
    cache = torch.empty(8, page, hkv, head_dim // 4, dtype=torch.int32)
    q = torch.empty(B, hq, head_dim, dtype=torch.bfloat16)
    args = dict(
        Q=q, K_cache=cache, V_cache=cache, O=q, O_parts=torch.empty(1, dtype=torch.float32),
        LSE_parts=torch.empty(1, dtype=torch.float32), k_scale=torch.ones(1), v_scale=torch.ones(1),
        block_table=torch.zeros(B, 2, dtype=torch.int32), seq_lens=torch.zeros(B, dtype=torch.int32),
        cu_seqlens_q=torch.zeros(B + 1, dtype=torch.int32), qk_scale=0.1, num_tokens=B, num_q_heads=hq, stride_qt=hq * head_dim, stride_qh=head_dim,
        stride_ot=hq * head_dim, stride_oh=head_dim, stride_bt=2, stride_cb=page * hkv * head_dim // 4,
        stride_cs=hkv * head_dim // 4, stride_ch=head_dim // 4, num_splits=2, min_split_keys=64, col_groups=1,
    )  # fmt: skip
    consts = dict(
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, BLOCK_N=block_n, SPLIT=split,
        K_LOAD=_k_load_layout(block_n, head_dim), V_LOAD=_v_load_layout(block_n, head_dim),
        STAGES=stages, RING=RING_LAYOUT, COLS=cols, VERIFY=verify,
    )  # fmt: skip
    specialised = {"stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_cs", "stride_ch"}
    # the engine's pointers and strides are 16-byte aligned / divisible by 16
    aligned = [
        n for n in _decode_fp8_kernel.arg_names if n in specialised or isinstance(args.get(n), torch.Tensor)
    ]
    return compile_gluon_for_sm90(_decode_fp8_kernel, args, consts, {"num_warps": 1}, aligned)
