"""Sparse MLA: DeepSeek-V3.2's DSA attention over the paged latent cache, in the absorbed form.

The cache is MLA's (`tilellm.kernels.mla`): one row per token, `[c, k_pe]` (kv_lora_rank
latent values, then rope_dim rotated key values), kv_cache [num_blocks, block_size, 1,
kv_lora_rank + rope_dim], shared by every query head. DeepSeek-V3.2 adds a selection: an indexer
picks, for each query token t, the K logical positions it attends to (top-2048), `topk_indices[t]`
(-1 = empty), and

    score_h(r) = scale * (q_nope_h . c_r + q_pe_h . k_pe_r)    for r in topk_indices[t]
    o_h        = softmax_r(score_h) @ c

An entry counts when 0 <= r <= the token's position (token j of request i sits at
`seq_lens[i] - q_len_i + j`); anything else (-1 padding, and on the GPU without TILELLM_DEBUG=1
any other negative or future position, which the checks reject where they read values) is
skipped. A token with no valid entry outputs zeros. Entries are a list: the indexer returns a
set, and a duplicate would count twice.

Tokens have different index lists, so a program owns one token and a tile of its heads
(`block_h`, 64 of DeepSeek's 128, or the 16 of a tensor-parallel rank, as tile rows): every head
reads the same selected rows. It walks the token's list in chunks of `block_n` entries, gathers
each chunk's rows once through the block table (block_table[req, r // page], row r % page) and
uses them for both the scores (two dots, q_nope . c over kv_lora_rank and q_pe . k_pe over
rope_dim, each padded to a power of two on its own as in `mla.py`) and the values (c). Online
softmax in fp32, base 2 with log2(e) folded into the scale; outputs in q.dtype. With
`value_splits` = 2 two programs share each chunk, each accumulating half of the value dims.
An FP8 cache (row ~ stored * kv_scale) is handled as in `mla.py`: rows converted to q.dtype in
registers, the scale (read on the device) folded into the softmax scale and applied to the output.

Split-K: when tokens x head tiles cannot fill the GPU (decode of few requests at 16 heads), each
program covers one of `num_splits` segments of the index list and writes a partial output and
log-sum-exp in `mla.py`'s layout, merged by `mla._merge`. The plan (`plan_sparse_mla`) reads only
shapes (T, H, K), and the token-to-request map is a device `searchsorted`: no host sync, so a
call is capturable in a CUDA graph as made.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tilellm.kernels import validation as v
from tilellm.kernels.config import LN_2, LOG2_E, cdiv, dot_precision, interpreting, num_sms
from tilellm.kernels.fp8 import is_fp8
from tilellm.kernels.launch import FastLaunch
from tilellm.kernels.mla import MERGE_CHUNK, _check_common, _load_rows, _merge, kv_scale_arg, mla_output

LN_2_C = tl.constexpr(LN_2)  # converts the base-2 log-sum-exp to natural log


# ----------------------------------------------------------------------------------------------
# Tile configs and the split plan
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SparseMlaConfig:
    """One program's tile: up to `block_h` query heads of one token as rows (padded to a power
    of two >= 16, tl.dot's smallest), `block_n` selected rows per inner step, and
    `value_splits` programs sharing each chunk of rows (each accumulating kv_lora_rank /
    value_splits values, both computing the full scores)."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    value_splits: int = 1

    def __post_init__(self):
        if self.value_splits not in (1, 2):
            raise ValueError(f"SparseMlaConfig: value_splits must be 1 or 2, got {self.value_splits}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(
                f"SparseMlaConfig: block_n must be a power of two >= 16 (tl.dot), got {self.block_n}"
            )
        if self.block_h < 1:
            raise ValueError(f"SparseMlaConfig: block_h must be >= 1, got {self.block_h}")


# Hopper (H100/H200), half precision, DeepSeek's 512 + 64, from `python -m
# tilellm.bench.sparse_mla --sweep` on an H200 (S2: 64 tokens x top-2048 over 64k contexts).
# - WIDE (> 16 heads): tiles of 64 heads, 64 selected rows per step, 8 warps, two stages, the
#   512 values in one piece (dense M1 at 128 heads: 271 TFLOP/s, ahead of 128-head tiles in
#   value halves).
#   S2 at 128 heads: 0.220 ms, the fastest of the sweep (128-head tiles in halves: 0.240).
# - NARROW (<= 16 heads, e.g. 128 heads over 8 tensor-parallel ranks): 16-row tiles over 4
#   warps, 32 selected rows per step three deep, the values in two halves (two programs per
#   token: 64 tokens alone would fill half the SMs): S2 at 16 heads 0.181 ms, against 0.217 for
#   the dense kernel's pick (64 rows a step, two stages, one piece, two key segments).
# - kv_lora_rank > 512: value halves.
# - fp32 (tests on a GPU): 16 x 16 tiles. The interpreter: the same, one stage.
WIDE = SparseMlaConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
NARROW = SparseMlaConfig(block_h=16, block_n=32, num_warps=4, num_stages=3, value_splits=2)
FP32 = SparseMlaConfig(block_h=16, block_n=16, num_warps=4, num_stages=2)
INTERPRETER = SparseMlaConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
# What `tilellm.bench.sparse_mla --sweep` times beside the table's pick.
SWEEP_CONFIGS = [
    WIDE,
    NARROW,
    SparseMlaConfig(64, 32, 8, 2),
    SparseMlaConfig(64, 32, 8, 3),
    SparseMlaConfig(64, 16, 8, 2),
    SparseMlaConfig(64, 64, 8, 2, value_splits=2),
    SparseMlaConfig(64, 32, 8, 3, value_splits=2),
    SparseMlaConfig(128, 32, 8, 2, value_splits=2),  # 128 heads in one tile (dense: 222 registers, 0 spilled)
    SparseMlaConfig(32, 64, 8, 2),  # twice the programs at 128 heads, each token's rows read 4x from L2
    SparseMlaConfig(32, 64, 4, 2),
    SparseMlaConfig(32, 32, 4, 3),
    SparseMlaConfig(16, 32, 4, 3),
    SparseMlaConfig(16, 64, 8, 2),
    SparseMlaConfig(16, 32, 4, 3, value_splits=2),
]

# Split-K over a token's index list, for batches whose programs (tokens x head tiles x value
# splits) cannot fill the GPU: as `mla.plan_mla`, one program per SM is the target.
PROGRAMS_PER_SM = 1.0
FILL_SHARE = 0.8  # no split when the unsplit programs reach this share of the target
MAX_SPLITS = 16
MIN_KEYS_PER_SPLIT = 256
# A segment's partial output (rows x kv_lora_rank fp32, written, then read by the merge) should
# cost at most this share of the selected rows it reads (as `mla.PARTIAL_SHARE`).
PARTIAL_SHARE = 0.25


def sparse_mla_config(kv_lora_rank: int, dtype: torch.dtype, num_heads: int) -> SparseMlaConfig:
    """The table's tile config for a batch (see the comments above it)."""
    if interpreting():
        return INTERPRETER
    if dtype == torch.float32:
        return FP32
    cfg = WIDE if num_heads > 16 else NARROW
    if kv_lora_rank > 512 and cfg.value_splits == 1:
        cfg = SparseMlaConfig(cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages, value_splits=2)
    return cfg


def tile_heads(cfg: SparseMlaConfig, num_heads: int) -> tuple[int, int]:
    """(heads, block_m) of one program: min(H, block_h) heads padded to block_m rows."""
    heads = max(1, min(num_heads, cfg.block_h))
    return heads, max(16, _next_pow2(heads))


@dataclass(frozen=True)
class SparseMlaPlan:
    """How `sparse_mla_attention` runs a batch: the tile config and the split count of each
    token's index list. Made on the host from shapes only (`plan_sparse_mla`); pass it as
    `plan=` to force a config or a split count (the benchmark's sweep does)."""

    config: SparseMlaConfig
    num_splits: int
    programs: int  # programs without splitting: tokens x head tiles x value splits
    reason: str


def plan_sparse_mla(
    num_tokens: int,
    num_heads: int,
    topk: int,
    dtype: torch.dtype,
    *,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    num_splits: int | None = None,
    config: SparseMlaConfig | None = None,
    num_sms_: int | None = None,
    cache_dtype: torch.dtype | None = None,
) -> SparseMlaPlan:
    """The tile config (`sparse_mla_config`, or `config`) and the split count, on the host.

    No split when the index list holds fewer than two minimal segments or the unsplit programs
    reach FILL_SHARE of PROGRAMS_PER_SM x SMs; otherwise enough segments for the target, each
    at least MIN_KEYS_PER_SPLIT entries (more where a tile's partial output would cost over
    PARTIAL_SHARE of the rows it reads), at most MAX_SPLITS. `num_splits` forces the count.
    `dtype` is q's (it picks the tiles); `cache_dtype` the cache's (default `dtype`: an FP8
    cache's rows are half the bytes, so segments need twice the entries).
    """
    cfg = config or sparse_mla_config(kv_lora_rank, dtype, num_heads)
    heads, block_m = tile_heads(cfg, num_heads)
    programs = num_tokens * _cdiv(num_heads, heads) * cfg.value_splits
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 1:
            raise ValueError(f"plan_sparse_mla: num_splits must be an int >= 1 or None, got {num_splits!r}")
        return SparseMlaPlan(cfg, int(num_splits), programs, f"forced: num_splits={int(num_splits)}")
    row_bytes = (kv_lora_rank + rope_dim) * (torch.finfo(cache_dtype or dtype).bits // 8)
    partial_bytes = 2 * block_m * kv_lora_rank * 4  # written by the kernel, read by the merge
    min_keys = max(MIN_KEYS_PER_SPLIT, math.ceil(partial_bytes / PARTIAL_SHARE / row_bytes))
    min_keys = _cdiv(min_keys, cfg.block_n) * cfg.block_n
    sms = num_sms_ or num_sms()
    target = math.ceil(PROGRAMS_PER_SM * sms)
    if topk < 2 * min_keys:
        return SparseMlaPlan(cfg, 1, programs, f"no split: {topk} indices < 2 x {min_keys}")
    if programs >= FILL_SHARE * target:
        reason = f"no split: {programs} programs reach {FILL_SHARE:.0%} of the {target} that fill {sms} SMs"
        return SparseMlaPlan(cfg, 1, programs, reason)
    # Whole waves only (as `mla.plan_mla`): a program fills an SM, so 64 programs x 3 segments
    # = 192 would run as two waves of 132 + 60.
    n = max(1, min(target // max(programs, 1), MAX_SPLITS, topk // min_keys))
    reason = f"split {n}: {programs} programs for {sms} SMs (>= {min_keys} indices per segment)"
    return SparseMlaPlan(cfg, n, programs, reason)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << (max(1, x) - 1).bit_length()


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


# Per-step values (token counts, index counts, table widths, split counts), index pointers and
# the scale's pointer are not specialised on, so a new batch never compiles a new variant in the
# middle of serving.
@triton.jit(
    do_not_specialize=["num_tokens", "num_indices", "stride_bt", "stride_tk", "num_splits"],
    do_not_specialize_on_alignment=[
        "block_table",
        "cu_seqlens_q",
        "seq_lens",
        "token_request",
        "topk",
        "KV_scale",
    ],
)
def _sparse_mla_kernel(
    Q, KV, KV_scale, O, O_parts, LSE_parts,  # tensors (KV_scale: fp32 [1], read when KV_FP8)
    block_table, cu_seqlens_q, seq_lens, token_request, topk,  # batch description
    qk_scale, num_tokens, num_heads, num_indices,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs, stride_tk,
    num_splits,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, LORA_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
    HEADS: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VALUE_SPLITS: tl.constexpr, MERGE_CHUNK: tl.constexpr, SPLIT: tl.constexpr, KV_FP8: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # -- which work: program_id(0) = ((token x split) x head tile) x value split, fastest last
    # (the head tiles and value halves of a token run side by side and share its rows in L2) --
    pid = tl.program_id(0)
    head_tiles = tl.cdiv(num_heads, HEADS)
    vs = pid % VALUE_SPLITS
    pid = pid // VALUE_SPLITS
    head_tile = pid % head_tiles
    pid = pid // head_tiles
    split = pid % num_splits
    tok = (pid // num_splits).to(tl.int64)

    # -- the token's request and position --
    req = tl.load(token_request + tok)
    q_start = tl.load(cu_seqlens_q + req)
    q_len = tl.load(cu_seqlens_q + req + 1) - q_start
    pos = tl.load(seq_lens + req) - q_len + (tok - q_start)

    # -- rows: HEADS heads of the token --
    rows = tl.arange(0, BLOCK_M)
    head = head_tile * HEADS + rows
    row_ok = (rows < HEADS) & (head < num_heads)
    VALUE_W: tl.constexpr = LORA_PAD // VALUE_SPLITS
    offs_own = vs * VALUE_W + tl.arange(0, VALUE_W)  # the value dims this program accumulates
    offs_other = (1 - vs) * VALUE_W + tl.arange(0, VALUE_W)  # the rest of q_nope (VALUE_SPLITS 2)
    offs_pe = tl.arange(0, ROPE_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    lora_own_ok = offs_own < KV_LORA_RANK
    lora_other_ok = offs_other < KV_LORA_RANK
    pe_ok = offs_pe < ROPE_DIM
    MASK_LORA: tl.constexpr = KV_LORA_RANK != LORA_PAD
    MASK_ROPE: tl.constexpr = ROPE_DIM != ROPE_PAD
    q_ptr = Q + tok * stride_qt + head[:, None] * stride_qh
    q_own = tl.load(q_ptr + offs_own[None, :], mask=row_ok[:, None] & lora_own_ok[None, :], other=0.0)
    q_other = q_own
    if VALUE_SPLITS == 2:
        q_other = tl.load(
            q_ptr + offs_other[None, :], mask=row_ok[:, None] & lora_other_ok[None, :], other=0.0
        )
    q_pe = tl.load(q_ptr + KV_LORA_RANK + offs_pe[None, :], mask=row_ok[:, None] & pe_ok[None, :], other=0.0)

    # -- this program's entries of the index list --
    if SPLIT:
        seg = tl.cdiv(tl.cdiv(num_indices, num_splits), BLOCK_N) * BLOCK_N
        lo = split * seg
        hi = tl.minimum(lo + seg, num_indices)
    else:
        lo = 0
        hi = num_indices

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, VALUE_W], dtype=tl.float32)
    bt_row = block_table + req.to(tl.int64) * stride_bt
    topk_row = topk + tok * stride_tk
    if KV_FP8:
        # As in `mla.py`: the keys' scale in the softmax scale, the values' on the output; read
        # on the device, so a CUDA graph replays with its current value.
        kv_scale = tl.load(KV_scale)
        qk_scale = qk_scale * kv_scale
    for n in tl.range(lo, hi, BLOCK_N):
        # -- gather the chunk's selected rows through the block table (skipped entries: -1,
        # and anything outside 0..pos) --
        k_pos = tl.load(topk_row + n + offs_n, mask=n + offs_n < hi, other=-1)
        key_ok = (k_pos >= 0) & (k_pos <= pos)
        block = tl.load(bt_row + k_pos // PAGE, mask=key_ok, other=0)
        # int64: block * stride overflows int32 in large pools.
        row = KV + (block.to(tl.int64) * stride_cb + (k_pos % PAGE) * stride_cs)[:, None]
        # -- scores: q_nope . c (this program's value dims, then the others) + q_pe . k_pe --
        c = _load_rows(row + offs_own[None, :], key_ok, lora_own_ok, True, MASK_LORA, KV_FP8, q_own.dtype)
        qk = tl.dot(q_own, tl.trans(c), input_precision=PRECISION)
        if VALUE_SPLITS == 2:
            c_other = _load_rows(
                row + offs_other[None, :], key_ok, lora_other_ok, True, MASK_LORA, KV_FP8, q_own.dtype
            )
            qk = tl.dot(q_other, tl.trans(c_other), qk, input_precision=PRECISION)
        pe = _load_rows(
            row + KV_LORA_RANK + offs_pe[None, :], key_ok, pe_ok, True, MASK_ROPE, KV_FP8, q_own.dtype
        )
        qk = tl.dot(q_pe, tl.trans(pe), qk, input_precision=PRECISION)
        # -- online softmax, base 2 (a chunk may hold no valid entry: guard -inf - -inf) --
        s = tl.where(key_ok[None, :], qk * qk_scale, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        m_ij = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.math.exp2(s - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- the values are the latent rows already loaded --
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(c.dtype), c, acc, input_precision=PRECISION)
        m_i = m_ij

    empty = l_i == 0.0  # no valid entry (in this segment): zeros, lse -inf
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    if KV_FP8:
        o = o * kv_scale  # a split partial too: the merge is linear in the partial outputs
    if SPLIT:
        # Partial result of this segment, as `mla.py` writes them for `mla._merge`: normalised
        # output [S, T, H, LORA_PAD] and natural-log lse once per MERGE_CHUNK values [S, T, H * chunks].
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN_2_C)
        part_row = (split.to(tl.int64) * num_tokens + tok) * num_heads + head
        tl.store(O_parts + part_row[:, None] * LORA_PAD + offs_own[None, :], o, mask=row_ok[:, None])
        CHUNKS: tl.constexpr = LORA_PAD // MERGE_CHUNK
        OWN_CHUNKS: tl.constexpr = VALUE_W // MERGE_CHUNK
        offs_c = vs * OWN_CHUNKS + tl.arange(0, OWN_CHUNKS)
        tl.store(
            LSE_parts + part_row[:, None] * CHUNKS + offs_c[None, :],
            tl.broadcast_to(lse[:, None], (BLOCK_M, OWN_CHUNKS)),
            mask=row_ok[:, None],
        )
    else:
        tl.store(
            O + tok * stride_ot + head[:, None] * stride_oh + offs_own[None, :],
            o.to(O.dtype.element_ty),
            mask=row_ok[:, None] & lora_own_ok[None, :],
        )


_sparse_mla_launch = FastLaunch(_sparse_mla_kernel)


# ----------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------


def sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    topk_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    out: torch.Tensor | None = None,
    plan: SparseMlaPlan | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse MLA of each new token over its own selected latent rows (prefill chunks, decode
    and verification alike).

    Args:
        q: [T, H, kv_lora_rank + rope_dim] absorbed queries of all requests' new tokens, packed.
        kv_cache: [num_blocks, block_size, 1, kv_lora_rank + rope_dim] latent rows `[c, k_pe]`
            (this step's rows already stored), contiguous; in q.dtype, or float8_e4m3fn (an FP8
            cache: row ~ stored * kv_scale).
        block_table: [B, max_blocks] int32.
        cu_seqlens_q: [B + 1] int32 boundaries of each request's new tokens in q.
        topk_indices: [T, K] int32 logical positions within the token's request, -1 = empty
            (entries outside 0..the token's position are skipped too), contiguous.
        seq_lens: [B] int32 keys of each request after this step.
        kv_lora_rank: the value dims (the first kv_lora_rank of each row).
        scale: softmax scale (DeepSeek: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times
            any YaRN mscale^2).
        out: optional [T, H, kv_lora_rank] output buffer (last dim contiguous).
        plan: optional `SparseMlaPlan` forcing the tile config and split count (default:
            `plan_sparse_mla` from the shapes).
        kv_scale: the FP8 cache's dequantization scale (the layer's latent cache, keys and
            values alike): a float32 tensor of one element on the cache's device, read by the
            kernel (a CUDA graph replays with its current value). None = 1.0; ignored for a
            16/32-bit cache.
    Returns:
        o: [T, H, kv_lora_rank] in q.dtype; a token with no valid entry gets zeros.

    No host sync and no allocation that depends on device values: capturable in a CUDA graph.
    """
    name = "sparse_mla_attention"
    check_sparse_mla(
        name, q, kv_cache, block_table, cu_seqlens_q, topk_indices, seq_lens, kv_lora_rank, scale, kv_scale
    )
    if plan is not None and not isinstance(plan, SparseMlaPlan):
        raise ValueError(f"{name}: plan must be a SparseMlaPlan or None, got {type(plan).__name__}")
    o = mla_output(name, q, kv_lora_rank, out)
    T, H, width = q.shape
    rope_dim = width - kv_lora_rank
    K = topk_indices.shape[1]
    if plan is None:
        plan = plan_sparse_mla(
            T, H, K, q.dtype, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, cache_dtype=kv_cache.dtype
        )
    if T == 0:
        return o
    cfg = plan.config
    heads, block_m = tile_heads(cfg, H)
    vs = cfg.value_splits
    lora_pad = max(16 * vs, _next_pow2(kv_lora_rank))
    chunk = min(MERGE_CHUNK, lora_pad // vs)
    splits = plan.num_splits
    if splits > 1:
        o_parts = torch.empty((splits, T, H, lora_pad), dtype=torch.float32, device=q.device)
        lse_parts = torch.empty((splits, T, H * (lora_pad // chunk)), dtype=torch.float32, device=q.device)
    else:
        o_parts = lse_parts = o  # unused
    # The request of each packed token, on the device (no host sync).
    positions = torch.arange(T, device=q.device, dtype=cu_seqlens_q.dtype)
    token_request = (torch.searchsorted(cu_seqlens_q, positions, right=True) - 1).to(torch.int32)
    grid = (T * splits * cdiv(H, heads) * vs,)
    _sparse_mla_launch[grid](
        q, kv_cache, kv_scale_arg(kv_cache, kv_scale), o, o_parts, lse_parts,
        block_table, cu_seqlens_q, seq_lens, token_request, topk_indices,
        float(scale) * LOG2_E, T, H, K,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        block_table.stride(0), kv_cache.stride(0), kv_cache.stride(1), topk_indices.stride(0),
        splits,
        KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope_dim, LORA_PAD=lora_pad,
        ROPE_PAD=max(16, _next_pow2(rope_dim)), HEADS=heads, PAGE=kv_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, VALUE_SPLITS=vs, MERGE_CHUNK=chunk,
        SPLIT=splits > 1, KV_FP8=is_fp8(kv_cache), PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if splits > 1:
        _merge(o_parts, lse_parts, o, kv_lora_rank, chunk)
    return o


# ----------------------------------------------------------------------------------------------
# Argument checks (shared with the PyTorch twin, tilellm.kernels.reference.sparse_mla)
# ----------------------------------------------------------------------------------------------


def check_sparse_mla(
    name, q, kv_cache, block_table, cu_seqlens_q, topk_indices, seq_lens, kv_lora_rank, scale, kv_scale=None
):
    """Arguments of `sparse_mla_attention`: MLA's checks of q against the latent cache, plus
    topk_indices [T, K] int32 (one row per query token). Where values are read (CPU tensors, or
    TILELLM_DEBUG=1): entries must be -1 or a position 0..own position of the token's request."""
    v._check_rank(name, "q", q, 3, "[T, H, kv_lora_rank + rope_dim]")
    v._check_rank(name, "cu_seqlens_q", cu_seqlens_q, 1, "[B+1]")
    v._check_rank(name, "topk_indices", topk_indices, 2, "[T, K]")
    _check_common(
        name, q, kv_cache, block_table, seq_lens, kv_lora_rank, scale,
        {"cu_seqlens_q": cu_seqlens_q, "topk_indices": topk_indices}, kv_scale,
    )  # fmt: skip
    batch = block_table.shape[0]
    T = q.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(
            f"{name}: cu_seqlens_q must have B+1 = {batch + 1} entries (block_table has B = {batch} rows), "
            f"got {cu_seqlens_q.shape[0]}"
        )
    if seq_lens.shape[0] != batch:
        raise ValueError(
            f"{name}: seq_lens must have B = {batch} entries (block_table has {batch} rows), got {seq_lens.shape[0]}"
        )
    if topk_indices.shape[0] != T:
        raise ValueError(
            f"{name}: topk_indices [T, K] must have one row per query token (T = {T}), "
            f"got {topk_indices.shape[0]} rows"
        )
    if not v.deep_checks_enabled(q):
        return
    q_lens = v._check_cu_seqlens_values(name, "cu_seqlens_q", cu_seqlens_q, T)
    kv_lens = v._check_seq_lens_values(name, seq_lens, q_lens)
    v._check_block_table_values(name, block_table, kv_lens, kv_cache.shape[0], kv_cache.shape[1])
    _check_topk_values(name, topk_indices, q_lens, kv_lens)


def _check_topk_values(name, topk_indices, q_lens, kv_lens) -> None:
    """Every entry -1 or a causal position of its token (host values)."""
    topk = topk_indices.cpu().long()
    if topk.numel() == 0:
        return
    bad = topk < -1
    if bool(bad.any()):
        t, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{name}: topk_indices[{t}, {j}] = {int(topk[t, j])} is negative (only -1 marks an empty entry)"
        )
    batch = q_lens.shape[0]
    T = topk.shape[0]
    req = torch.repeat_interleave(torch.arange(batch), q_lens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    own_pos = kv_lens[req] - q_lens[req] + (torch.arange(T) - starts[req])
    bad = topk > own_pos[:, None]
    if bool(bad.any()):
        t, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{name}: topk_indices[{t}, {j}] = {int(topk[t, j])} is a future position: token {t} "
            f"(request {int(req[t])}) sits at position {int(own_pos[t])} and may only attend to 0..{int(own_pos[t])}"
        )
