"""Paged attention for any mix of requests: prefix-cached / chunked prefill, verification, decode.

Grid = (KV heads, requests, query tiles x splits), or (query tiles x splits, KV heads, requests)
when a request has several query tiles (they then run side by side and share their request's
K/V in L2). A program owns `block_q` new tokens of one
request and all `group` query heads that share one KV head, packed as the rows of one tile
(row r = token r // group, head r % group): every K/V tile read from the cache serves the whole
group, and decode (one token) still gives `tl.dot` at least 16 rows.

The j-th new token of request i sits at position `seq_lens[i] - q_len_i + j` and sees keys
0..position. Keys are read through the block table: logical key p of the request lives in
physical block `block_table[i, p // page]`, row `p % page`. As in prefill, key tiles wholly
visible to every row of the tile run unmasked; only the tiles that cross the tile's diagonal
(the small triangle of a verification, the last tile of a decode) are masked.

Split-KV: when (requests x KV heads x query tiles) cannot fill the GPU and contexts are long, each
program covers one of `num_splits` key segments, writes its normalised partial output and its
log-sum-exp, and they are combined. An eager call combines them in the same launch: the last
program of each tile to finish merges (`merge.merge_if_last`, for up to `MERGE_LAST_MAX_SPLITS`
segments), counting arrivals in counters of the call's stream (`split_scratch`); a call captured
into a CUDA graph merges in a second launch (`merge.run_merge`). `TILELLM_SPLIT_MERGE` overrides
the choice (`config.split_merge_mode`).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tilellm.kernels import prefill, validation
from tilellm.kernels.config import (
    GLUON_QUERY_TILE,
    LN_2,
    LOG2_E,
    cdiv,
    dot_precision,
    launch_gluon,
    num_sms,
    overridden,
    paged_config,
    split_merge_mode,
)
from tilellm.kernels.fp8 import is_fp8, unit_scale
from tilellm.kernels.launch import FastLaunch, LaunchKey
from tilellm.kernels.merge import (
    MERGE_LAST_MAX_SPLITS,
    MergeLaunch,
    merge_if_last,
    merge_into,
    merge_unroll,
    plan_merge,
    run_merge,
)
from tilellm.kernels.pdl import pdl_flags, pdl_launch_kwargs, pdl_start
from tilellm.kernels.prefill import rows_view
from tilellm.kernels.schedule import (
    PagedPlan,
    SplitPlan,
    paged_grid,
    plan_paged,
    query_tiles_first,
    target_programs,
)
from tilellm.kernels.split_scratch import check_counters, split_parts, stream_capturing

LN_2_C = tl.constexpr(LN_2)  # converts the base-2 log-sum-exp to natural log
# Decode and verification (at most this many new tokens per request) over an FP8 cache run
# their masked key tiles (a request's last, partial tile, or two) without software pipelining:
# a loop of one iteration, whose pipeline prologue and epilogue cost more instructions than its
# load's latency (H200, E1's decode step in the engine's order: 3117 vs 2644 GB/s of FP8 bytes;
# D1 3834 vs 3741; V1 2241 vs 2182). The 16-bit cache's tiles and prompt chunks measured no gain
# (C1 319 vs 324 TFLOP/s), and cascade's suffix pass (every tile masked) was not measured: they
# keep the pipelined loop.
SHORT_TILE_TOKENS = 16


@triton.jit
def _paged_tiles(
    acc, l_i, m_i, q, q_pos,
    K_cache, V_cache, bt_row, kv_head, stride_cb, stride_cs, stride_ch, offs_n, offs_d,
    n_start, n_end, key_lo, key_end, qk_scale,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
    K_ROWS: tl.constexpr, PIPELINED: tl.constexpr,
):  # fmt: skip
    """Online softmax over key tiles [n_start, n_end) gathered through the block table. FP8
    tiles are widened to q's dtype in registers (exact: every e4m3 value is a bf16/fp16 value);
    their scales are folded into `qk_scale` and applied to the output by the caller.
    `PIPELINED=False` runs the loop without software pipelining (one stage)."""
    for n in tl.range(n_start, n_end, BLOCK_N, num_stages=None if PIPELINED else 1):
        k_pos = n + offs_n
        if MASKED:
            key_ok = (k_pos < key_end) & (k_pos >= key_lo)
            block = tl.load(bt_row + k_pos // PAGE, mask=key_ok, other=0)
        else:
            block = tl.load(bt_row + k_pos // PAGE)
        # int64: block * stride overflows int32 in large pools.
        row_off = block.to(tl.int64) * stride_cb + (k_pos % PAGE) * stride_cs + kv_head * stride_ch
        if K_ROWS:  # K gathered as [BLOCK_N, D], transposed in the dot
            if MASKED:
                k = tl.load(K_cache + row_off[:, None] + offs_d[None, :], mask=key_ok[:, None], other=0.0)
            else:
                k = tl.load(K_cache + row_off[:, None] + offs_d[None, :])
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
        else:  # K^T gathered as [D, BLOCK_N] (measured faster for decode tiles)
            if MASKED:
                k = tl.load(K_cache + row_off[None, :] + offs_d[:, None], mask=key_ok[None, :], other=0.0)
            else:
                k = tl.load(K_cache + row_off[None, :] + offs_d[:, None])
            qk = tl.dot(q, k.to(q.dtype), input_precision=PRECISION)
        if MASKED:
            visible = key_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
            qk = tl.where(visible, qk, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            # A row may have seen no key yet in this segment: keep exp2 away from -inf - -inf.
            m_ij = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(V_cache + row_off[:, None] + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        else:
            v = tl.load(V_cache + row_off[:, None] + offs_d[None, :])
        v = v.to(q.dtype)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


# Per-step values (token counts, table widths, split counts) and index-array pointers (views
# into the step's payload, or slices of it) are not specialised on: Triton would otherwise
# compile a new variant whenever one of them changes divisibility by 16 or alignment, in the
# middle of serving. That includes the FP8 scale pointers, which carry `seq_lens` when unread (in a
# mixed step, the slice after its decodes: not 16-byte aligned unless they are a multiple of 4).
# K/V/Q/O keep their alignment specialisation (vectorised loads).
@triton.jit(
    do_not_specialize=["num_tokens", "stride_bt", "num_splits", "min_split_keys", "part_base"],
    do_not_specialize_on_alignment=[
        "stats",
        "k_scale",
        "v_scale",
        "block_table",
        "cu_seqlens_q",
        "seq_lens",
        "kv_lo_ptr",
        "kv_hi_ptr",
        "split_counters",
    ],
)
def _paged_kernel(
    Q, K_cache, V_cache, O, O_parts, LSE_parts, stats,  # tensors
    k_scale, v_scale,  # FP8 caches: [1] float32 dequantization scales
    block_table, cu_seqlens_q, seq_lens,  # batch description
    qk_scale, num_tokens, num_q_heads,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
    num_splits, min_split_keys, kv_lo_ptr, kv_hi_ptr, part_base,  # split-KV, key windows (cascade)
    split_counters,  # MERGE_LAST: [>= B * Hkv * query tiles] int32 arrivals per tile, zero between launches
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, IS_DECODE: tl.constexpr, HAS_KV_LO: tl.constexpr, HAS_KV_HI: tl.constexpr,
    RECORD_STATS: tl.constexpr, PRECISION: tl.constexpr, K_ROWS: tl.constexpr,
    TILES_FASTEST: tl.constexpr, KV_FP8: tl.constexpr, DOT_FP16: tl.constexpr,
    PIPELINE_MASKED: tl.constexpr, USE_PDL: tl.constexpr, MERGE_LAST: tl.constexpr, MERGE_UNROLL: tl.constexpr,
):  # fmt: skip
    pdl_start(USE_PDL)
    if TILES_FASTEST:
        # Several query tiles: a (request, KV head)'s tiles launch side by side and share its K/V
        # in L2 (with KV heads fastest, all heads of all requests stream at once: C1's 300 MB).
        tile_split = tl.program_id(0)
        kv_head = tl.program_id(1)
        req = tl.program_id(2)
        num_kv_heads = tl.num_programs(1)
        num_tile_splits = tl.num_programs(0)
    else:
        kv_head = tl.program_id(0)
        req = tl.program_id(1)
        tile_split = tl.program_id(2)
        num_kv_heads = tl.num_programs(0)
        num_tile_splits = tl.num_programs(2)
    q_tile = tile_split // num_splits
    split = tile_split % num_splits

    if IS_DECODE:
        q_start = req
        q_len = 1
    else:
        q_start = tl.load(cu_seqlens_q + req)
        q_len = tl.load(cu_seqlens_q + req + 1) - q_start
    t0 = q_tile * BLOCK_Q
    if t0 >= q_len:
        return
    seq_len = tl.load(seq_lens + req)
    context = seq_len - q_len  # keys before this step's first new token

    # -- rows: block_q tokens x group heads --
    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = context + tok
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q_row = (q_start + tok).to(tl.int64)
    q = tl.load(
        Q + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if DOT_FP16:
        # FP8 cache, 16-bit queries: the dots run in fp16, since e4m3 -> fp16 is one instruction
        # per two values on sm_89+ (-> bf16 goes through fp32); every e4m3 value and every
        # probability is exact or finer in fp16; a query beyond fp16's range (|q| > 65504) would
        # overflow, far above what normalised queries reach.
        q = q.to(tl.float16)

    # -- this program's key range: causal end of the tile, cut into segments --
    last_tok = tl.minimum(t0 + BLOCK_Q, q_len) - 1
    kv_end = context + last_tok + 1
    full_end = (context + t0 + 1) // BLOCK_N * BLOCK_N  # tiles visible to every row of the tile
    # Optional key window [kv_lo, kv_hi) per request (cascade attention: a shared prefix, then
    # each request's own suffix). A window start makes every tile masked (suffixes are short).
    win_lo = 0
    if HAS_KV_HI:
        kv_end = tl.minimum(kv_end, tl.load(kv_hi_ptr + req))
        full_end = tl.minimum(full_end, kv_end // BLOCK_N * BLOCK_N)
    if HAS_KV_LO:
        win_lo = tl.load(kv_lo_ptr + req)
    base = win_lo // BLOCK_N * BLOCK_N
    if HAS_KV_LO:
        full_end = base
    if SPLIT:
        # This tile's keys in num_splits equal segments (whole key tiles each).
        seg = tl.cdiv(tl.cdiv(tl.maximum(kv_end - base, 0), num_splits), BLOCK_N) * BLOCK_N
        seg = tl.maximum(seg, tl.cdiv(min_split_keys, BLOCK_N) * BLOCK_N)  # short requests: fewer segments
        lo = base + split * seg
        hi = tl.minimum(lo + seg, kv_end)
    else:
        lo = base
        hi = kv_end
    full_hi = tl.maximum(tl.minimum(full_end, hi), lo)
    masked_lo = tl.maximum(full_end, lo)

    if KV_FP8:  # scores of stored keys times k_scale; the values' v_scale is applied to acc below
        qk_scale = qk_scale * tl.load(k_scale)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = block_table + req.to(tl.int64) * stride_bt
    acc, l_i, m_i = _paged_tiles(
        acc, l_i, m_i, q, q_pos,
        K_cache, V_cache, bt_row, kv_head, stride_cb, stride_cs, stride_ch, offs_n, offs_d,
        lo, full_hi, win_lo, hi, qk_scale,
        PAGE, BLOCK_N, False, PRECISION, K_ROWS, True,
    )  # fmt: skip
    acc, l_i, m_i = _paged_tiles(
        acc, l_i, m_i, q, q_pos,
        K_cache, V_cache, bt_row, kv_head, stride_cb, stride_cs, stride_ch, offs_n, offs_d,
        masked_lo, hi, win_lo, hi, qk_scale,
        PAGE, BLOCK_N, True, PRECISION, K_ROWS, PIPELINE_MASKED,
    )  # fmt: skip
    if KV_FP8:
        acc = acc * tl.load(v_scale)

    if SPLIT:
        # Partial result of this segment: normalised output and natural-log lse (-inf if empty).
        empty = l_i == 0.0
        o = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN_2_C)
        part_row = (part_base + split).to(tl.int64) * num_tokens + q_row
        tl.store(
            O_parts + (part_row[:, None] * num_q_heads + head[:, None]) * HEAD_DIM + offs_d[None, :],
            o,
            mask=row_ok[:, None],
        )
        tl.store(LSE_parts + part_row * num_q_heads + head, lse, mask=row_ok)
        if MERGE_LAST:  # the tile's last program to finish merges its splits (no merge launch)
            num_q_tiles = num_tile_splits // num_splits
            merge_if_last(
                O, O_parts, LSE_parts, split_counters, (req * num_kv_heads + kv_head) * num_q_tiles + q_tile,
                num_splits, num_tokens, num_q_heads, q_row, head, row_ok, offs_d, stride_ot, stride_oh,
                BLOCK_M, HEAD_DIM, MERGE_UNROLL,
            )  # fmt: skip
    else:
        o = acc / l_i[:, None]
        tl.store(
            O + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(O.dtype.element_ty),
            mask=row_ok[:, None],
        )

    if RECORD_STATS:
        pid = (req * num_kv_heads + kv_head) * num_tile_splits + tile_split
        tl.store(stats + pid * 2, tl.cdiv(full_hi - lo, BLOCK_N))
        tl.store(stats + pid * 2 + 1, tl.cdiv(tl.maximum(hi - masked_lo, 0), BLOCK_N))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    *,
    scale: float | None = None,
    num_splits: int | SplitPlan | None = None,
    max_seqlen_k: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each request's new tokens over its whole paged context.

    Args:
        q: [T, Hq, D] new tokens of all requests, packed.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] (this step's K/V already stored).
        block_table: [B, max_blocks_per_seq] int32.
        cu_seqlens_q: [B+1] int32 boundaries of each request's new tokens in q.
        seq_lens: [B] int32 KV length of each request after this step (context + new tokens).
        max_seqlen_q: the most new tokens of any request.
        num_splits: None chooses split-KV segments (`tilellm.kernels.schedule.plan_split_kv`); an int
            forces that many; a `SplitPlan` made on the host is used as is (no host sync: the
            engine plans once per step, outside CUDA graphs).
        max_seqlen_k: optional bound on `seq_lens` for the split plan (default: the block
            table's width x block_size; the kernels never read seq_lens on the host).
        out: optional [T, Hq, D] output buffer.
        k_scale, v_scale: FP8 caches (float8_e4m3fn) only: [1] float32 dequantization scales on
            the device (None = 1.0); the cached values are stored * scale.
    Returns:
        o: [T, Hq, D] in q.dtype.
    """
    call, o = _run_remembered(
        "paged_attention", q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, k_scale, v_scale,
        (max_seqlen_q, scale, num_splits, max_seqlen_k),
    )  # fmt: skip
    if o is not None:
        return o
    validation.check_paged(
        "paged_attention", q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q
    )
    validation.check_kv_scales("paged_attention", q, k_cache, v_cache, k_scale, v_scale)
    validation.check_split_hints("paged_attention", num_splits, max_seqlen_k, seq_lens)
    o = validation.output_like("paged_attention", q, out)
    _launch(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, o, scale, num_splits, max_seqlen_k,
            is_decode=False, kv_scales=(k_scale, v_scale), remember=call)  # fmt: skip
    return o


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    num_splits: int | SplitPlan | None = None,
    max_seqlen_k: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per request: q [B, Hq, D] -> o [B, Hq, D]; the q_len = 1 case of paged attention."""
    call, o = _run_remembered(
        "decode_attention", q, k_cache, v_cache, block_table, None, seq_lens, out, k_scale, v_scale,
        (scale, num_splits, max_seqlen_k),
    )  # fmt: skip
    if o is not None:
        return o
    validation.check_decode("decode_attention", q, k_cache, v_cache, block_table, seq_lens)
    validation.check_kv_scales("decode_attention", q, k_cache, v_cache, k_scale, v_scale)
    validation.check_split_hints("decode_attention", num_splits, max_seqlen_k, seq_lens)
    o = validation.output_like("decode_attention", q, out)
    _launch(q, k_cache, v_cache, block_table, None, seq_lens, 1, o, scale, num_splits, max_seqlen_k,
            is_decode=True, kv_scales=(k_scale, v_scale), remember=call)  # fmt: skip
    return o


def paged_tile_stats(
    q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, *, num_splits: int | None = None
) -> tuple[torch.Tensor, SplitPlan]:
    """Run the kernel and return its own tile counts [B, Hkv, q_tiles * splits, 2] (full, masked),
    and its split plan. Batches that run `hopper.py` (Hopper, prompt chunks): [B, Hq, q_tiles, 2]
    for its programs of one query head's 128 tokens (see `tilellm.inspect.tiles.paged_schedule`)."""
    validation.check_paged(
        "paged_attention", q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q
    )
    o = torch.empty_like(q)
    return _launch(
        q,
        k_cache,
        v_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        max_seqlen_q,
        o,
        None,
        num_splits,
        int(seq_lens.max()) if seq_lens.numel() else 0,  # a diagnostic: the exact plan, one sync
        is_decode=False,
        record_stats=True,
    )


def _launch(
    q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, o, scale, num_splits, max_seqlen_k,
    *, is_decode, record_stats=False, kv_lo=None, kv_hi=None, parts=None, tiles_fastest=None,
    kv_scales=(None, None), remember=None,
):  # fmt: skip
    """Launch the paged kernel. `parts=(o_parts, lse_parts, part_base)` makes every program write
    its partial (o, lse) at part index part_base + split instead of `o` (the caller merges).
    `tiles_fastest` forces the launch order (None: query tiles fastest when there are several;
    benchmarks compare both). `remember`: the call's `_call_key`, under which a launch planned
    from the shapes alone (the Triton kernel's, or `decode_fp8.py`'s) is remembered."""
    T, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    batch = seq_lens.numel()
    group = Hq // Hkv
    internal = kv_lo is not None or kv_hi is not None or parts is not None or tiles_fastest is not None
    kv_fp8 = is_fp8(k_cache)
    if max_seqlen_k is None and seq_lens.device.type != "cpu":
        # Plan from what the host knows: no request holds more keys than its block table row
        # maps. Reading seq_lens instead would sync with the device and could not be captured.
        max_seqlen_k = block_table.shape[1] * page
    if isinstance(num_splits, PagedPlan) and num_splits.kernel == "gluon" and kv_fp8:
        num_splits = None  # the Gluon kernel reads 16-bit pages only: plan for the Triton one
    # (a plan made from seq_lens' values holds only for this call's values)
    planned_from_shapes = max_seqlen_k is not None or isinstance(num_splits, (PagedPlan, SplitPlan))
    if isinstance(num_splits, PagedPlan):
        paged_plan = num_splits  # planned on the host by the caller (no sync, CUDA-graph safe)
    elif isinstance(num_splits, SplitPlan):
        paged_plan = PagedPlan("triton", num_splits)
    elif max_seqlen_k is not None and not overridden():
        # A pure function of the shapes: planned once per shape, not on every eager call.
        paged_plan = _plan_for_shape(
            batch, Hq, Hkv, D, q.dtype, page, max_seqlen_q, T, max_seqlen_k, num_splits, is_decode,
            not internal and k_cache.is_contiguous() and v_cache.is_contiguous(), kv_fp8, q.device.index,
        )  # fmt: skip
    else:
        paged_plan = plan_paged(
            batch, Hq, Hkv, D, q.dtype, page, max_seqlen_q, num_tokens=T, seq_lens=seq_lens,
            max_seqlen_k=max_seqlen_k, num_splits=num_splits, is_decode=is_decode,
            allow_gluon=not internal and k_cache.is_contiguous() and v_cache.is_contiguous(), kv_fp8=kv_fp8,
        )  # fmt: skip
    if paged_plan.kernel == "gluon" and T > 0:
        # Prompt chunks on Hopper: FlashAttention-3's schedule, K/V pages copied by TMA (hopper.py).
        # Its programs are (query tile, query head, request); its stats [B, Hq, query tiles, 2].
        gluon_tiles = cdiv(max_seqlen_q, GLUON_QUERY_TILE)
        stats = None
        if record_stats:
            stats = torch.zeros(batch * Hq * gluon_tiles * 2, dtype=torch.int32, device=q.device)
        if launch_gluon(lambda hopper: hopper.launch_paged(
            rows_view(q), k_cache, v_cache, o, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, group,
            validation.resolve_scale(scale, D) * LOG2_E, stats=stats,
        )):  # fmt: skip
            return (stats.view(batch, Hq, gluon_tiles, 2), paged_plan.split) if record_stats else None
        # this Triton cannot build it: the portable kernel, with its own plan
        paged_plan = plan_paged(
            batch, Hq, Hkv, D, q.dtype, page, max_seqlen_q, num_tokens=T, seq_lens=seq_lens,
            max_seqlen_k=max_seqlen_k, is_decode=is_decode, allow_gluon=False,
        )  # fmt: skip
    if paged_plan.kernel == "gluon-decode-fp8":
        # Decode (or verification of a few tokens) over an FP8 cache on Hopper: each thread
        # widens the bytes its tensor-core operands hold, in registers (decode_fp8.py). Same
        # split plan, partials and merge.
        if not internal and not record_stats and T > 0 and batch > 0:
            launched = []
            if launch_gluon(lambda decode_fp8: _launch_decode_fp8(
                decode_fp8, q, k_cache, v_cache, o, block_table, None if is_decode else cu_seqlens_q, seq_lens,
                max_seqlen_q, scale, kv_scales, paged_plan.split, launched,
            ), module="decode_fp8"):  # fmt: skip
                if remember is not None and planned_from_shapes:
                    _remember(remember, launched[0])
                return None
        # stats asked for, a layout it does not take, or a Triton that cannot build it
        paged_plan = PagedPlan("triton", paged_plan.split)
    plan = paged_plan.split
    launch_of = functools.partial(
        _triton_launch, q, k_cache, block_table, o, scale, plan,
        paged_plan.tiles_first if tiles_fastest is None else tiles_fastest, is_decode=is_decode,
        max_seqlen_q=max_seqlen_q, batch=batch, kv_fp8=kv_fp8, has_kv_lo=kv_lo is not None,
        has_kv_hi=kv_hi is not None, record_stats=record_stats, partials=parts is not None,
    )  # fmt: skip
    capturing = stream_capturing(q.device)
    merge_last = (
        1 < plan.num_splits <= MERGE_LAST_MAX_SPLITS and parts is None and _merge_in_kernel(capturing)
    )
    launch = launch_of(merge_last=merge_last)
    stats = None
    if record_stats:
        stats = torch.zeros(launch.slots * launch.splits * 2, dtype=torch.int32, device=q.device)
    if T == 0 or batch == 0:
        return (stats, plan) if record_stats else None
    if remember is not None and not internal and not record_stats and not capturing and planned_from_shapes:
        _remember(remember, launch)
    counters = _run_triton(launch, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, o, kv_scales,
                           stats=stats, kv_lo=kv_lo, kv_hi=kv_hi, parts=parts, capturing=capturing)  # fmt: skip
    if counters is not None and validation.deep_checks_enabled(q):
        check_counters(counters, launch.slots)
    if record_stats:
        return stats.view(batch, Hkv, launch.slots // (batch * Hkv) * launch.splits, 2), plan
    return None


class _TritonLaunch(NamedTuple):
    """The paged kernel's launch for one layout of a call: what the tensors' shapes, strides,
    dtypes and the call's scalar arguments decide (`_triton_launch`). `_run_triton` launches it
    with a call's tensors; `decode_attention` and `paged_attention` remember it per layout, so
    that a later eager call of that layout skips the planning (FlashInfer's plan / run)."""

    grid: tuple[int, ...]
    scalars: tuple  # qk_scale (base 2), T, Hq, the q / o / block_table / cache strides, splits, min keys
    consts: tuple  # `_paged_constexprs`' arguments
    key: tuple  # `FastLaunch`'s key
    splits: int
    slots: int  # tiles of programs: B x Hkv x query tiles
    is_decode: bool
    kv_fp8: bool
    merge: MergeLaunch | None  # the separate merge of this call's own partials
    merge_last: bool  # the tile's last program merges (its stream's `split_counters`)

    def run(
        self, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, o, kv_scales, capturing=None
    ) -> None:
        _run_triton(
            self, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, o, kv_scales, capturing=capturing
        )


def _triton_launch(
    q, k_cache, block_table, o, scale, plan, tiles_fastest, *, is_decode, max_seqlen_q, batch, kv_fp8, has_kv_lo,
    has_kv_hi, record_stats, partials, merge_last,
) -> _TritonLaunch:  # fmt: skip
    """Plan the Triton kernel's launch (`plan`: the split plan; `partials`: the caller passes
    the partial buffers and merges)."""
    T, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    group = Hq // Hkv
    splits = plan.num_splits
    tiles = _tiles if not overridden() else _tiles.__wrapped__
    cfg, block_q, q_tiles, grid, tiles_fastest = tiles(
        D, q.dtype, group, 1 if is_decode else max_seqlen_q, kv_fp8, Hkv, batch, splits, tiles_fastest
    )
    # The launch key (`FastLaunch`): the constexprs' inputs and the scalars the kernel specialises
    # on (not the token count, split counts, block_table's stride or the softmax scale).
    scalars = (
        validation.resolve_scale(scale, D) * LOG2_E, T, Hq,
        *q.stride()[:2], *o.stride()[:2], block_table.stride(0), *k_cache.stride()[:3],
        splits, plan.min_keys_per_split,
    )  # fmt: skip
    consts = (
        q.device, q.dtype, kv_fp8, group, D, page, cfg, block_q, splits > 1 or partials, is_decode, has_kv_lo,
        has_kv_hi, record_stats, tiles_fastest, (1 if is_decode else max_seqlen_q) <= SHORT_TILE_TOKENS, merge_last,
        pdl_launch_kwargs(q.device, T)["USE_PDL"],
    )  # fmt: skip
    merge = None
    if splits > 1 and not partials and not merge_last:
        parts_shape = (splits, T, Hq, D)
        merge = plan_merge(
            parts_shape, _contiguous_strides(parts_shape), (T * Hq, Hq, 1), o.stride(), o.device
        )
    key = LaunchKey((consts, scalars[2:7] + scalars[8:11]))  # Hq and the strides but block_table's
    return _TritonLaunch(
        grid, scalars, consts, key, splits, batch * Hkv * q_tiles, is_decode, kv_fp8, merge, merge_last
    )


def _run_triton(
    launch: _TritonLaunch, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, o, kv_scales, *, stats=None,
    kv_lo=None, kv_hi=None, parts=None, capturing: bool | None = None,
) -> torch.Tensor | None:  # fmt: skip
    """Launch `launch` with a call's tensors (and the merge of its partials); the arrival
    counters it used, if it merges in the kernel. `capturing`: whether the stream is capturing,
    if the caller knows (else asked where needed)."""
    part_base, counters = 0, None
    if parts is not None:
        o_parts, lse_parts, part_base = parts
    elif launch.splits > 1:
        counter_slots = launch.slots if launch.merge_last else 0
        o_parts, lse_parts, counters = split_parts(
            launch.splits, *q.shape, q.device, counter_slots, capturing
        )
    else:
        o_parts = lse_parts = None  # unread
    k_scale, v_scale = _fp8_scales(kv_scales, q.device) if launch.kv_fp8 else (None, None)
    _paged_launch.run(
        launch.grid,
        (
            # None where the constexprs leave a pointer unread (no argument for the binder or the
            # launcher to convert)
            q, k_cache, v_cache, o, o_parts, lse_parts, stats, k_scale, v_scale,
            block_table, None if launch.is_decode else cu_seqlens_q, seq_lens,
            *launch.scalars, kv_lo, kv_hi, part_base, counters,
        ),
        lambda: _paged_constexprs(*launch.consts),
        key=launch.key,
    )  # fmt: skip
    if launch.merge is not None:
        run_merge(launch.merge, o_parts, lse_parts, o)
    return counters


# The launches of eager `decode_attention` / `paged_attention` calls, by the call's layout
# (`_call_key`): a call whose tensors match a remembered one in type, shape, strides, dtype and
# device, with the same scalar arguments, passed the same checks and gets the same plan.
_REMEMBERED: dict[tuple, _TritonLaunch | _DecodeFp8Launch] = {}


def _run_remembered(
    name, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, k_scale, v_scale, scalars
) -> tuple[tuple | None, torch.Tensor | None]:  # fmt: skip
    """A public call's `_call_key`, and its output if a launch remembered under that key ran it:
    the layout passed the checks before, so no check runs here (nor where value checks are on:
    CPU tensors, TILELLM_DEBUG=1, which take the checked path)."""
    tensors = (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, k_scale, v_scale)
    call = _call_key(name, tensors, scalars)
    launch = validation.remembered(_REMEMBERED, call)
    if launch is None or validation.deep_checks_enabled(q):
        return call, None
    capturing = launch.splits > 1 and stream_capturing(q.device)  # (unsplit launches take no scratch)
    if launch.merge_last and capturing and split_merge_mode() == "auto":
        return call, None  # (a capture merges in a second launch)
    o = torch.empty_like(q) if out is None else out
    launch.run(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, o, (k_scale, v_scale), capturing)
    return call, o


def _call_key(name: str, tensors: tuple, scalars: tuple) -> tuple | None:
    """The key of an eager call by its layout, or None when it cannot be remembered (an argument
    that is not a tensor, a tile config overridden)."""
    key = validation.call_key(name, tensors, scalars)
    if key is None or overridden():
        return None
    return key + (split_merge_mode(),)


def _remember(key: tuple, launch: _TritonLaunch | _DecodeFp8Launch) -> None:
    validation.remember(_REMEMBERED, key, launch)


def clear_plans() -> None:
    """Forget every plan made per shape and every remembered call (after patching the planner's
    inputs, as tests do)."""
    _plan_for_shape.cache_clear()
    _tiles.cache_clear()
    _REMEMBERED.clear()
    prefill.clear_plans()


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


_paged_launch = FastLaunch(_paged_kernel)


def _paged_constexprs(
    device, dtype, kv_fp8, group, head_dim, page, cfg, block_q, split, is_decode, has_kv_lo, has_kv_hi,
    record_stats, tiles_fastest, short_tiles, merge_last, use_pdl,
) -> dict:  # fmt: skip
    """The paged kernel's constexprs and launch options for a launch's shape (`use_pdl`: from
    `pdl_launch_kwargs` for its tokens)."""
    return dict(
        GROUP=group, HEAD_DIM=head_dim, PAGE=page,
        BLOCK_M=cfg.block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n,
        SPLIT=split, IS_DECODE=is_decode, HAS_KV_LO=has_kv_lo, HAS_KV_HI=has_kv_hi,
        RECORD_STATS=record_stats, PRECISION=dot_precision(dtype), K_ROWS=cfg.k_rows,
        TILES_FASTEST=tiles_fastest, KV_FP8=kv_fp8,
        DOT_FP16=kv_fp8 and dtype in (torch.float16, torch.bfloat16),
        PIPELINE_MASKED=not (kv_fp8 and short_tiles and not has_kv_lo),
        MERGE_LAST=merge_last, MERGE_UNROLL=merge_unroll(cfg.block_m, head_dim),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_flags(use_pdl),
    )  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _plan_for_shape(
    batch, num_q_heads, num_kv_heads, head_dim, dtype, page, max_seqlen_q, num_tokens, max_seqlen_k, num_splits,
    is_decode, allow_gluon, kv_fp8, device_index,
) -> PagedPlan:  # fmt: skip
    """`plan_paged` for a batch known by its shapes and `max_seqlen_k` (seq_lens unread)."""
    return plan_paged(
        batch, num_q_heads, num_kv_heads, head_dim, dtype, page, max_seqlen_q, num_tokens=num_tokens,
        max_seqlen_k=max_seqlen_k, num_splits=num_splits, is_decode=is_decode, allow_gluon=allow_gluon,
        num_sms=num_sms(device_index), kv_fp8=kv_fp8,
    )  # fmt: skip


def _merge_in_kernel(capturing: bool) -> bool:
    """Whether a split call merges in the kernel (`config.split_merge_mode`)."""
    mode = split_merge_mode()
    return mode == "kernel" or (mode == "auto" and not capturing)


def _fp8_scales(kv_scales, device) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 cache's (k_scale, v_scale), each 1.0 where not given."""
    k_scale, v_scale = kv_scales
    if k_scale is None or v_scale is None:
        one = unit_scale(device)
        k_scale, v_scale = k_scale if k_scale is not None else one, v_scale if v_scale is not None else one
    return k_scale, v_scale


class _DecodeFp8Launch(NamedTuple):
    """`decode_fp8.py`'s launch for one layout of a `decode_attention` call, or of a
    `paged_attention` verification call (remembered as `_TritonLaunch` is)."""

    decode_fp8: ModuleType  # tilellm.kernels.decode_fp8 (imported where Gluon builds)
    qk_scale: float  # the softmax scale times log2(e)
    splits: int
    min_keys_per_split: int
    merge: MergeLaunch | None
    verify: bool  # new tokens bounded by cu_seqlens_q, causal (paged_attention), not one a request
    max_seqlen_q: int
    merge_last = False  # (a class attribute, as `_TritonLaunch.merge_last`: it merges apart)

    def run(
        self, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, o, kv_scales, capturing=None
    ) -> None:
        _run_decode_fp8(
            self, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, o, kv_scales, capturing
        )


def _launch_decode_fp8(
    decode_fp8, q, k_cache, v_cache, o, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, scale, kv_scales, plan,
    launched: list,
):  # fmt: skip
    """`decode_fp8.py`'s kernel over the batch (decode when `cu_seqlens_q` is None, else
    verification of at most `max_seqlen_q` tokens a request), its split-KV partials merged into
    `o`; False (nothing launched) for a layout it does not take. Appends its launch to `launched`."""
    verify = cu_seqlens_q is not None
    if not decode_fp8.supports(q, k_cache, v_cache, max_seqlen_q if verify else 1) or o.stride(-1) != 1:
        return False
    T, Hq, D = q.shape
    splits = plan.num_splits
    merge = None
    if splits > 1:
        parts_shape = (splits, T, Hq, D)
        merge = plan_merge(
            parts_shape, _contiguous_strides(parts_shape), (T * Hq, Hq, 1), o.stride(), o.device
        )
    qk_scale = validation.resolve_scale(scale, D) * LOG2_E
    launch = _DecodeFp8Launch(
        decode_fp8, qk_scale, splits, plan.min_keys_per_split, merge, verify, max_seqlen_q if verify else 1
    )
    _run_decode_fp8(launch, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, o, kv_scales)
    launched.append(launch)
    return True


def _run_decode_fp8(
    launch: _DecodeFp8Launch, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, o, kv_scales,
    capturing: bool | None = None,
) -> None:  # fmt: skip
    """Launch `launch` with a call's tensors (and the merge of its partials, which come from
    the stream's split-KV workspace as the Triton kernel's do; `capturing` as `_run_triton`'s)."""
    k_scale, v_scale = _fp8_scales(kv_scales, q.device)
    o_parts = lse_parts = None
    if launch.splits > 1:
        o_parts, lse_parts, _ = split_parts(launch.splits, *q.shape, q.device, capturing=capturing)
    launch.decode_fp8.launch_decode_fp8(
        q, k_cache, v_cache, o, block_table, seq_lens, launch.qk_scale, k_scale, v_scale, launch.splits,
        launch.min_keys_per_split, o_parts, lse_parts, cu_seqlens_q=cu_seqlens_q if launch.verify else None,
        max_seqlen_q=launch.max_seqlen_q,
    )  # fmt: skip
    if launch.merge is not None:
        run_merge(launch.merge, o_parts, lse_parts, o)


@functools.lru_cache(maxsize=1024)
def _tiles(head_dim, dtype, group, tile_tokens, kv_fp8, num_kv_heads, batch, splits, tiles_fastest):
    """The Triton kernel's tiles, query tiles, grid and launch order for a batch's shape."""
    cfg, block_q = paged_config(head_dim, dtype, group, tile_tokens, kv_fp8=kv_fp8)
    q_tiles = cdiv(max(tile_tokens, 1), block_q)
    if tiles_fastest is None:
        tiles_fastest = query_tiles_first(q_tiles)
    grid = paged_grid(num_kv_heads, batch, q_tiles, splits, tiles_fastest)
    return cfg, block_q, q_tiles, grid, tiles_fastest


def cascade_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_len: torch.Tensor,
    *,
    scale: float | None = None,
    prefix_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode for a batch whose requests share their first `prefix_len` keys (the same physical blocks).

    Cascade attention: the shared prefix is read once for the whole batch (all B queries x the
    query heads of a KV head form the rows of one tile, against the prefix keys), each request
    then attends to its own suffix `[prefix_len, seq_len)`, and the partial results are merged by
    their log-sum-exp. For E2-like batches (256 requests, a 2048-token shared prefix) this reads
    ~1/10 of the KV bytes that plain decode reads. Same result as `decode_attention`.

    Args:
        q: [B, Hq, D] one new token per request.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D].
        block_table: [B, max_blocks] int32; the first ceil(prefix_len / block_size) entries are the
            same for every row (row 0's are read for the prefix).
        seq_lens: [B] int32, every entry >= prefix_len.
        prefix_len: [1] int32 device tensor (so a CUDA graph can replay with another prefix); 0
            gives plain decode.
        prefix_splits: key segments for the prefix pass (default: enough programs to fill the GPU).
        k_scale, v_scale: FP8 caches only: [1] float32 dequantization scales (None = 1.0).
    Returns:
        o: [B, Hq, D] in q.dtype.
    """
    validation.check_decode("cascade_decode_attention", q, k_cache, v_cache, block_table, seq_lens)
    validation.check_kv_scales("cascade_decode_attention", q, k_cache, v_cache, k_scale, v_scale)
    validation.check_cascade_prefix(
        "cascade_decode_attention", q, block_table, seq_lens, prefix_len, k_cache.shape[1]
    )
    o = validation.output_like("cascade_decode_attention", q, out)
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    if B == 0:
        return o
    prefix_len = prefix_len.to(torch.int32)
    # One tile shape for every batch size (padding tiles exit at once): a single compiled variant.
    tile_tokens = max(B, 128)
    cfg, block_q = paged_config(D, q.dtype, Hq // Hkv, tile_tokens)
    q_tiles = cdiv(B, block_q)
    if prefix_splits is None:
        # The split-KV rule for programs of cfg.block_m rows (see choose_num_splits), at most 7
        # segments: with the suffix's partial that keeps the merge at 8 partials, its narrow
        # variant. X1 in a CUDA graph on an H200: 16 segments 205 us, 7: 136 us, 4: 126 us.
        prefix_splits = max(1, min(7, cdiv(target_programs(cfg.block_m, num_sms()), Hkv * q_tiles)))
    suffix_splits = 1
    o_parts = torch.empty((prefix_splits + suffix_splits, B, Hq, D), dtype=torch.float32, device=q.device)
    lse_parts = torch.empty(o_parts.shape[:3], dtype=torch.float32, device=q.device)
    # -- pass 1: all B queries as one pseudo-request over the shared prefix (keys < prefix_len) --
    cu_all = torch.arange(0, 2 * B, B, dtype=torch.int32, device=q.device)  # [0, B]
    pseudo_len = prefix_len + (B - 1)  # query j at position prefix_len - 1 + j sees the whole prefix
    _launch(q, k_cache, v_cache, block_table[:1], cu_all, pseudo_len, tile_tokens, o, scale, prefix_splits, None,
            is_decode=False, kv_hi=prefix_len, parts=(o_parts, lse_parts, 0),
            kv_scales=(k_scale, v_scale))  # fmt: skip
    # -- pass 2: each request over its own keys [prefix_len, seq_len) --
    kv_lo = prefix_len.expand(B).contiguous()
    _launch(q, k_cache, v_cache, block_table, None, seq_lens, 1, o, scale, suffix_splits, None,
            is_decode=True, kv_lo=kv_lo, parts=(o_parts, lse_parts, prefix_splits),
            kv_scales=(k_scale, v_scale))  # fmt: skip
    merge_into(o_parts, lse_parts, o)
    return o
