"""DeepSeek-V3.2's lightning indexer (DSA): index scores through the block table, top-k per token.

Each token s caches one indexer key k_s (D values, 128 in DeepSeek) in its own paged cache,
index_cache [num_blocks, block_size, 1, D] (the latent cache's block ids); each new token t has
Hi indexer heads q_t,h (Hi = 64) and fp32 per-head weights w_t,h, and

    score(t, s) = sum_h w_t,h * relu(scale * q_t,h . k_s)        for s <= pos(t), else excluded

Token t attends to the `topk` keys of largest score (2048 in DeepSeek; all its keys when it has
fewer, then -1s). Positions as in `paged_attention`: the j-th new token of request i sits at
`seq_lens[i] - q_len_i + j`. Shapes:

    q [T, Hi, D]   weights [T, Hi] fp32   index_cache [num_blocks, block_size, 1, D]
    block_table [B, max_blocks]   cu_seqlens_q [B + 1]   seq_lens [B]   (int32)
    -> [T, topk] int32 logical key positions, -1 = empty (the order within a row is unspecified)

Two kernels per chunk of query tokens:

1. `_score_kernel`: scores into a bounded scratch [chunk, L] (L = max_seqlen_k, or the block
   table's width x block_size). A program owns BLOCK_Q tokens of one request x their Hi heads as
   the rows of one tile (row r = token r // HI_PAD, head r % HI_PAD; decode: one token's heads)
   and one segment of its keys: per BLOCK_N keys gathered through the block table, one `tl.dot`
   [rows, D] x [D, BLOCK_N] with fp32 accumulation, then scale, relu, the weights and the sum
   over each token's heads -> [BLOCK_Q, BLOCK_N] fp32 scores, stored where causal as order
   keys: int32s whose signed order is the float order (a positive float's bits as they are, a
   negative one's 31 magnitude bits flipped; -0.0 made +0.0 first, so equal scores are equal
   keys). Keys are split into segments when requests x query tiles cannot fill the GPU (decode);
   no merge is needed, each score is written once.
2. `_select_kernel`: one program per token row, an exact radix select over the row's n = pos + 1
   keys. Four passes over the row histogram one byte of the key each, high byte first (256
   bins, `tl.histogram`, only keys whose higher bytes equal the bytes chosen so far) and choose
   the byte of the topk-th largest key; after the fourth, the threshold key tau and the number
   of keys equal to tau still needed are exact. A last pass writes every position with key > tau
   and the first of those equal to tau (in position order, by prefix sums: no atomics, the
   result is deterministic), then -1s. A row with n <= topk skips the digit passes and writes
   0..n-1.

Why store the scores rather than recompute them in each pass (no scratch at all): an exact
select looks at each score five times (four digit passes + the write). Recomputing one costs
Hi x D x 2 = 16 KFLOP and a 256-byte key (bf16, D = 128) per (token, key), each time; storing
it costs 4 bytes written once and read back five times. So the scores are computed once and the
scratch is bounded instead: at most SCRATCH_ELEMENTS (256 MiB) at a time, `chunk =
SCRATCH_ELEMENTS // L` query tokens per pair of launches (512 tokens of a 128k context; 64
decode tokens at 128k take 32 MiB, one chunk). The chunks, segment counts and tiles come from
host values only (T, max_seqlen_q, max_seqlen_k or the table's width): nothing reads the
device, so a decode step is capturable in a CUDA graph as called.

FP8 keys (an FP8 KV cache), as DeepSeek's own code scores them: `store_index_keys` quantizes each
key row on its own, k_s ~ k8_s * ks_s with ks_s = max(amax |k_s|, eps) / 448 and k8_s in e4m3,
into index_cache (e4m3) and index_scales [num_blocks, block_size] (fp32); `index_topk` quantizes
each query head's row the same way (`per_token_group_quant_fp8`, one group of D), folds its
scale into the weights, and the score kernel runs e4m3 x e4m3 dots (twice the bf16 rate on
Hopper; exact products, summed in the tensor cores' FP8 accumulator, whose precision is below
fp32's, as in DeepSeek's `fp8_index`) and multiplies each key's dots by its scale: relu commutes
with the positive factors, so score(t, s) = ks_s * sum_h (w_t,h * qs_t,h) * relu(scale * q8 . k8).

Not done here:
splitting one row's select over several programs (decode at 64 requests runs 64 select
programs); fusing the first histogram into the score kernel; NaN scores (their keys sort
somewhere, the twin's `torch.topk` puts them first).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tilellm.kernels import validation as v
from tilellm.kernels.config import cdiv, dot_precision, interpreting, next_power_of_2, num_sms
from tilellm.kernels.fp8 import FP8_MAX_C, is_fp8, to_fp8
from tilellm.kernels.launch import FastLaunch
from tilellm.kernels.store import store_kvcache

# Scores (as int32 order keys) held at once: [chunk of query tokens, L keys], 256 MiB.
SCRATCH_ELEMENTS = 1 << 26
# Key segments of the score kernel (decode): enough programs for PROGRAMS_PER_SM per SM, each
# segment at least MIN_KEYS_PER_SPLIT keys.
PROGRAMS_PER_SM = 4
MIN_KEYS_PER_SPLIT = 1024
MAX_SPLITS = 64


# ----------------------------------------------------------------------------------------------
# Tile configs
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexerConfig:
    """Tiles of both kernels: the score kernel's `rows` (tokens x padded heads, >= 16) by
    `block_n` keys, and `block_s` scores per step of the select kernel."""

    rows: int
    block_n: int
    num_warps: int
    num_stages: int
    block_s: int
    select_warps: int


# From `python -m tilellm.bench.indexer --sweep` on an H200 (bf16, Hi 64, D 128, page 64):
# decode tiles of one token's 64 heads (64 x 128 bf16 queries) by 64-key tiles two deep, and the
# select in 2048-score steps over 8 warps (I64K: 0.786 ms against 1.006 for 3 stages, 1024-score
# steps, 4 warps); prefill tiles of four tokens (256 rows, 8 warps, two stages), so every key tile
# read from L2 serves four tokens (P32K: 5.25 ms against 5.84 for two-token tiles). fp32 (tests on
# a GPU): smaller tiles. The interpreter: the smallest (it runs every program in Python).
# FP8 keys (e4m3 dots): prefill tiles of one token's heads by 128 keys three deep (P32K: 5.17 ms
# against 5.91 with the bf16 prefill tiles and 5.24 for bf16 keys); decode keeps DECODE (I32K in
# a graph 0.399 ms against 0.407 for bf16 keys).
DECODE = IndexerConfig(rows=64, block_n=64, num_warps=4, num_stages=2, block_s=2048, select_warps=8)
PREFILL = IndexerConfig(rows=256, block_n=64, num_warps=8, num_stages=2, block_s=1024, select_warps=4)
FP8_PREFILL = IndexerConfig(rows=64, block_n=128, num_warps=4, num_stages=3, block_s=1024, select_warps=4)
FP32 = IndexerConfig(rows=64, block_n=32, num_warps=4, num_stages=2, block_s=1024, select_warps=4)
INTERPRETER = IndexerConfig(rows=16, block_n=16, num_warps=4, num_stages=1, block_s=128, select_warps=4)


def indexer_config(dtype: torch.dtype, max_seqlen_q: int, key_fp8: bool = False) -> IndexerConfig:
    """The tile config of a batch (see the comments above the table); `key_fp8`: FP8 keys."""
    if interpreting():
        return INTERPRETER
    if dtype == torch.float32:
        return FP32
    if max_seqlen_q <= 1:
        return DECODE
    return FP8_PREFILL if key_fp8 else PREFILL


def tile_shape(cfg: IndexerConfig, num_heads: int, max_seqlen_q: int) -> tuple[int, int]:
    """(block_q, hi_pad) of a score tile: block_q tokens (a power of two, no more than a request's
    new tokens need) x hi_pad heads (Hi padded to a power of two, and further so the tile has at
    least 16 rows, tl.dot's smallest; padded heads weigh 0)."""
    hi_pad = next_power_of_2(num_heads)
    block_q = max(1, cfg.rows // hi_pad)
    block_q = min(block_q, next_power_of_2(max(1, max_seqlen_q)))
    hi_pad = max(hi_pad, 16 // block_q)
    return block_q, hi_pad


def num_key_splits(programs: int, max_seqlen_k: int, num_sms_: int | None = None) -> int:
    """Key segments per score tile: enough for PROGRAMS_PER_SM programs per SM, each segment at
    least MIN_KEYS_PER_SPLIT keys, at most MAX_SPLITS."""
    target = PROGRAMS_PER_SM * (num_sms_ or num_sms())
    if programs >= target:
        return 1
    return max(1, min(cdiv(target, max(programs, 1)), MAX_SPLITS, max_seqlen_k // MIN_KEYS_PER_SPLIT))


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


# Per-step values (token counts, chunk bounds, table widths, split counts) are not specialised
# on, so a new batch never compiles a new variant in the middle of serving. The scratch's row
# stride is: it is always a multiple of 16 (one variant, vector loads).
@triton.jit(
    do_not_specialize=["chunk_lo", "chunk_hi", "stride_bt", "num_splits"],
    do_not_specialize_on_alignment=["block_table", "cu_seqlens_q", "seq_lens"],
)
def _score_kernel(
    Q, W, Cache, KeyScales, Scores,  # tensors (KeyScales: FP8 keys only)
    block_table, cu_seqlens_q, seq_lens,  # batch description
    scale, chunk_lo, chunk_hi, num_heads,
    stride_qt, stride_qh, stride_wt, stride_bt, stride_cb, stride_cs, stride_ksb, stride_sr,  # stride_sr: row length
    num_splits,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, HI_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, KEY_FP8: tl.constexpr,
):  # fmt: skip
    """Scores of BLOCK_Q tokens of one request over one key segment, stored where causal:
    Scores[t - chunk_lo, s] = sum_h W[t, h] * relu(scale * Q[t, h] . key_s) for chunk tokens t
    (KEY_FP8: Q in e4m3 with its scales folded into W, key_s = an e4m3 row times its scale in
    KeyScales)."""
    # -- which work: program_id(0) = query tile x key segment (segments fastest), (1) = request --
    pid = tl.program_id(0)
    req = tl.program_id(1)
    split = pid % num_splits
    q_tile = pid // num_splits
    q_start = tl.load(cu_seqlens_q + req)
    q_len = tl.load(cu_seqlens_q + req + 1) - q_start
    t0 = q_tile * BLOCK_Q
    first = q_start + t0  # packed index of the tile's first token
    last = q_start + tl.minimum(t0 + BLOCK_Q, q_len) - 1
    if (t0 >= q_len) | (last < chunk_lo) | (first >= chunk_hi):
        return  # past the request's tokens, or outside this chunk
    context = tl.load(seq_lens + req) - q_len  # keys before the request's first new token

    # -- rows: BLOCK_Q tokens x HI_PAD heads; padded heads and tokens load zeros, weigh 0 --
    ROWS: tl.constexpr = BLOCK_Q * HI_PAD
    rows = tl.arange(0, ROWS)
    tok = t0 + rows // HI_PAD
    head = rows % HI_PAD
    row_ok = (tok < q_len) & (head < num_heads)
    t_row = (q_start + tok).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + t_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    w = tl.load(W + t_row * stride_wt + head, mask=row_ok, other=0.0)

    # -- the tokens of this tile that belong to the chunk, and their positions --
    tq = t0 + tl.arange(0, BLOCK_Q)
    t_abs = q_start + tq
    tok_ok = (tq < q_len) & (t_abs >= chunk_lo) & (t_abs < chunk_hi)
    q_pos = context + tq
    s_row = Scores + (t_abs - chunk_lo).to(tl.int64) * stride_sr

    # -- this program's key segment: whole key tiles of [0, causal end of the tile) --
    kv_end = context + tl.minimum(t0 + BLOCK_Q, q_len)
    seg = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    lo = split * seg
    hi = tl.minimum(lo + seg, kv_end)
    bt_row = block_table + req.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    for n in tl.range(lo, hi, BLOCK_N):
        k_pos = n + offs_n
        key_ok = k_pos < hi
        block = tl.load(bt_row + k_pos // PAGE, mask=key_ok, other=0)
        # int64: block * stride overflows int32 in large pools.
        k_row = Cache + block.to(tl.int64) * stride_cb + (k_pos % PAGE) * stride_cs
        keys = tl.load(k_row[:, None] + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        # -- [rows, BLOCK_N] head scores, then the weighted sum over each token's heads --
        if KEY_FP8:  # e4m3 x e4m3: the queries' scales are in W
            dots = tl.dot(q, tl.trans(keys))
        else:
            dots = tl.dot(q, tl.trans(keys), input_precision=PRECISION)
        if KEY_FP8:  # each key's own scale (> 0, so it commutes with the relu)
            k_s = tl.load(KeyScales + block.to(tl.int64) * stride_ksb + k_pos % PAGE, mask=key_ok, other=0.0)
            dots = dots * k_s[None, :]
        weighted = tl.maximum(dots * scale, 0.0) * w[:, None]
        score = tl.sum(tl.reshape(weighted, (BLOCK_Q, HI_PAD, BLOCK_N)), axis=1)
        # -- stored as order keys: int32s whose signed order is the float order (the bits of a
        # positive float as they are, a negative one's 31 magnitude bits flipped); -0.0 is made
        # +0.0 first, so equal scores are equal keys --
        score = tl.where(score == 0.0, 0.0, score)
        bits = score.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        # (k_pos < stride_sr: a max_seqlen_k below seq_lens gives wrong picks, never a stray write)
        visible = (
            tok_ok[:, None]
            & key_ok[None, :]
            & (k_pos[None, :] <= q_pos[:, None])
            & (k_pos < stride_sr)[None, :]
        )
        tl.store(s_row[:, None] + k_pos[None, :], key, mask=visible)


_score_launch = FastLaunch(_score_kernel)


@triton.jit(do_not_specialize=["chunk_lo", "stride_ot", "topk"])
def _select_kernel(
    Scores, Out, positions,
    chunk_lo, stride_sr, stride_ot, topk,
    BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Out[t] = the topk positions of largest key among Scores[t - chunk_lo, 0..pos(t)], then -1s."""
    r = tl.program_id(0)
    t = chunk_lo + r
    n = tl.minimum(tl.load(positions + t) + 1, stride_sr)  # the token's causal keys (in the row)
    s_row = Scores + r.to(tl.int64) * stride_sr
    o_row = Out + t.to(tl.int64) * stride_ot
    offs = tl.arange(0, BLOCK_S)
    bins = tl.arange(0, 256)
    # A row of n <= topk keys skips the digit passes: its histograms stay empty, so tau ends as
    # the smallest key (-2 ** 31) with need = n, and the write takes every key.
    n_radix = tl.where(n <= topk, 0, n)

    # -- four digit passes: the threshold key tau (prefix), `need` of its ties to take --
    prefix = tl.zeros([], dtype=tl.int32)  # the chosen high bytes of tau, in key bits
    need = tl.minimum(topk, n)  # how many of the keys matching the prefix are still to take
    for p in tl.static_range(4):
        SHIFT = 24 - 8 * p  # constexpr: p is a static_range index
        hist = tl.zeros([256], dtype=tl.int32)
        for s in tl.range(0, n_radix, BLOCK_S):
            match = s + offs < n_radix
            k = tl.load(s_row + s + offs, mask=match, other=0)
            if p == 0:
                digit = (k >> 24) + 128  # the top byte is signed: -128..127 -> 0..255
            else:
                digit = (k >> SHIFT) & 0xFF
                match = match & ((k >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
            hist += tl.histogram(digit, 256, mask=match)
        # the largest byte b whose keys at or above it number >= need
        at_or_above = tl.sum(hist) - tl.cumsum(hist, 0) + hist
        b = tl.max(tl.where(at_or_above >= need, bins, 0))
        need -= tl.sum(tl.where(bins > b, hist, 0))
        if SHIFT == 24:
            prefix = (b - 128) << 24
        else:
            prefix = prefix | (b << SHIFT)

    # -- write: keys above tau, the first `need` ties, in position order; -1 after them --
    written = tl.zeros([], dtype=tl.int32)
    ties_seen = tl.zeros([], dtype=tl.int32)
    for s in tl.range(0, n, BLOCK_S):
        pos = s + offs
        valid = pos < n
        k = tl.load(s_row + pos, mask=valid, other=0)
        tie = valid & (k == prefix)
        tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), 0) - 1
        take = valid & ((k > prefix) | (tie & (tie_rank < need)))
        slot = written + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(o_row + slot, pos, mask=take)
        written += tl.sum(take.to(tl.int32))
        ties_seen += tl.sum(tie.to(tl.int32))
    for s in tl.range(written, topk, BLOCK_S):
        tl.store(o_row + s + offs, tl.full([BLOCK_S], -1, tl.int32), mask=s + offs < topk)


_select_launch = FastLaunch(_select_kernel)


# ----------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------


def index_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    *,
    topk: int,
    scale: float,
    max_seqlen_k: int | None = None,
    out: torch.Tensor | None = None,
    index_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The `topk` causal key positions of largest index score for each new token (DSA selection).

    Args:
        q: [T, Hi, D] indexer queries of all requests' new tokens, packed (rope applied); D a
            power of two in 16..256, Hi <= MAX_INDEX_HEADS.
        weights: [T, Hi] float32 per-head weights (the caller folds in Hi ** -0.5).
        index_cache: [num_blocks, block_size, 1, D] indexer keys in q's dtype, or in e4m3 with
            `index_scales` (this step's keys already stored, `store_index_keys`; the latent
            cache's block ids), contiguous.
        block_table: [B, max_blocks] int32.
        cu_seqlens_q: [B + 1] int32 boundaries of each request's new tokens in q (empty requests
            allowed).
        seq_lens: [B] int32 keys of each request after this step (prefix + new tokens).
        max_seqlen_q: the most new tokens of any request.
        topk: positions per token (2048 in DeepSeek-V3.2).
        scale: applied to each head's dot before the relu (D ** -0.5 in DeepSeek).
        max_seqlen_k: optional host bound on `seq_lens` (default: the block table's width x
            block_size); it sets the scratch's row length, hence its chunks.
        out: optional [T, topk] int32 output (last dim contiguous).
        index_scales: FP8 keys only: [num_blocks, block_size] float32, each key row's scale.
    Returns:
        [T, topk] int32 logical key positions, in no particular order within a row; a token with
        n < topk causal keys gets all n, then -1s. On ties at the topk-th score any of the tied
        keys may be chosen. No host sync: capturable in a CUDA graph as called.
    """
    name = "index_topk"
    check_index_topk(
        name, q, weights, index_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, topk, scale,
        max_seqlen_k, index_scales,
    )  # fmt: skip
    o = index_output(name, q, topk, out)
    key_fp8 = index_scales is not None
    T, Hi, D = q.shape
    batch = seq_lens.shape[0]
    if T == 0 or batch == 0:
        return o
    q_dtype = q.dtype
    if key_fp8:  # e4m3 queries, a scale per (token, head) folded into the weights
        q, weights = quantize_index_queries(q, weights)
    page = index_cache.shape[1]
    bound = max_seqlen_k if max_seqlen_k is not None else block_table.shape[1] * page
    bound = cdiv(max(bound, 1), 16) * 16  # the scratch's row length
    cfg = indexer_config(q_dtype, max_seqlen_q, key_fp8)
    block_q, hi_pad = tile_shape(cfg, Hi, max_seqlen_q)
    q_tiles = cdiv(max(max_seqlen_q, 1), block_q)
    chunk = max(1, min(T, SCRATCH_ELEMENTS // bound))
    splits = num_key_splits(min(batch * q_tiles, cdiv(chunk, block_q)), bound)
    scores = torch.empty((chunk, bound), dtype=torch.int32, device=q.device)  # order keys of the scores
    positions = token_positions(cu_seqlens_q, seq_lens, T)
    for lo in range(0, T, chunk):
        hi = min(T, lo + chunk)
        _score_launch[(q_tiles * splits, batch)](
            q, weights, index_cache, index_scales if key_fp8 else weights, scores,
            block_table, cu_seqlens_q, seq_lens,
            float(scale), lo, hi, Hi,
            q.stride(0), q.stride(1), weights.stride(0), block_table.stride(0),
            index_cache.stride(0), index_cache.stride(1), index_scales.stride(0) if key_fp8 else 0, scores.stride(0),
            splits,
            HEAD_DIM=D, PAGE=page, BLOCK_Q=block_q, HI_PAD=hi_pad, BLOCK_N=cfg.block_n,
            PRECISION=dot_precision(q_dtype), KEY_FP8=key_fp8, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        _select_launch[(hi - lo,)](
            scores, o, positions, lo, scores.stride(0), o.stride(0), topk,
            BLOCK_S=cfg.block_s, num_warps=cfg.select_warps,
        )  # fmt: skip
    return o


# Smallest scale of an FP8 key row (an all-zero key): as `per_token_group_quant_fp8`'s eps.
INDEX_SCALE_EPS = 1e-10


@triton.jit
def _store_index_fp8_kernel(
    K, Cache, KeyScales, slot_mapping,
    stride_kt, stride_cs, eps,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Token t's key row into its slot: e4m3 of k / s, and s = max(amax |k|, eps) / 448."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:
        return  # padding
    offs = tl.arange(0, HEAD_DIM)
    x = tl.load(K + t.to(tl.int64) * stride_kt + offs).to(tl.float32)
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), eps), FP8_MAX_C)
    tl.store(Cache + slot * stride_cs + offs, to_fp8(tl.div_rn(x, s)))
    tl.store(KeyScales + slot, s)


_store_index_fp8_launch = FastLaunch(_store_index_fp8_kernel)


def store_index_keys(
    index_k: torch.Tensor,
    index_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    index_scales: torch.Tensor | None = None,
) -> None:
    """Store this step's indexer keys index_k [T, D] in index_cache [num_blocks, block_size, 1, D]
    at `slot_mapping` [T] (-1 skips a token): as they are in a 16/32-bit cache; in an e4m3 cache,
    each row quantized with a scale of its own, max(amax |k|, 1e-10) / 448, written to
    index_scales [num_blocks, block_size] float32 (DeepSeek's per-128-value groups for D = 128)."""
    name = "store_index_keys"
    check_store_index_keys(name, index_k, index_cache, slot_mapping, index_scales)
    if not is_fp8(index_cache):
        store_kvcache(index_k.unsqueeze(1), None, index_cache, None, slot_mapping)
        return
    T, D = index_k.shape
    if T == 0:
        return
    _store_index_fp8_launch[(T,)](
        index_k, index_cache, index_scales, slot_mapping, index_k.stride(0), index_cache.stride(1),
        INDEX_SCALE_EPS, HEAD_DIM=D,
    )  # fmt: skip


def check_store_index_keys(name, index_k, index_cache, slot_mapping, index_scales) -> None:
    """Arguments of `store_index_keys` (a 16/32-bit cache: `store_kvcache`'s checks follow)."""
    check_index_scales(name, index_cache, index_scales)
    v._check_rank(name, "index_k", index_k, 2, "[T, D]")
    if not is_fp8(index_cache):
        return
    T, D = index_k.shape
    v._check_float(name, {"index_k": index_k})
    v._check_head_dim(name, D)
    if index_cache.shape[2:] != (1, D) or slot_mapping.shape != (T,):
        raise ValueError(
            f"{name}: index_cache must be [num_blocks, block_size, 1, {D}] and slot_mapping [{T}], got "
            f"{tuple(index_cache.shape)} and {tuple(slot_mapping.shape)}"
        )
    v._check_slot_mapping(name, slot_mapping)
    v._check_device(name, {"index_k": index_k, "index_cache": index_cache, "slot_mapping": slot_mapping})
    v._check_contiguous(name, {"index_cache": index_cache, "slot_mapping": slot_mapping})
    v._check_last_dim_stride(name, {"index_k": index_k})
    if T > 0 and v.deep_checks_enabled(index_k):
        v.check_slot_values(name, slot_mapping, index_cache)


def quantize_index_queries(
    q: torch.Tensor, weights: torch.Tensor, quantize=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hi, D] -> (q8 [T, Hi, D] e4m3, weights * qs [T, Hi] fp32): each head's row with a
    scale of its own (`per_token_group_quant_fp8`, or `quantize` of the same signature: the
    twin's), which the relu lets the weights carry."""
    # (imported here: fp8_gemm imports the twins' package, whose indexer twin imports this module)
    from tilellm.kernels.fp8_gemm import per_token_group_quant_fp8

    T, Hi, D = q.shape
    q8, qs = (quantize or per_token_group_quant_fp8)(q.reshape(T * Hi, D), D)
    return q8.view(T, Hi, D), weights * qs.view(T, Hi)


def token_positions(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """pos(t) of every packed token, [T] int32, on the device (no host sync): the j-th new token
    of request i sits at seq_lens[i] - q_len_i + j."""
    t = torch.arange(num_tokens, device=cu_seqlens_q.device, dtype=cu_seqlens_q.dtype)
    req = torch.searchsorted(cu_seqlens_q, t, right=True) - 1  # the request holding token t
    start, end = cu_seqlens_q[req], cu_seqlens_q[req + 1]
    return (seq_lens[req] - (end - start) + (t - start)).to(torch.int32)


# ----------------------------------------------------------------------------------------------
# Argument checks (shared with the PyTorch twin, tilellm.kernels.reference.indexer)
# ----------------------------------------------------------------------------------------------

MAX_INDEX_HEADS = 128  # a decode tile holds one token's Hi heads as rows


def check_index_topk(
    name, q, weights, index_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, topk, scale,
    max_seqlen_k, index_scales=None,
) -> None:  # fmt: skip
    """Arguments of `index_topk`: ranks, dtypes, devices and shapes always; index values (a host
    read) on CPU tensors and under TILELLM_DEBUG=1 (`validation.deep_checks_enabled`)."""
    check_index_scales(name, index_cache, index_scales)
    v._check_rank(name, "q", q, 3, "[T, Hi, D]")
    v._check_rank(name, "weights", weights, 2, "[T, Hi]")
    v._check_rank(name, "index_cache", index_cache, 4, "[num_blocks, block_size, 1, D]")
    v._check_rank(name, "block_table", block_table, 2, "[B, max_blocks]")
    v._check_rank(name, "cu_seqlens_q", cu_seqlens_q, 1, "[B+1]")
    v._check_rank(name, "seq_lens", seq_lens, 1, "[B]")
    v._check_float(name, {"q": q} if is_fp8(index_cache) else {"q": q, "index_cache": index_cache})
    if weights.dtype != torch.float32:
        raise ValueError(f"{name}: weights [T, Hi] must be float32, got {weights.dtype}")
    indices = {"block_table": block_table, "cu_seqlens_q": cu_seqlens_q, "seq_lens": seq_lens}
    v._check_int32(name, indices)
    v._check_device(name, {"q": q, "weights": weights, "index_cache": index_cache, **indices})
    T, Hi, D = q.shape
    if not 1 <= Hi <= MAX_INDEX_HEADS:
        raise ValueError(f"{name}: q [T, Hi, D] must have 1..{MAX_INDEX_HEADS} indexer heads, got Hi = {Hi}")
    v._check_head_dim(name, D)
    if tuple(weights.shape) != (T, Hi):
        raise ValueError(
            f"{name}: weights must have shape [T, Hi] = {(T, Hi)} (as q), got {tuple(weights.shape)}"
        )
    if index_cache.shape[1] < 1:
        raise ValueError(f"{name}: block_size (index_cache dim 1) must be >= 1, got {index_cache.shape[1]}")
    if index_cache.shape[2] != 1 or index_cache.shape[3] != D:
        raise ValueError(
            f"{name}: index_cache must be [num_blocks, block_size, 1, D] with D = {D} (q's head dim), "
            f"got shape {tuple(index_cache.shape)}"
        )
    batch = block_table.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(
            f"{name}: cu_seqlens_q must have B+1 = {batch + 1} entries (block_table has B = {batch} rows), "
            f"got {cu_seqlens_q.shape[0]}"
        )
    if seq_lens.shape[0] != batch:
        raise ValueError(
            f"{name}: seq_lens must have B = {batch} entries (block_table has {batch} rows), got {seq_lens.shape[0]}"
        )
    v._check_last_dim_stride(name, {"q": q, "weights": weights})
    v._check_contiguous(name, {"index_cache": index_cache, **indices})
    v._check_max_seqlen_type(name, "max_seqlen_q", max_seqlen_q)
    if isinstance(topk, bool) or not isinstance(topk, numbers.Integral) or topk < 1:
        raise ValueError(f"{name}: topk must be an int >= 1, got {topk!r}")
    _check_scale(name, scale)
    if max_seqlen_k is not None:
        v._check_max_seqlen_type(name, "max_seqlen_k", max_seqlen_k)
    if not v.deep_checks_enabled(q):
        return
    q_lens = v._check_cu_seqlens_values(name, "cu_seqlens_q", cu_seqlens_q, T)
    v._check_max_seqlen_value(name, "max_seqlen_q", max_seqlen_q, q_lens)
    kv_lens = v._check_seq_lens_values(name, seq_lens, q_lens)
    if max_seqlen_k is not None and kv_lens.numel() and max_seqlen_k < int(kv_lens.max()):
        raise ValueError(
            f"{name}: max_seqlen_k = {max_seqlen_k} is smaller than the longest seq_lens entry ({int(kv_lens.max())})"
        )
    v._check_block_table_values(name, block_table, kv_lens, index_cache.shape[0], index_cache.shape[1])


def index_output(name, q, topk, out) -> torch.Tensor:
    """The output [T, topk] int32: `out` once checked, else a new one."""
    shape = (q.shape[0], topk)
    if out is None:
        return torch.empty(shape, dtype=torch.int32, device=q.device)
    v.check_out(name, out, shape, torch.int32, q.device)
    return out


def check_index_scales(name: str, index_cache: torch.Tensor, index_scales: torch.Tensor | None) -> None:
    """An e4m3 index_cache comes with index_scales [num_blocks, block_size] float32 (one per key
    row), contiguous, on its device; a 16/32-bit one without."""
    if not is_fp8(index_cache):
        if index_scales is not None:
            raise ValueError(
                f"{name}: index_scales is for an FP8 (e4m3) index_cache; this one is {index_cache.dtype}"
            )
        return
    if index_scales is None:
        raise ValueError(
            f"{name}: an FP8 (e4m3) index_cache needs index_scales [num_blocks, block_size] float32"
        )
    if index_cache.shape[-1] < 32:  # an e4m3 tensor-core dot reduces over at least 32 values
        raise ValueError(f"{name}: FP8 (e4m3) index keys need a head dim >= 32, got {index_cache.shape[-1]}")
    want = tuple(index_cache.shape[:2])
    if index_scales.dtype != torch.float32 or tuple(index_scales.shape) != want:
        raise ValueError(
            f"{name}: index_scales must be float32 of shape [num_blocks, block_size] = {want}, "
            f"got {index_scales.dtype} {tuple(index_scales.shape)}"
        )
    v._check_device(name, {"index_cache": index_cache, "index_scales": index_scales})
    v._check_contiguous(name, {"index_scales": index_scales})


def _check_scale(name, scale) -> None:
    if scale is None:
        raise ValueError(f"{name}: scale is required (DeepSeek-V3.2's is index_head_dim ** -0.5)")
    try:
        v.resolve_scale(scale, 1)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
