"""The planner of the paged kernels: which kernel runs a batch, and its split-KV plan.

`plan_paged` is the one place that decides, for a batch, between `paged.py`, `hopper.py`
(Hopper's Gluon kernel for prompt chunks) and `decode_fp8.py` (Hopper's for decode over an FP8
cache) and how many key segments each program's range is cut into
(`choose_num_splits`). It reads only what the host knows (shapes, the longest context), so the
engine's attention backend calls it once per step and every layer and CUDA graph reuses the
result; the kernels call it themselves when given no plan. The launch order and grid live here
too (`query_tiles_first`, `paged_grid`), shared by the kernel and the inspector's tile report
(`tilellm.inspect.tiles`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tilellm.kernels.config import (
    GLUON_QUERY_TILE,
    cdiv,
    decode_fp8_uses_gluon,
    fp8_verify_uses_gluon,
    paged_config,
    paged_uses_gluon,
)
from tilellm.kernels.config import num_sms as device_num_sms

MIN_KEYS_PER_SPLIT = 1024  # shorter segments cost more in per-program work than they spread (E1D)
# No split below this many keys in the batch's longest context (two segments of the minimum).
MIN_CONTEXT_TO_SPLIT = 2 * MIN_KEYS_PER_SPLIT
MAX_SPLITS = 64
# Decode tiles (at most DECODE_ROWS query rows) want many short programs: PROGRAMS_PER_SM per SM.
PROGRAMS_PER_SM = 16
DECODE_ROWS = 16
# Larger tiles (verification, chunks, the cascade prefix pass) do that many times the work per key
# and stream 128-key tiles: about 1.5 waves of them fill the GPU, and every extra segment costs a
# partial write and the merge. Measured on an H200: V1 (256 programs of
# 32 rows) 1 segment 4066 GB/s, 2: 3872, 5: 3704; C1 1 segment 311, 2: 254 TFLOP/s; X1's prefix
# pass 4 segments 126 us, 7: 136, 16: 205.
LARGE_TILE_PROGRAMS_PER_SM = 1.5
# No split when the unsplit programs already reach this share of the target (FlashAttention-2
# uses 0.8 too): D1's 2048 decode programs against a target of 2112 ran 4319 GB/s unsplit and
# 4142 in 2 segments.
FILL_SHARE = 0.8
# Small batches (fewer decode programs than SMs: batch 1-16 of Qwen3's 8 KV heads) are bound by
# each program's walk over its keys, not by bandwidth: they split short contexts too, into
# segments of at least SMALL_BATCH_MIN_KEYS keys, at most SMALL_BATCH_MAX_SPLITS of them, and
# about SMALL_BATCH_PROGRAMS_PER_SM programs per SM in all (the merge grows with the programs).
# Measured on an H200 in a CUDA graph (us, decode, 8 KV heads, by segment count 1/2/4/8/16):
# batch 1, 640 keys 20.0/14.6/11.2/9.5/9.8, 2048 keys 55.8/34.7/20.7/14.1/12.7; batch 8,
# 640 keys 23.6/17.6/15.2/15.1/18.7, 2048 keys 64.3/41.5/29.7/28.6/31.8.
SMALL_BATCH_MIN_KEYS = 64
SMALL_BATCH_MAX_SPLITS = 16
SMALL_BATCH_PROGRAMS_PER_SM = 4
# The rule above takes decode batches of fewer than SMALL_BATCH_SPLIT_BELOW programs per SM (over an
# FP8 cache: fewer than one, where its tiles were measured). Unsplit, the batches just past one
# program per SM walk their keys one tile after the other at one or two programs per SM: on an
# H100 a step at batch 32 over 130-190 keys spent 524 us of its 1.66 ms in the paged kernel
# (18.7 us a call) against 241 us at batch 8, which splits (docs/benchmarks.md, "PDL beside
# cuBLAS"). Splitting them does not help: on an H100 at batch 32 and 64 over 192 and 512 keys
# every split count (2-8) was slower than one segment, 9-31% at 2-4 segments
# (`benchmarks/decode_splits.py`; docs/benchmarks.md, "Split-KV segments at batch 16-64"), so the
# bound stays one program per SM (2 would put batch 17-32 in 3-4 segments).
SMALL_BATCH_SPLIT_BELOW = 1
# Tiles over an FP8 cache (half the bytes a key: decode, and verification of a few new tokens):
# up to SMALL_BATCH_MAX_SPLITS_FP8 segments, a power of two of them (segments of whole key tiles,
# no short last one). Measured on an H100 in CUDA graphs, GB/s of FP8 bytes by segment count:
# decode (32 query heads over 8; `decode_fp8.py`'s kernel, and paged.py's FP8 tiles), 1 x 8192
# keys 16: 774 / 654, 32: 1007 / 934; 2 x 16384 16: 1505 / 1420, 32: 1710 / 1755; 4 x 8192
# 16: 1699 / 1739, 32: 1649 / 1657; 8 x 4096 8: 1814 / 1823, 9: 1710 / 1718, 16: 1644 / 1659;
# 1 x 2048 16: 370 / 316, 32: 388 / 364. Verification (4 new tokens x 2 heads a request, paged.py's
# FP8 tiles): 1 x 8192 16: 617, 32: 896; 8 x 4096 8: 1792, 9: 1608, 16: 1553.
SMALL_BATCH_MAX_SPLITS_FP8 = 32
# Decode tiles over an FP8 cache (`_plan_fp8`): half the bytes per key, so a segment of
# FP8_KEYS_PER_SPLIT keys streams what MIN_KEYS_PER_SPLIT 16-bit keys do; segments are halved
# (down to MIN_KEYS_PER_SPLIT keys, at most FP8_MAX_SPLITS of them) while the programs are fewer
# than FILL_SHARE of FP8_PROGRAMS_PER_SM per SM. Measured on an H200 in CUDA graphs, GB/s of FP8
# bytes by forced segment count: 8 x 32k keys 8: 3146, 16: 3499, 32: 3363, 64: 3108; 1 x 128k
# 32: 1639, 64: 2887, 96: 2747, 128: 3096; 64 unequal contexts up to 16k 4: 2591, 5: 2818,
# 8: 3005, 16: 3043, 32: 2716. The 16-bit rule picked 32, 64 and 5 there.
FP8_KEYS_PER_SPLIT = 2 * MIN_KEYS_PER_SPLIT
FP8_PROGRAMS_PER_SM = 8
FP8_MAX_SPLITS = 128
# Verification in decode_fp8.py (`_plan_fp8`'s `one_wave`) keeps its programs within one wave
# of FP8_PROGRAMS_PER_SM per SM. Measured on an H100 (132 SMs, target 1056) in CUDA graphs, GB/s of
# FP8 bytes, V1-G2 (256 programs of 8 rows, 8192 keys) by segment count: 2: 2506, 3: 2581,
# 4: 2550, 5 (1280 programs, the decode rule's): 2041, 6: 2101, 8: 2389; on an H200 2: 2741,
# 4: 3460, 8: 3174.


@dataclass(frozen=True)
class SplitPlan:
    """Into how many key segments each (request, KV head, query tile) program is cut, and why.

    Each program's causal key range is divided into `num_splits` equal segments (multiples of
    the key tile, at least `min_keys_per_split` keys); a segment with no key for a row records an
    empty partial result (lse = -inf).
    """

    num_splits: int
    reason: str
    num_sms: int
    base_programs: int  # programs without splitting: requests x KV heads x query tiles
    kv_len_per_split: int  # keys per segment of the longest context
    # A chosen plan never cuts segments shorter than this: a shorter request gets fewer
    # (non-empty) segments, the others record empty partials. 0 for a forced count.
    min_keys_per_split: int = 0
    kv_fp8: bool = False  # planned by the FP8 cache's rule (`_plan_fp8`)


def as_list(x: torch.Tensor | Sequence[int]) -> list[int]:
    """Lengths given as a tensor (any device) or a sequence, as Python ints."""
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.detach().cpu().tolist()]
    return [int(v) for v in x]


def programs_per_sm(rows_per_program: int = DECODE_ROWS) -> float:
    """How many programs of `rows_per_program` query rows the split rule wants per SM."""
    return PROGRAMS_PER_SM if rows_per_program <= DECODE_ROWS else LARGE_TILE_PROGRAMS_PER_SM


def target_programs(rows_per_program: int, num_sms: int) -> int:
    """Programs that fill `num_sms` SMs with tiles of `rows_per_program` rows (see programs_per_sm)."""
    return math.ceil(programs_per_sm(rows_per_program) * num_sms)


def choose_num_splits(
    num_requests: int,
    num_kv_heads: int,
    q_tiles: int,
    seq_lens: torch.Tensor | Sequence[int] | None,
    *,
    num_splits: int | None = None,
    max_seqlen_k: int | None = None,
    num_sms: int | None = None,
    rows_per_program: int = DECODE_ROWS,
    kv_fp8: bool = False,
    one_wave: bool = False,
) -> SplitPlan:
    """The split-KV decision from the SM count, the batch and its longest context.

    No split when contexts are short or the programs already reach FILL_SHARE of
    `target_programs` (PROGRAMS_PER_SM decode tiles per SM, LARGE_TILE_PROGRAMS_PER_SM of larger
    ones); otherwise enough segments for the target, each of at least MIN_KEYS_PER_SPLIT keys of
    the longest context, at most MAX_SPLITS. Decode batches of fewer programs than
    SMALL_BATCH_SPLIT_BELOW per SM (over an FP8 cache: one) also split short contexts
    (`_plan_small_batch`); tiles of at most DECODE_ROWS rows over an FP8 cache (`kv_fp8`:
    decode, and verification of a few tokens at small GQA groups) follow
    `_plan_fp8` instead of the bandwidth rule (`one_wave`: within one wave of its target, for
    verification programs), and their small batches split further (SMALL_BATCH_MAX_SPLITS_FP8).
    `num_splits` forces the count. The longest
    context comes from `seq_lens` unless `max_seqlen_k` is given (reading a CUDA tensor costs one
    host sync: the engine plans on the host instead and passes the plan).
    """
    sms = num_sms or device_num_sms()
    base = num_requests * num_kv_heads * q_tiles
    if num_splits is not None:
        if int(num_splits) < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        n = int(num_splits)
        # A forced count never reads seq_lens: no host sync (CUDA-graph capture is legal).
        known = max_seqlen_k if max_seqlen_k is not None else _host_max(seq_lens, allow_device=False)
        return SplitPlan(n, f"forced: num_splits={n}", sms, base, cdiv(known, n) if known else 0)
    if max_seqlen_k is None:
        max_seqlen_k = _host_max(seq_lens, allow_device=True)
    if kv_fp8 and rows_per_program <= DECODE_ROWS:
        plan = _plan_fp8(base, max_seqlen_k, sms, one_wave)
    else:
        plan = _plan_large(base, max_seqlen_k, sms, rows_per_program)
    small_below = sms if kv_fp8 else SMALL_BATCH_SPLIT_BELOW * sms
    if rows_per_program <= DECODE_ROWS and 0 < base < small_below:
        return _plan_small_batch(plan, max_seqlen_k)
    return plan


def _plan_small_batch(plan: SplitPlan, max_seqlen_k: int) -> SplitPlan:
    """A decode batch of few programs (see SMALL_BATCH_MIN_KEYS): at least the
    bandwidth rule's segments, but as short as SMALL_BATCH_MIN_KEYS keys; over an FP8 cache
    (`plan.kv_fp8`): a power of two of them, up to SMALL_BATCH_MAX_SPLITS_FP8."""
    base, sms, fp8 = plan.base_programs, plan.num_sms, plan.kv_fp8
    cap = SMALL_BATCH_MAX_SPLITS_FP8 if fp8 else SMALL_BATCH_MAX_SPLITS
    n_small = min(cap, cdiv(SMALL_BATCH_PROGRAMS_PER_SM * sms, base), max_seqlen_k // SMALL_BATCH_MIN_KEYS)
    if fp8 and n_small > 1:
        n_small = 1 << (n_small.bit_length() - 1)  # a power of two, rounded down
    n = max(plan.num_splits, n_small)
    if n < 2:
        return plan
    reason = (
        f"split {n}: a small batch, {base} programs for {sms} SMs; segments of >= {SMALL_BATCH_MIN_KEYS} "
        f"keys ({n_small} for about {SMALL_BATCH_PROGRAMS_PER_SM} programs per SM, at most {cap}"
        f"{', a power of two' if fp8 else ''}; the {'FP8' if fp8 else 'bandwidth'} rule's "
        f"{plan.num_splits})"
    )
    return SplitPlan(n, reason, sms, base, cdiv(max_seqlen_k, n), SMALL_BATCH_MIN_KEYS, plan.kv_fp8)


def _plan_large(base: int, max_seqlen_k: int, sms: int, rows_per_program: int) -> SplitPlan:
    """The bandwidth rule: split long contexts until the programs fill the GPU."""
    if max_seqlen_k < MIN_CONTEXT_TO_SPLIT:
        return SplitPlan(
            1,
            f"no split: longest context {max_seqlen_k} < {MIN_CONTEXT_TO_SPLIT} keys",
            sms,
            base,
            max_seqlen_k,
        )
    per_sm = programs_per_sm(rows_per_program)
    target = target_programs(rows_per_program, sms)
    if base >= FILL_SHARE * target:
        return SplitPlan(
            1,
            f"no split: {base} programs reach {FILL_SHARE:.0%} of the {target} that fill {sms} SMs",
            sms,
            base,
            max_seqlen_k,
        )
    want = cdiv(target, base)
    n = max(1, min(want, MAX_SPLITS, max_seqlen_k // MIN_KEYS_PER_SPLIT))
    # n >= 2 here: base < FILL_SHARE * target makes want >= 2, and the context holds >= 2 segments.
    reason = (
        f"split {n}: {base} programs for {sms} SMs; {n} segments per query tile give {base * n} programs "
        f"(target {per_sm} per SM, >= {MIN_KEYS_PER_SPLIT} keys per segment of the longest context, "
        f"cap {MAX_SPLITS})"
    )
    return SplitPlan(n, reason, sms, base, cdiv(max_seqlen_k, n), MIN_KEYS_PER_SPLIT)


def _plan_fp8(base: int, max_seqlen_k: int, sms: int, one_wave: bool = False) -> SplitPlan:
    """The rule for decode tiles over an FP8 cache (see FP8_KEYS_PER_SPLIT): segments of
    FP8_KEYS_PER_SPLIT keys of the longest context, halved while the programs are few;
    `one_wave` (verification in `decode_fp8.py`): then fewer segments, if needed, so that the
    programs stay within the target (measured: the note above FP8_MAX_SPLITS)."""
    target = FP8_PROGRAMS_PER_SM * sms
    if base >= FILL_SHARE * target:
        reason = f"no split: {base} programs reach {FILL_SHARE:.0%} of the {target} that fill {sms} SMs (FP8)"
        return SplitPlan(1, reason, sms, base, max_seqlen_k, kv_fp8=True)
    n = max(1, min(cdiv(max_seqlen_k, FP8_KEYS_PER_SPLIT), FP8_MAX_SPLITS))
    while base * n < FILL_SHARE * target and 2 * n <= min(FP8_MAX_SPLITS, max_seqlen_k // MIN_KEYS_PER_SPLIT):
        n *= 2
    wave = ""
    if one_wave and base * n > target:
        n, wave = max(1, target // base), f", at most {target} (one wave)"
    if n < 2:  # (a context of 2048 keys or more always splits here: the loop halves it to 1024s)
        reason = (
            f"no split: longest context {max_seqlen_k} < {MIN_CONTEXT_TO_SPLIT} keys (FP8)"
            if not wave
            else f"no split: {base} programs, {target} fill {sms} SMs in one wave (FP8)"
        )
        return SplitPlan(1, reason, sms, base, max_seqlen_k, kv_fp8=True)
    reason = (
        f"split {n}: {base} programs for {sms} SMs, FP8 cache; segments of <= {FP8_KEYS_PER_SPLIT} keys of the "
        f"longest context, halved while under {FILL_SHARE:.0%} of {FP8_PROGRAMS_PER_SM} programs per SM "
        f"(>= {MIN_KEYS_PER_SPLIT} keys, cap {FP8_MAX_SPLITS}{wave}): {base * n} programs"
    )
    return SplitPlan(n, reason, sms, base, cdiv(max_seqlen_k, n), MIN_KEYS_PER_SPLIT, kv_fp8=True)


def query_tiles_first(q_tiles: int) -> bool:
    """Launch order of `paged_attention`: with several query tiles per request the tiles (x
    splits) run fastest, so a request's tiles run side by side and share its K/V in L2 (C1:
    +2.5-19% over KV heads fastest on an H200)."""
    return q_tiles > 1


def paged_grid(num_kv_heads: int, batch: int, q_tiles: int, num_splits: int, tiles_first: bool):
    """(query tiles x splits, KV heads, requests) if `tiles_first`, else (KV heads, requests,
    query tiles x splits)."""
    if tiles_first:
        return (q_tiles * num_splits, num_kv_heads, batch)
    return (num_kv_heads, batch, q_tiles * num_splits)


def decode_fp8_grid(num_kv_heads: int, batch: int, col_groups: int, num_splits: int) -> tuple[int, int, int]:
    """`decode_fp8.py`'s grid: (KV heads x column groups, requests, splits). A request's column
    groups are neighbours in launch order, so that the later ones find its keys in L2."""
    return (num_kv_heads * col_groups, batch, num_splits)


def split_segment(num_keys: int, num_splits: int, block_n: int, min_keys: int) -> int:
    """Keys per segment of a program's key range (the kernel computes the same): equal parts in
    whole key tiles, but at least `min_keys` (rounded up to whole tiles)."""
    seg = cdiv(cdiv(num_keys, num_splits), block_n) * block_n
    return max(seg, cdiv(min_keys, block_n) * block_n)


def _host_max(seq_lens: torch.Tensor | Sequence[int] | None, *, allow_device: bool) -> int:
    """Longest context; reads a CUDA tensor (a host sync) only when `allow_device`, else 0."""
    if seq_lens is None or len(seq_lens) == 0:
        return 0
    if isinstance(seq_lens, torch.Tensor):
        if seq_lens.device.type != "cpu" and not allow_device:
            return 0
        return int(seq_lens.max().item())
    return max(seq_lens)


def plan_split_kv(
    cu_seqlens_q: torch.Tensor | Sequence[int],
    seq_lens: torch.Tensor | Sequence[int],
    num_q_heads: int,
    num_kv_heads: int,
    *,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    num_splits: int | None = None,
    num_sms: int | None = None,
    block_size: int = 16,
) -> SplitPlan:
    """The split-KV plan `paged_attention` would use for this batch (`plan_paged`'s; on Hopper,
    for the batches that `hopper.py` serves, its no-split plan)."""
    cu = as_list(cu_seqlens_q)
    lens = as_list(seq_lens)
    q_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    plan = plan_paged(
        len(lens), num_q_heads, num_kv_heads, head_dim, dtype, block_size, max(q_lens, default=1),
        num_tokens=sum(q_lens), seq_lens=lens, num_splits=num_splits, num_sms=num_sms,
    )  # fmt: skip
    return plan.split


def hopper_plan(
    num_requests: int, num_q_heads: int, q_tiles: int, seq_lens, num_sms: int | None = None
) -> SplitPlan:
    """The (trivial) split plan of `hopper.py`'s paged kernel: it never splits, and is chosen
    only for batches whose programs fill a wave (`config.paged_uses_gluon`)."""
    longest = _host_max(seq_lens, allow_device=True)
    base = num_requests * num_q_heads * q_tiles
    reason = f"no split: the Hopper kernel (hopper.py), {base} programs of one query head's 128 tokens"
    return SplitPlan(1, reason, num_sms or device_num_sms(), base, longest)


@dataclass(frozen=True)
class PagedPlan:
    """How `paged_attention` / `decode_attention` run one batch: the kernel and its split plan.

    kernel: "triton" (`paged.py`, every GPU and the interpreter), "gluon" (`hopper.py`, prompt
    chunks on an H100/H200) or "gluon-decode-fp8" (`decode_fp8.py`, over an FP8 cache on an
    H100/H200: decode, and, opted in, verification of a few new tokens a request). Made on the host from
    what the host knows (no device read when `max_seqlen_k` is given), once per step by the
    engine's attention backend and reused by every layer and by CUDA-graph capture; the kernels
    make the same plan themselves when given none.
    """

    kernel: str
    split: SplitPlan
    # `paged.py`'s launch order: query tiles fastest (True) or KV heads fastest (False); None
    # follows `query_tiles_first` (benchmarks and tests force one).
    tiles_first: bool | None = None

    @property
    def num_splits(self) -> int:
        return self.split.num_splits


def plan_paged(
    num_requests: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    page: int,
    max_seqlen_q: int,
    *,
    num_tokens: int | None = None,
    seq_lens: torch.Tensor | Sequence[int] | None = None,
    max_seqlen_k: int | None = None,
    num_splits: int | None = None,
    num_sms: int | None = None,
    is_decode: bool = False,
    allow_gluon: bool = True,
    kv_fp8: bool = False,
) -> PagedPlan:
    """The one place that picks the paged kernel of a batch, and its split-KV plan.

    `hopper.py` runs a batch when `allow_gluon`, no split count is forced, it is not a decode
    batch, and `config.paged_uses_gluon` takes it (Hopper, D = 128, half precision, pages that
    tile 128 keys, prompt chunks wide enough for a wave; see there); it never splits. Otherwise
    `paged.py` with `choose_num_splits`'s plan for its tiles (`kv_fp8`: the cache holds FP8
    pages, which take their own tiles and split rule and never `hopper.py`). Decode batches over
    an FP8 cache run `decode_fp8.py` where `config.decode_fp8_uses_gluon` takes them (when
    `allow_gluon`), with the same split plan: its key tiles are as wide as `paged.py`'s; so do
    verification batches over an FP8 cache where `config.fp8_verify_uses_gluon` takes them
    (opt-in), split by the FP8 rule over its programs (`fp8_query_columns`) within one wave.
    """
    max_q = max(max_seqlen_q, 1)
    if (
        allow_gluon
        and not kv_fp8
        and num_splits is None
        and not is_decode
        and gluon_serves(num_requests, num_q_heads, head_dim, dtype, page, max_q, num_tokens, num_sms)
    ):
        longest = max_seqlen_k if max_seqlen_k is not None else _host_max(seq_lens, allow_device=True)
        gluon_tiles = cdiv(max_q, GLUON_QUERY_TILE)
        return PagedPlan("gluon", hopper_plan(num_requests, num_q_heads, gluon_tiles, [longest], num_sms))
    group = num_q_heads // num_kv_heads
    if allow_gluon and kv_fp8 and not is_decode and fp8_verify_uses_gluon(head_dim, dtype, group, max_q):
        # Verification of a few tokens over an FP8 cache (opt-in): decode_fp8.py's programs, each
        # of up to 16 query rows (new tokens x the group's heads), split by the FP8 decode rule
        # within one wave (`one_wave`).
        split = choose_num_splits(
            num_requests, num_kv_heads, fp8_query_columns(max_q, group)[1], seq_lens,
            num_splits=num_splits, max_seqlen_k=max_seqlen_k, num_sms=num_sms, rows_per_program=DECODE_ROWS,
            kv_fp8=True, one_wave=True,
        )  # fmt: skip
        return PagedPlan("gluon-decode-fp8", split)
    cfg, block_q = paged_config(head_dim, dtype, group, 1 if is_decode else max_q, kv_fp8=kv_fp8)
    split = choose_num_splits(
        num_requests,
        num_kv_heads,
        1 if is_decode else cdiv(max_q, block_q),
        seq_lens,
        num_splits=num_splits,
        max_seqlen_k=max_seqlen_k,
        num_sms=num_sms,
        rows_per_program=cfg.block_m,
        kv_fp8=kv_fp8,
    )
    if allow_gluon and kv_fp8 and is_decode and decode_fp8_uses_gluon(head_dim, dtype, group):
        return PagedPlan("gluon-decode-fp8", split)
    return PagedPlan("triton", split)


def fp8_query_columns(max_seqlen_q: int, group: int) -> tuple[int, int]:
    """`decode_fp8.py`'s programs for a request's max_seqlen_q x group query rows: (COLS, column
    groups), COLS = 8 MMA columns a program, or 16 for more than 8 rows."""
    rows = max(max_seqlen_q, 1) * group
    cols = 8 if rows <= 8 else 16
    return cols, cdiv(rows, cols)


def gluon_serves(
    num_requests: int,
    num_q_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    page: int,
    max_seqlen_q: int,
    num_tokens: int | None = None,
    num_sms: int | None = None,
) -> bool:
    """Whether `hopper.py` takes a paged batch of this shape (`config.paged_uses_gluon` on its
    programs: query tiles of 128 tokens x query heads x requests)."""
    programs = cdiv(max(max_seqlen_q, 1), GLUON_QUERY_TILE) * num_q_heads * num_requests
    return paged_uses_gluon(
        head_dim, dtype, page, max_seqlen_q, programs, num_tokens=num_tokens, num_requests=num_requests,
        num_sms_=num_sms,
    )  # fmt: skip
