"""DeepSeek's multi-head latent attention (MLA) over a paged latent cache, in the absorbed form.

The cache holds one row per token and layer, `[c, k_pe]`: the normalised latent `c`
(kv_lora_rank values, 512 in DeepSeek-V2/V3) and the rotated shared key `k_pe` (rope_dim
values, 64): kv_cache [num_blocks, block_size, 1, kv_lora_rank + rope_dim]. Each query head
arrives absorbed, `q_h = [q_nope_h @ W_UK_h, q_pe_h]`, and

    score_h(r) = scale * (q_nope_h . c_r + q_pe_h . k_pe_r),    o_h = softmax_r(score_h) @ c

(the values are the first kv_lora_rank values of the same rows; `o_h @ W_UV_h` is the head's
output). Every query head reads the same row: MQA with one KV head. So a program owns many query
heads: `heads` of them x `block_q` tokens of one request, packed as the rows of one tile (row r
= token r // heads, head r % heads, as `paged.py` packs a GQA group), and every latent tile read
from the cache serves all of them. The tile of rows [block_n, kv_lora_rank] loaded for the
scores is the value tile of the same step: each row is read once.

The two parts stay separate: q_nope . c over kv_lora_rank (padded to a power of two with masks)
plus q_pe . k_pe over rope_dim (padded on its own), so 512 + 64 never pads to 1024. With
`value_splits` = 2 two programs share a tile of rows, each accumulating half of the value dims
(both compute the full scores: FlashMLA splits the 512 value dims between two warpgroups the
same way), which halves the fp32 accumulator per program.

Positions as in `paged_attention`: token j of request i sits at `seq_lens[i] - q_len_i + j` and
sees keys 0..position; key tiles visible to every row of a tile run unmasked, only the tiles
crossing the diagonal are masked. Scores, softmax (base 2, log2(e) folded into the scale) and
accumulation run in fp32; outputs come back in q.dtype.

An FP8 cache (`torch.float8_e4m3fn`: row ~ stored * kv_scale, one fp32 scale for the layer's
cache, keys and values alike) is read as stored, half the bytes, and converted to q.dtype in
registers (exact: e4m3 values fit fp16, bf16 and fp32). The scale, loaded on the device, is
folded into the softmax scale for the scores and multiplies the output once at the end (each
split segment's partial output: the merge is linear in them). A 16/32-bit cache compiles the
same kernel as before (`KV_FP8` off).

Split-KV: when (requests x head tiles x query tiles) cannot fill the GPU, each program covers
one of `num_splits` key segments and writes its normalised partial output and log-sum-exp;
`merge.merge_into` combines them (over 128-value chunks of each head, so its tiles stay small
for 512 values and up to 64 segments).

Planning (`plan_mla`) runs on the host from what the host knows: the engine plans once per step
and every layer and CUDA-graph capture reuses the `MlaPlan`; given none, the kernels plan from
`max_seqlen_k` or, without it, from the block table's width x block_size (never a device read,
so `mla_decode_attention` is capturable in a CUDA graph as called).
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
from tilellm.kernels.fp8 import is_fp8, unit_scale
from tilellm.kernels.launch import FastLaunch
from tilellm.kernels.merge import merge_into

LN_2_C = tl.constexpr(LN_2)  # converts the base-2 log-sum-exp to natural log

MAX_KV_LORA_RANK = 1024  # one program holds [rows, kv_lora_rank / value_splits] fp32 accumulators
MAX_ROPE_DIM = 256
MERGE_CHUNK = 128  # values per merge program: the merge's tile is [splits, 128] fp32, not [splits, 512]


# ----------------------------------------------------------------------------------------------
# Tile configs and the split-KV plan
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MlaConfig:
    """One program's tile: up to `block_h` query heads x as many tokens as fit `rows` rows (at
    least 16, a power of two), `block_n` latent rows per inner step, and `value_splits`
    programs sharing each tile of rows (each accumulating kv_lora_rank / value_splits values)."""

    block_h: int
    rows: int
    block_n: int
    num_warps: int
    num_stages: int
    value_splits: int = 1

    def __post_init__(self):
        if self.value_splits not in (1, 2):
            raise ValueError(f"MlaConfig: value_splits must be 1 or 2, got {self.value_splits}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"MlaConfig: block_n must be a power of two >= 16 (tl.dot), got {self.block_n}")
        if self.block_h < 1 or self.rows < 1:
            raise ValueError(f"MlaConfig: block_h and rows must be >= 1, got {self.block_h}, {self.rows}")


# Hopper (H100/H200), half precision, DeepSeek's 512 + 64, from `python -m tilellm.bench.mla
# --sweep` on an H200 (bf16, page 64; docs/benchmarks.md has the table). Registers and spills
# are ptxas's for sm_90a (Triton 3.9, `cuobjdump --dump-resource-usage`).
# - WIDE (>= 64 rows: 64+ heads, or tokens x heads of a verification): 64 rows over 8 warps, 64-key
#   tiles two deep, the 512 values in one piece. It spills (255 registers, ~384 bytes a thread)
#   and is still the fastest measured: M1 (128 heads, 64 x 4096) 0.270 ms = 271 TFLOP/s, against
#   0.331 ms for 128-row tiles in value halves and 0.745 ms for 64 rows in halves with 32-key
#   tiles (no spill, but a second pass of the scores and half-filled wgmma tiles).
# - MID (32 rows: 32 heads): WIDE's settings (not measured at 32 heads).
# - NARROW (16 rows: <= 16 heads decoding): mma.sync tiles, 4 warps, 64-key tiles two deep: M3
#   (16 heads, 64 x 4096) 0.107 ms = 2849 GB/s, against 0.150 ms for 32-key tiles three deep.
# - kv_lora_rank > 512: value halves for every tile.
# - fp32 (tests on a GPU): [16, 512] accumulators and 16-key tiles (a stage is 36 KB).
# - the interpreter: the smallest tiles (it runs every program in Python).
WIDE = MlaConfig(block_h=64, rows=64, block_n=64, num_warps=8, num_stages=2)
MID = MlaConfig(block_h=64, rows=64, block_n=64, num_warps=8, num_stages=2)
NARROW = MlaConfig(block_h=64, rows=64, block_n=64, num_warps=4, num_stages=2)
FP32 = MlaConfig(block_h=16, rows=16, block_n=16, num_warps=4, num_stages=2)
INTERPRETER = MlaConfig(block_h=16, rows=16, block_n=16, num_warps=4, num_stages=1)
# What `tilellm.bench.mla --sweep` times beside the table's pick (registers / spilled bytes as above).
SWEEP_CONFIGS = [
    WIDE,
    NARROW,
    MlaConfig(64, 64, 32, 8, 2, value_splits=2),  # 64 rows: 214 / 0 (the first, unmeasured pick)
    MlaConfig(64, 64, 32, 8, 2),  # 64 rows: 255 / 168
    MlaConfig(64, 64, 32, 4, 3),  # 16 rows: 206 / 0
    MlaConfig(64, 64, 16, 8, 2, value_splits=2),  # 64 rows: 192 / 0
    MlaConfig(64, 64, 32, 8, 3, value_splits=2),  # 64 rows: 226 / 0
    MlaConfig(64, 64, 64, 8, 2, value_splits=2),  # 64 rows: 255 / 80
    MlaConfig(64, 64, 16, 8, 2),  # 64 rows: 255 / 104
    MlaConfig(64, 64, 64, 8, 2),  # 64 rows: 255 / 384
    MlaConfig(128, 128, 32, 8, 2, value_splits=2),  # 128 heads in one tile: 222 / 0, 216 KB
    MlaConfig(32, 32, 32, 8, 2),  # 32-head tiles: 189 / 0
    MlaConfig(16, 16, 32, 4, 3),  # 16-head tiles: 206 / 0
    MlaConfig(16, 16, 32, 8, 3),  # 16 rows: 133 / 0
    MlaConfig(16, 16, 16, 4, 3),  # 16 rows: 190 / 0
    MlaConfig(16, 16, 32, 4, 3, value_splits=2),  # 16 rows: 158 / 0
    MlaConfig(16, 16, 64, 4, 2),  # 16 rows: 255 / 312
]

# Split-KV. Programs of these tiles are heavy (a stage of latent rows is 36-72 KB of shared
# memory): about one resident per SM, so one program per SM is the target.
PROGRAMS_PER_SM = 1.0
FILL_SHARE = 0.8  # no split when the unsplit programs reach this share of the target (as schedule.py)
MAX_SPLITS = 64
MIN_KEYS_PER_SPLIT = 256
# A segment's partial output (rows x kv_lora_rank fp32, written, then read by the merge) should
# cost at most this share of the latent bytes the segment reads: segments of a 64-row tile are
# then >= ~900 keys of 576 bf16 values, those of a 16-row tile >= MIN_KEYS_PER_SPLIT.
PARTIAL_SHARE = 0.25


def mla_config(
    kv_lora_rank: int, rope_dim: int, dtype: torch.dtype, num_heads: int, max_seqlen_q: int
) -> MlaConfig:
    """The table's tile config for a batch (see the comments above it)."""
    if interpreting():
        return INTERPRETER
    if dtype == torch.float32:
        return FP32
    _, _, block_m = tile_shape(WIDE, num_heads, max_seqlen_q)  # WIDE, MID, NARROW: the same tiles
    cfg = WIDE if block_m >= 64 else MID if block_m >= 32 else NARROW
    if kv_lora_rank > 512 and cfg.value_splits == 1:
        cfg = MlaConfig(cfg.block_h, cfg.rows, cfg.block_n, cfg.num_warps, cfg.num_stages, value_splits=2)
    return cfg


def tile_shape(cfg: MlaConfig, num_heads: int, max_seqlen_q: int) -> tuple[int, int, int]:
    """(heads, block_q, block_m) of one program: min(H, block_h) heads (any count: rows past them
    are masked) x block_q tokens (a power of two, no more than a request's tokens need), padded to
    block_m rows (a power of two >= 16, tl.dot's smallest)."""
    heads = max(1, min(num_heads, cfg.block_h))
    block_q = max(1, cfg.rows // heads)
    block_q = 1 << (block_q.bit_length() - 1)
    block_q = min(block_q, _next_pow2(max(1, max_seqlen_q)))
    block_m = max(16, _next_pow2(block_q * heads))
    return heads, block_q, block_m


@dataclass(frozen=True)
class MlaPlan:
    """How `mla_paged_attention` / `mla_decode_attention` run one batch: the tile config and
    the split-KV plan. Made on the host (`plan_mla`, no device read), once per step; every layer
    and CUDA-graph capture reuses it (pass it as `num_splits=`)."""

    config: MlaConfig
    num_splits: int
    # Segments are never cut shorter than this (a short request gets fewer non-empty segments;
    # the others record empty partials). 0 for a forced count.
    min_keys_per_split: int
    programs: int  # programs without splitting: requests x head tiles x query tiles x value splits
    reason: str


def plan_mla(
    num_requests: int,
    num_heads: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dtype: torch.dtype,
    block_size: int,
    *,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    num_splits: int | None = None,
    config: MlaConfig | None = None,
    num_sms_: int | None = None,
    cache_dtype: torch.dtype | None = None,
) -> MlaPlan:
    """The tile config (`mla_config`, or `config`) and the split-KV count of a batch, on the host.

    No split when the longest context holds fewer than two minimal segments or the unsplit
    programs reach FILL_SHARE of PROGRAMS_PER_SM x SMs; otherwise enough segments for the target,
    each at least `min_keys_per_split` keys (MIN_KEYS_PER_SPLIT, or more where a tile's partial
    output would cost over PARTIAL_SHARE of the rows it reads; whole pages), at most MAX_SPLITS.
    `num_splits` forces the count. `max_seqlen_k` may be an upper bound (the kernels, given no
    plan and no max_seqlen_k, pass the block table's width x block_size). `dtype` is q's (it
    picks the tiles); `cache_dtype` the cache's (default `dtype`): an FP8 cache's rows are half
    the bytes, so a segment needs twice the keys to outweigh its partial output.
    """
    cfg = config or mla_config(kv_lora_rank, rope_dim, dtype, num_heads, max_seqlen_q)
    heads, block_q, block_m = tile_shape(cfg, num_heads, max_seqlen_q)
    q_tiles = _cdiv(max(max_seqlen_q, 1), block_q)
    programs = num_requests * _cdiv(num_heads, heads) * q_tiles * cfg.value_splits
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 1:
            raise ValueError(f"plan_mla: num_splits must be an int >= 1 or None, got {num_splits!r}")
        n = int(num_splits)
        return MlaPlan(cfg, n, 0, programs, f"forced: num_splits={n}")
    elem = torch.finfo(cache_dtype or dtype).bits // 8
    row_bytes = (kv_lora_rank + rope_dim) * elem
    partial_bytes = 2 * block_m * kv_lora_rank * 4  # written by the kernel, read by the merge
    min_keys = max(MIN_KEYS_PER_SPLIT, math.ceil(partial_bytes / PARTIAL_SHARE / row_bytes))
    min_keys = _cdiv(min_keys, block_size) * block_size
    sms = num_sms_ or num_sms()
    target = math.ceil(PROGRAMS_PER_SM * sms)
    if max_seqlen_k < 2 * min_keys:
        return MlaPlan(cfg, 1, 0, programs, f"no split: longest context {max_seqlen_k} < 2 x {min_keys} keys")
    if programs >= FILL_SHARE * target:
        reason = f"no split: {programs} programs reach {FILL_SHARE:.0%} of the {target} that fill {sms} SMs"
        return MlaPlan(cfg, 1, 0, programs, reason)
    # Whole waves only: a program fills an SM (one resident), so 16 programs x 9 segments = 144
    # would run as two waves of 132 + 12 (M2 measured 0.535 ms there against M1's 0.270).
    n = max(1, min(target // programs, MAX_SPLITS, max_seqlen_k // min_keys))
    reason = (
        f"split {n}: {programs} programs for {sms} SMs give {programs * n} "
        f"(target {target}, >= {min_keys} keys per segment, cap {MAX_SPLITS})"
    )
    return MlaPlan(cfg, n, min_keys, programs, reason)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << (max(1, x) - 1).bit_length()


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_rows(
    ptrs, key_ok, dim_ok, MASK_KEYS: tl.constexpr, MASK_DIMS: tl.constexpr, KV_FP8: tl.constexpr,
    DTYPE: tl.constexpr,
):  # fmt: skip
    """A [keys, dims] tile of latent rows in DTYPE (the query's); masks only where keys or padded
    dims need them. FP8 rows are converted in registers after the load: e4m3 values are exact
    in fp16, bf16 and fp32, so the dots see the stored values (the scale is applied outside)."""
    if MASK_KEYS:
        if MASK_DIMS:
            x = tl.load(ptrs, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=key_ok[:, None], other=0.0)
    else:
        if MASK_DIMS:
            x = tl.load(ptrs, mask=dim_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    if KV_FP8:
        x = x.to(DTYPE)
    return x


@triton.jit
def _mla_tiles(
    acc, l_i, m_i, q_own, q_other, q_pe, q_pos,
    KV, bt_row, stride_cb, stride_cs, offs_n, offs_own, offs_other, offs_pe,
    n_start, n_end, key_end, qk_scale,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    VALUE_SPLITS: tl.constexpr, MASK_LORA: tl.constexpr, MASK_ROPE: tl.constexpr,
    MASKED: tl.constexpr, KV_FP8: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax over latent tiles [n_start, n_end) gathered through the block table (FP8
    rows: their scale is in `qk_scale` and applied to the output by the caller)."""
    lora_own_ok = offs_own < KV_LORA_RANK
    lora_other_ok = offs_other < KV_LORA_RANK
    pe_ok = offs_pe < ROPE_DIM
    for n in tl.range(n_start, n_end, BLOCK_N):
        k_pos = n + offs_n
        key_ok = k_pos < key_end
        if MASKED:
            block = tl.load(bt_row + k_pos // PAGE, mask=key_ok, other=0)
        else:
            block = tl.load(bt_row + k_pos // PAGE)
        # int64: block * stride overflows int32 in large pools.
        row = KV + (block.to(tl.int64) * stride_cb + (k_pos % PAGE) * stride_cs)[:, None]
        # -- scores: q_nope . c (this program's value dims, then the others) + q_pe . k_pe --
        c = _load_rows(row + offs_own[None, :], key_ok, lora_own_ok, MASKED, MASK_LORA, KV_FP8, q_own.dtype)
        qk = tl.dot(q_own, tl.trans(c), input_precision=PRECISION)
        if VALUE_SPLITS == 2:
            c_other = _load_rows(
                row + offs_other[None, :], key_ok, lora_other_ok, MASKED, MASK_LORA, KV_FP8, q_own.dtype
            )
            qk = tl.dot(q_other, tl.trans(c_other), qk, input_precision=PRECISION)
        pe = _load_rows(
            row + KV_LORA_RANK + offs_pe[None, :], key_ok, pe_ok, MASKED, MASK_ROPE, KV_FP8, q_own.dtype
        )
        qk = tl.dot(q_pe, tl.trans(pe), qk, input_precision=PRECISION)
        # -- online softmax, base 2 --
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
        # -- the values are the latent tile already loaded --
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(c.dtype), c, acc, input_precision=PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


# Per-step values (token counts, table widths, split counts), index pointers and the scale's
# pointer are not specialised on, so a new batch never compiles a new variant in the middle of
# serving.
@triton.jit(
    do_not_specialize=["num_tokens", "stride_bt", "num_splits", "min_split_keys"],
    do_not_specialize_on_alignment=["block_table", "cu_seqlens_q", "seq_lens", "KV_scale"],
)
def _mla_kernel(
    Q, KV, KV_scale, O, O_parts, LSE_parts,  # tensors (KV_scale: fp32 [1], read when KV_FP8)
    block_table, cu_seqlens_q, seq_lens,  # batch description
    qk_scale, num_tokens, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs,
    num_splits, min_split_keys,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, LORA_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
    HEADS: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, VALUE_SPLITS: tl.constexpr, MERGE_CHUNK: tl.constexpr,
    SPLIT: tl.constexpr, IS_DECODE: tl.constexpr, KV_FP8: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # -- which work: program_id(0) = ((query tile x split) x head tile) x value split, fastest
    # last (the head tiles and value halves of a segment run side by side and share its rows in
    # L2); program_id(1) = request --
    pid = tl.program_id(0)
    req = tl.program_id(1)
    head_tiles = tl.cdiv(num_heads, HEADS)
    vs = pid % VALUE_SPLITS
    pid = pid // VALUE_SPLITS
    head_tile = pid % head_tiles
    pid = pid // head_tiles
    split = pid % num_splits
    q_tile = pid // num_splits

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

    # -- rows: block_q tokens x HEADS heads --
    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // HEADS
    head = head_tile * HEADS + rows % HEADS
    row_ok = (rows < BLOCK_Q * HEADS) & (tok < q_len) & (head < num_heads)
    q_pos = context + tok
    q_row = (q_start + tok).to(tl.int64)
    VALUE_W: tl.constexpr = LORA_PAD // VALUE_SPLITS
    offs_own = vs * VALUE_W + tl.arange(0, VALUE_W)  # the value dims this program accumulates
    offs_other = (1 - vs) * VALUE_W + tl.arange(0, VALUE_W)  # the rest of q_nope (VALUE_SPLITS 2)
    offs_pe = tl.arange(0, ROPE_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    q_ptr = Q + q_row[:, None] * stride_qt + head[:, None] * stride_qh
    q_own = tl.load(
        q_ptr + offs_own[None, :], mask=row_ok[:, None] & (offs_own < KV_LORA_RANK)[None, :], other=0.0
    )
    q_other = q_own
    if VALUE_SPLITS == 2:
        q_other = tl.load(
            q_ptr + offs_other[None, :],
            mask=row_ok[:, None] & (offs_other < KV_LORA_RANK)[None, :],
            other=0.0,
        )
    q_pe = tl.load(
        q_ptr + KV_LORA_RANK + offs_pe[None, :],
        mask=row_ok[:, None] & (offs_pe < ROPE_DIM)[None, :],
        other=0.0,
    )

    # -- this program's key range: causal end of the tile, cut into segments --
    last_tok = tl.minimum(t0 + BLOCK_Q, q_len) - 1
    kv_end = context + last_tok + 1
    full_end = (context + t0 + 1) // BLOCK_N * BLOCK_N  # tiles visible to every row of the tile
    if SPLIT:
        # num_splits equal segments (whole key tiles each), never shorter than min_split_keys
        seg = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        seg = tl.maximum(seg, tl.cdiv(min_split_keys, BLOCK_N) * BLOCK_N)
        lo = split * seg
        hi = tl.minimum(lo + seg, kv_end)
    else:
        lo = 0
        hi = kv_end
    full_hi = tl.maximum(tl.minimum(full_end, hi), lo)
    masked_lo = tl.maximum(full_end, lo)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, VALUE_W], dtype=tl.float32)
    bt_row = block_table + req.to(tl.int64) * stride_bt
    if KV_FP8:
        # Stored rows are value / kv_scale: scores are linear in the keys' scale (folded into
        # the softmax scale here), the output in the values' (applied once at the end). Read on
        # the device, so a CUDA graph replays with the scale's current value.
        kv_scale = tl.load(KV_scale)
        qk_scale = qk_scale * kv_scale
    MASK_LORA: tl.constexpr = KV_LORA_RANK != LORA_PAD
    MASK_ROPE: tl.constexpr = ROPE_DIM != ROPE_PAD
    acc, l_i, m_i = _mla_tiles(
        acc, l_i, m_i, q_own, q_other, q_pe, q_pos,
        KV, bt_row, stride_cb, stride_cs, offs_n, offs_own, offs_other, offs_pe,
        lo, full_hi, hi, qk_scale,
        KV_LORA_RANK, ROPE_DIM, PAGE, BLOCK_N, VALUE_SPLITS, MASK_LORA, MASK_ROPE, False, KV_FP8, PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _mla_tiles(
        acc, l_i, m_i, q_own, q_other, q_pe, q_pos,
        KV, bt_row, stride_cb, stride_cs, offs_n, offs_own, offs_other, offs_pe,
        masked_lo, hi, hi, qk_scale,
        KV_LORA_RANK, ROPE_DIM, PAGE, BLOCK_N, VALUE_SPLITS, MASK_LORA, MASK_ROPE, True, KV_FP8, PRECISION,
    )  # fmt: skip

    if SPLIT:
        # Partial result of this segment: normalised output [S, T, H, LORA_PAD] and natural-log
        # lse (-inf if empty), the lse once per MERGE_CHUNK values ([S, T, H * chunks]: the merge
        # runs over chunks of a head's values). A partial is linear in the values' scale and
        # its lse (of the scaled scores) is not: scaling each partial scales the merged output.
        empty = l_i == 0.0
        o = acc / tl.where(empty, 1.0, l_i)[:, None]
        if KV_FP8:
            o = o * kv_scale
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN_2_C)
        part_row = (split.to(tl.int64) * num_tokens + q_row) * num_heads + head
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
        o = acc / l_i[:, None]
        if KV_FP8:
            o = o * kv_scale
        tl.store(
            O + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_own[None, :],
            o.to(O.dtype.element_ty),
            mask=row_ok[:, None] & (offs_own < KV_LORA_RANK)[None, :],
        )


_mla_launch = FastLaunch(_mla_kernel)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def mla_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    *,
    kv_lora_rank: int,
    scale: float,
    num_splits: int | MlaPlan | None = None,
    max_seqlen_k: int | None = None,
    out: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal MLA of each request's new tokens over its paged latent rows (verification, chunked
    and prefix-cached prefill, decode).

    Args:
        q: [T, H, kv_lora_rank + rope_dim] absorbed queries of all requests' new tokens, packed.
        kv_cache: [num_blocks, block_size, 1, kv_lora_rank + rope_dim] latent rows `[c, k_pe]`
            (this step's rows already stored), contiguous; in q.dtype, or float8_e4m3fn (an FP8
            cache: row ~ stored * kv_scale).
        block_table: [B, max_blocks] int32.
        cu_seqlens_q: [B + 1] int32 boundaries of each request's new tokens in q (empty requests
            allowed).
        seq_lens: [B] int32 keys of each request after this step (prefix + new tokens).
        max_seqlen_q: the most new tokens of any request.
        kv_lora_rank: the value dims (the first kv_lora_rank of each row).
        scale: softmax scale, (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 in DeepSeek (times
            any YaRN mscale^2).
        num_splits: None plans (`plan_mla`, no device read); an int forces that many key
            segments; an `MlaPlan` made on the host is used as is.
        max_seqlen_k: optional bound on `seq_lens` for the plan (default: the block table's
            width x block_size).
        out: optional [T, H, kv_lora_rank] output buffer (last dim contiguous).
        kv_scale: the FP8 cache's dequantization scale (one for the layer's latent cache, keys
            and values alike): a float32 tensor of one element on the cache's device, read by
            the kernel (a CUDA graph replays with its current value). None = 1.0; ignored for
            a 16/32-bit cache.
    Returns:
        o: [T, H, kv_lora_rank] in q.dtype.
    """
    name = "mla_paged_attention"
    check_mla_paged(
        name, q, kv_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, kv_lora_rank, scale, kv_scale
    )
    check_mla_hints(name, num_splits, max_seqlen_k, seq_lens)
    o = mla_output(name, q, kv_lora_rank, out)
    _launch(q, kv_cache, kv_scale, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, o, kv_lora_rank,
            scale, num_splits, max_seqlen_k, is_decode=False)  # fmt: skip
    return o


def mla_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    num_splits: int | MlaPlan | None = None,
    max_seqlen_k: int | None = None,
    out: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per request: q [B, H, kv_lora_rank + rope_dim] at position `seq_lens[i] - 1`
    -> o [B, H, kv_lora_rank]; the q_len = 1 case of `mla_paged_attention`, with split-KV, an
    FP8 cache and its `kv_scale` alike. No host sync and no host-dependent allocation beyond the
    plan: capturable in a CUDA graph."""
    name = "mla_decode_attention"
    check_mla_decode(name, q, kv_cache, block_table, seq_lens, kv_lora_rank, scale, kv_scale)
    check_mla_hints(name, num_splits, max_seqlen_k, seq_lens)
    o = mla_output(name, q, kv_lora_rank, out)
    _launch(q, kv_cache, kv_scale, block_table, None, seq_lens, 1, o, kv_lora_rank, scale, num_splits,
            max_seqlen_k, is_decode=True)  # fmt: skip
    return o


def kv_scale_arg(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """The kernels' KV_scale pointer: an FP8 cache's scale (`unit_scale` when None); for a
    16/32-bit cache the cache itself, never read (KV_FP8 is off)."""
    if not is_fp8(kv_cache):
        return kv_cache
    return unit_scale(kv_cache.device) if kv_scale is None else kv_scale


def _launch(
    q, kv_cache, kv_scale, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, o, kv_lora_rank, scale,
    num_splits, max_seqlen_k, *, is_decode,
):  # fmt: skip
    T, H, width = q.shape
    rope_dim = width - kv_lora_rank
    batch = seq_lens.shape[0]
    page = kv_cache.shape[1]
    if isinstance(num_splits, MlaPlan):
        plan = num_splits  # planned on the host by the caller (no sync, CUDA-graph safe)
    else:
        bound = max_seqlen_k if max_seqlen_k is not None else block_table.shape[1] * page
        plan = plan_mla(batch, H, max_seqlen_q, bound, q.dtype, page, kv_lora_rank=kv_lora_rank,
                        rope_dim=rope_dim, num_splits=num_splits, cache_dtype=kv_cache.dtype)  # fmt: skip
    if T == 0 or batch == 0:
        return
    cfg = plan.config
    heads, block_q, block_m = tile_shape(cfg, H, max_seqlen_q)
    vs = cfg.value_splits
    lora_pad = max(16 * vs, _next_pow2(kv_lora_rank))
    chunk = min(MERGE_CHUNK, lora_pad // vs)
    splits = plan.num_splits
    q_tiles = cdiv(max(max_seqlen_q, 1), block_q)
    grid = (q_tiles * splits * cdiv(H, heads) * vs, batch)
    if splits > 1:
        o_parts = torch.empty((splits, T, H, lora_pad), dtype=torch.float32, device=q.device)
        lse_parts = torch.empty((splits, T, H * (lora_pad // chunk)), dtype=torch.float32, device=q.device)
    else:
        o_parts = lse_parts = o  # unused
    _mla_launch[grid](
        q, kv_cache, kv_scale_arg(kv_cache, kv_scale), o, o_parts, lse_parts,
        block_table, cu_seqlens_q if cu_seqlens_q is not None else seq_lens, seq_lens,
        float(scale) * LOG2_E, T, H,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        block_table.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        splits, plan.min_keys_per_split,
        KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope_dim, LORA_PAD=lora_pad,
        ROPE_PAD=max(16, _next_pow2(rope_dim)), HEADS=heads, PAGE=page,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n, VALUE_SPLITS=vs, MERGE_CHUNK=chunk,
        SPLIT=splits > 1, IS_DECODE=is_decode, KV_FP8=is_fp8(kv_cache), PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if splits > 1:
        _merge(o_parts, lse_parts, o, kv_lora_rank, chunk)


def _merge(o_parts, lse_parts, o, kv_lora_rank, chunk) -> None:
    """Merge the segments over chunks of `chunk` values of each head (`merge_into` sees H x chunks
    heads of `chunk` values): o_parts [S, T, H, lora_pad] -> o [T, H, kv_lora_rank]."""
    S, T, H, lora_pad = o_parts.shape
    chunks = lora_pad // chunk
    parts = o_parts.view(S, T, H * chunks, chunk)
    if kv_lora_rank == lora_pad and o.stride(1) == kv_lora_rank:
        merge_into(parts, lse_parts, o.view(T, H * chunks, chunk))
        return
    # Padded value dims, or an output view whose heads are not adjacent: merge, then copy.
    full = torch.empty((T, H * chunks, chunk), dtype=o.dtype, device=o.device)
    merge_into(parts, lse_parts, full)
    o.copy_(full.view(T, H, lora_pad)[:, :, :kv_lora_rank])


# ----------------------------------------------------------------------------------------------
# Argument checks (shared with the PyTorch twin, tilellm.kernels.reference.mla)
# ----------------------------------------------------------------------------------------------


def check_mla_paged(
    name, q, kv_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, kv_lora_rank, scale, kv_scale=None
):
    """Arguments of `mla_paged_attention`: q [T, H, kv_lora_rank + rope_dim] against the latent cache."""
    v._check_rank(name, "q", q, 3, "[T, H, kv_lora_rank + rope_dim]")
    v._check_rank(name, "cu_seqlens_q", cu_seqlens_q, 1, "[B+1]")
    _check_common(
        name, q, kv_cache, block_table, seq_lens, kv_lora_rank, scale, {"cu_seqlens_q": cu_seqlens_q},
        kv_scale,
    )  # fmt: skip
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
    v._check_max_seqlen_type(name, "max_seqlen_q", max_seqlen_q)
    if not v.deep_checks_enabled(q):
        return
    q_lens = v._check_cu_seqlens_values(name, "cu_seqlens_q", cu_seqlens_q, q.shape[0])
    v._check_max_seqlen_value(name, "max_seqlen_q", max_seqlen_q, q_lens)
    kv_lens = v._check_seq_lens_values(name, seq_lens, q_lens)
    v._check_block_table_values(name, block_table, kv_lens, kv_cache.shape[0], kv_cache.shape[1])


def check_mla_decode(name, q, kv_cache, block_table, seq_lens, kv_lora_rank, scale, kv_scale=None):
    """Arguments of `mla_decode_attention`: q [B, H, kv_lora_rank + rope_dim], one token per request."""
    v._check_rank(name, "q", q, 3, "[B, H, kv_lora_rank + rope_dim]")
    _check_common(name, q, kv_cache, block_table, seq_lens, kv_lora_rank, scale, {}, kv_scale)
    batch = q.shape[0]
    if block_table.shape[0] != batch:
        raise ValueError(
            f"{name}: block_table must have B = {batch} rows (one per query of q [B, H, D]), got {block_table.shape[0]}"
        )
    if seq_lens.shape[0] != batch:
        raise ValueError(
            f"{name}: seq_lens must have B = {batch} entries (one per query of q [B, H, D]), got {seq_lens.shape[0]}"
        )
    if not v.deep_checks_enabled(q):
        return
    kv_lens = v._check_seq_lens_values(name, seq_lens, torch.ones(batch, dtype=torch.int64))
    v._check_block_table_values(name, block_table, kv_lens, kv_cache.shape[0], kv_cache.shape[1])


def check_mla_hints(name, num_splits, max_seqlen_k, seq_lens) -> None:
    """`num_splits` (int, `MlaPlan` or None) and `max_seqlen_k` (>= every seq_lens entry)."""
    v.check_split_hints(name, num_splits, max_seqlen_k, seq_lens)


def mla_output(name, q, kv_lora_rank, out) -> torch.Tensor:
    """The output buffer [T, H, kv_lora_rank] in q.dtype: `out` once checked, else a new one."""
    shape = (q.shape[0], q.shape[1], kv_lora_rank)
    if out is None:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    v.check_out(name, out, shape, q.dtype, q.device)
    return out


def _check_common(
    name, q, kv_cache, block_table, seq_lens, kv_lora_rank, scale, extra_indices, kv_scale
) -> None:
    """The checks every MLA kernel shares: q against the latent cache (q.dtype or FP8, with an
    optional kv_scale), the index tensors' dtypes, devices and layouts, kv_lora_rank and scale."""
    v._check_rank(name, "kv_cache", kv_cache, 4, "[num_blocks, block_size, 1, kv_lora_rank + rope_dim]")
    v._check_rank(name, "block_table", block_table, 2, "[B, max_blocks_per_seq]")
    v._check_rank(name, "seq_lens", seq_lens, 1, "[B]")
    v._check_float(name, {"q": q})
    v.check_cache_dtype(name, "q", q, {"kv_cache": kv_cache}, {"kv_scale": kv_scale})
    indices = {"block_table": block_table, **extra_indices, "seq_lens": seq_lens}
    v._check_int32(name, indices)
    v._check_device(name, {"q": q, "kv_cache": kv_cache, **indices})
    _check_rank_value(name, kv_lora_rank)
    _check_scale(name, scale)
    width = q.shape[2]
    rope_dim = width - kv_lora_rank
    if not 1 <= rope_dim <= MAX_ROPE_DIM:
        raise ValueError(
            f"{name}: q's last dim ({width}) must be kv_lora_rank + rope_dim with kv_lora_rank = {kv_lora_rank} "
            f"and 1 <= rope_dim <= {MAX_ROPE_DIM}, got rope_dim = {rope_dim}"
        )
    if kv_cache.shape[2] != 1:
        raise ValueError(
            f"{name}: kv_cache must have one KV head (dim 2 of [num_blocks, block_size, 1, D]: the latent row "
            f"all query heads share), got {kv_cache.shape[2]}"
        )
    if kv_cache.shape[3] != width:
        raise ValueError(
            f"{name}: kv_cache's last dim ({kv_cache.shape[3]}) must equal q's kv_lora_rank + rope_dim = {width}"
        )
    if kv_cache.shape[1] < 1:
        raise ValueError(f"{name}: block_size (kv_cache dim 1) must be >= 1, got {kv_cache.shape[1]}")
    if q.shape[1] < 1:
        raise ValueError(f"{name}: q must have at least one head, got shape {tuple(q.shape)}")
    v._check_last_dim_stride(name, {"q": q})
    v._check_contiguous(name, {"kv_cache": kv_cache, **indices})


def _check_rank_value(name, kv_lora_rank) -> None:
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, numbers.Integral):
        raise ValueError(f"{name}: kv_lora_rank must be a Python int, got {type(kv_lora_rank).__name__}")
    if not 1 <= kv_lora_rank <= MAX_KV_LORA_RANK:
        raise ValueError(f"{name}: kv_lora_rank must be in 1..{MAX_KV_LORA_RANK}, got {kv_lora_rank}")


def _check_scale(name, scale) -> None:
    if scale is None:
        raise ValueError(
            f"{name}: scale is required (MLA's is (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, "
            "which the absorbed width does not give)"
        )
    try:
        v.resolve_scale(scale, 1)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
