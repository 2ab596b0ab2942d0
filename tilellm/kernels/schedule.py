"""What the attention kernels will do for a batch: launch grid, tiles per program, split-KV plan.

No engine we know of shows its tile schedule; tilellm does, so that people can see why a batch
runs the way it does (`tilellm inspect`) and tests can check the kernels' promises (no future
tile is ever visited). The arithmetic here mirrors the kernels' loop bounds, and the kernels can
record their own counts (`prefill_tile_stats`, `paged_tile_stats`) to check it against.

Tile classes, per program (one query tile of one request, one head or KV-head group):
  full      key tile wholly visible to every query row: computed without any mask
  diagonal  key tile crossing the causal diagonal (or the request's end): masked in registers
  skipped   key tile wholly in the future: never loaded
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tilellm.kernels.config import (
    GLUON_KEY_TILE,
    GLUON_QUERY_TILE,
    paged_config,
    paged_uses_gluon,
    prefill_config,
)
from tilellm.kernels.config import num_sms as device_num_sms

MIN_KEYS_PER_SPLIT = 1024  # shorter segments cost more in per-program work than they spread (E1D, RESULTS.md)
# No split below this many keys in the batch's longest context (two segments of the minimum).
MIN_CONTEXT_TO_SPLIT = 2 * MIN_KEYS_PER_SPLIT
MAX_SPLITS = 64
# Decode tiles (at most DECODE_ROWS query rows) want many short programs: PROGRAMS_PER_SM per SM.
PROGRAMS_PER_SM = 16
DECODE_ROWS = 16
# Larger tiles (verification, chunks, the cascade prefix pass) do that many times the work per key
# and stream 128-key tiles: about 1.5 waves of them fill the GPU, and every extra segment costs a
# partial write and the merge. Measured on an H200 (RESULTS.md, fourth session): V1 (256 programs of
# 32 rows) 1 segment 4066 GB/s, 2: 3872, 5: 3704; C1 1 segment 311, 2: 254 TFLOP/s; X1's prefix
# pass 4 segments 126 us, 7: 136, 16: 205.
LARGE_TILE_PROGRAMS_PER_SM = 1.5
# No split when the unsplit programs already reach this share of the target (FlashAttention-2
# uses 0.8 too): D1's 2048 decode programs against a target of 2112 ran 4319 GB/s unsplit and
# 4142 in 2 segments (fourth session).
FILL_SHARE = 0.8


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


@dataclass(frozen=True)
class ProgramTiles:
    request: int
    head: int  # query head (prefill) or KV head (paged: the whole group of query heads)
    q_tile: int
    split: int
    full: int
    diagonal: int
    skipped: int
    first_kv_tile: int  # -1 when the program visits nothing
    last_kv_tile: int


@dataclass
class TileSchedule:
    kernel: str
    grid: tuple[int, ...]
    block_m: int  # query rows per program
    block_n: int  # keys per tile
    programs: list[ProgramTiles] = field(default_factory=list)
    split_plan: SplitPlan | None = None
    block_q: int | None = None  # paged: tokens per query tile (rows = tokens x group)

    @property
    def num_full(self) -> int:
        return sum(p.full for p in self.programs)

    @property
    def num_diagonal(self) -> int:
        return sum(p.diagonal for p in self.programs)

    @property
    def num_skipped(self) -> int:
        return sum(p.skipped for p in self.programs)

    @property
    def num_empty_programs(self) -> int:
        """Programs that exit at once (their query tile is past the request's end)."""
        return sum(1 for p in self.programs if p.first_kv_tile < 0 and p.full + p.diagonal == 0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _as_list(x: torch.Tensor | Sequence[int]) -> list[int]:
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
) -> SplitPlan:
    """The split-KV decision from the SM count, the batch and its longest context.

    No split when contexts are short or the programs already reach FILL_SHARE of
    `target_programs` (PROGRAMS_PER_SM decode tiles per SM, LARGE_TILE_PROGRAMS_PER_SM of larger
    ones); otherwise enough segments for the target, each of at least MIN_KEYS_PER_SPLIT keys of
    the longest context, at most MAX_SPLITS. `num_splits` forces the count. The longest
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
        return SplitPlan(n, f"forced: num_splits={n}", sms, base, _cdiv(known, n) if known else 0)
    if max_seqlen_k is None:
        max_seqlen_k = _host_max(seq_lens, allow_device=True)
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
    want = _cdiv(target, base)
    n = max(1, min(want, MAX_SPLITS, max_seqlen_k // MIN_KEYS_PER_SPLIT))
    # n >= 2 here: base < FILL_SHARE * target makes want >= 2, and the context holds >= 2 segments.
    reason = (
        f"split {n}: {base} programs for {sms} SMs; {n} segments per query tile give {base * n} programs "
        f"(target {per_sm} per SM, >= {MIN_KEYS_PER_SPLIT} keys per segment of the longest context, "
        f"cap {MAX_SPLITS})"
    )
    return SplitPlan(n, reason, sms, base, _cdiv(max_seqlen_k, n), MIN_KEYS_PER_SPLIT)


def query_tiles_first(q_tiles: int) -> bool:
    """Launch order of `paged_attention`: with several query tiles per request the tiles (x
    splits) run fastest, so a request's tiles run side by side and share its K/V in L2 (C1:
    +2.5-19% over KV heads fastest, RESULTS.md run 25)."""
    return q_tiles > 1


def paged_grid(num_kv_heads: int, batch: int, q_tiles: int, num_splits: int, tiles_first: bool):
    """(query tiles x splits, KV heads, requests) if `tiles_first`, else (KV heads, requests,
    query tiles x splits)."""
    if tiles_first:
        return (q_tiles * num_splits, num_kv_heads, batch)
    return (num_kv_heads, batch, q_tiles * num_splits)


def split_segment(num_keys: int, num_splits: int, block_n: int, min_keys: int) -> int:
    """Keys per segment of a program's key range (the kernel computes the same): equal parts in
    whole key tiles, but at least `min_keys` (rounded up to whole tiles)."""
    seg = _cdiv(_cdiv(num_keys, num_splits), block_n) * block_n
    return max(seg, _cdiv(min_keys, block_n) * block_n)


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
    """The split-KV plan `paged_attention` would use for this batch (on Hopper, for the batches
    that `hopper.py` serves, its no-split plan)."""
    cu = _as_list(cu_seqlens_q)
    lens = _as_list(seq_lens)
    q_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    max_q = max(q_lens, default=1)
    if num_splits is None and _hopper_serves(q_lens, num_q_heads, head_dim, dtype, block_size, num_sms):
        return hopper_plan(len(lens), num_q_heads, _cdiv(max(max_q, 1), GLUON_QUERY_TILE), lens, num_sms)
    cfg, block_q = paged_config(head_dim, dtype, num_q_heads // num_kv_heads, max_q)
    return choose_num_splits(
        len(lens),
        num_kv_heads,
        _cdiv(max(max_q, 1), block_q),
        lens,
        num_splits=num_splits,
        num_sms=num_sms,
        rows_per_program=cfg.block_m,
    )


def prefill_schedule(
    cu_seqlens: torch.Tensor | Sequence[int],
    max_seqlen: int,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    *,
    causal: bool = True,
) -> TileSchedule:
    """Tiles of `prefill_attention`: grid (query tiles, heads, requests), query tiles issued
    longest-first."""
    cu = _as_list(cu_seqlens)
    cfg = prefill_config(head_dim, dtype, max_seqlen)
    bm, bn = cfg.block_m, cfg.block_n
    num_m = _cdiv(max(max_seqlen, 1), bm)
    sched = TileSchedule("prefill_attention", (num_m, num_heads, len(cu) - 1), bm, bn)
    for req, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        for head in range(num_heads):
            for m_tile in range(num_m):
                sched.programs.append(
                    _query_tile(req, head, m_tile, end - start, end - start, bm, bn, causal)
                )
    return sched


def _query_tile(req, head, q_tile, q_len, seq_len, bm, bn, causal=True) -> ProgramTiles:
    """The key tiles of one program that owns `bm` new tokens of one query head (prefill, and
    `hopper.py`'s paged chunks). New token t sits at position `seq_len - q_len + t`; tiles every
    token of the program sees whole run unmasked, the rest up to its last token are masked."""
    t0 = q_tile * bm
    if t0 >= q_len:
        return ProgramTiles(req, head, q_tile, 0, 0, 0, 0, -1, -1)
    context = seq_len - q_len
    total = _cdiv(seq_len, bn)
    if causal:
        full, visited = (context + t0 + 1) // bn, _cdiv(context + min(t0 + bm, q_len), bn)
    else:
        full, visited = seq_len // bn, total
    return ProgramTiles(req, head, q_tile, 0, full, visited - full, total - visited, 0, visited - 1)


def hopper_plan(
    num_requests: int, num_q_heads: int, q_tiles: int, seq_lens, num_sms: int | None = None
) -> SplitPlan:
    """The (trivial) split plan of `hopper.py`'s paged kernel: it never splits, and is chosen
    only for batches whose programs fill a wave (`config.paged_uses_gluon`)."""
    longest = _host_max(seq_lens, allow_device=True)
    base = num_requests * num_q_heads * q_tiles
    reason = f"no split: the Hopper kernel (hopper.py), {base} programs of one query head's 128 tokens"
    return SplitPlan(1, reason, num_sms or device_num_sms(), base, longest)


def _hopper_serves(q_lens, num_q_heads, head_dim, dtype, block_size, num_sms) -> bool:
    """`paged_attention`'s choice of `hopper.py` for this batch (`config.paged_uses_gluon`)."""
    max_q = max(q_lens, default=1)
    programs = _cdiv(max(max_q, 1), GLUON_QUERY_TILE) * num_q_heads * len(q_lens)
    return paged_uses_gluon(
        head_dim, dtype, block_size, max_q, programs, num_tokens=sum(q_lens), num_requests=len(q_lens),
        num_sms_=num_sms,
    )  # fmt: skip


def _hopper_paged_schedule(q_lens, lens, num_q_heads, num_sms) -> TileSchedule:
    bm, bn = GLUON_QUERY_TILE, GLUON_KEY_TILE
    q_tiles = _cdiv(max(max(q_lens, default=1), 1), bm)
    sched = TileSchedule(
        "paged_attention (hopper.py)",
        (q_tiles, num_q_heads, len(lens)),
        bm,
        bn,
        split_plan=hopper_plan(len(lens), num_q_heads, q_tiles, lens, num_sms),
        block_q=bm,
    )
    for req, (q_len, seq_len) in enumerate(zip(q_lens, lens)):
        for head in range(num_q_heads):
            for q_tile in range(q_tiles):
                sched.programs.append(_query_tile(req, head, q_tile, q_len, seq_len, bm, bn))
    return sched


def paged_schedule(
    cu_seqlens_q: torch.Tensor | Sequence[int],
    seq_lens: torch.Tensor | Sequence[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    *,
    num_splits: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    num_sms: int | None = None,
) -> TileSchedule:
    """Tiles of `paged_attention`: grid (KV heads, requests, query tiles x splits), or
    (query tiles x splits, KV heads, requests) when there are several query tiles. On Hopper,
    batches that `hopper.py` serves (`config.paged_uses_gluon`): grid (query tiles, query
    heads, requests), programs of one query head's 128 tokens, 128-key tiles, no split.

    `skipped` (future tiles of the request) is reported on each query tile's last segment.
    """
    cu = _as_list(cu_seqlens_q)
    lens = _as_list(seq_lens)
    q_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    max_q = max(q_lens, default=1)
    group = num_q_heads // num_kv_heads
    if num_splits is None and _hopper_serves(q_lens, num_q_heads, head_dim, dtype, block_size, num_sms):
        return _hopper_paged_schedule(q_lens, lens, num_q_heads, num_sms)
    cfg, block_q = paged_config(head_dim, dtype, group, max_q)
    bn = cfg.block_n
    q_tiles = _cdiv(max(max_q, 1), block_q)
    plan = choose_num_splits(
        len(lens),
        num_kv_heads,
        q_tiles,
        lens,
        num_splits=num_splits,
        num_sms=num_sms,
        rows_per_program=cfg.block_m,
    )
    splits = plan.num_splits
    sched = TileSchedule(
        "paged_attention",
        paged_grid(num_kv_heads, len(lens), q_tiles, splits, query_tiles_first(q_tiles)),
        cfg.block_m,
        bn,
        split_plan=plan,
        block_q=block_q,
    )
    for req, (q_len, seq_len) in enumerate(zip(q_lens, lens)):
        context = seq_len - q_len
        total = _cdiv(seq_len, bn)
        for kv_head in range(num_kv_heads):
            for q_tile in range(q_tiles):
                t0 = q_tile * block_q
                for split in range(splits):
                    if t0 >= q_len:
                        sched.programs.append(ProgramTiles(req, kv_head, q_tile, split, 0, 0, 0, -1, -1))
                        continue
                    kv_end = context + min(t0 + block_q, q_len)
                    full_end = (context + t0 + 1) // bn * bn
                    if splits > 1:
                        seg = split_segment(kv_end, splits, bn, plan.min_keys_per_split)
                        lo = split * seg
                        hi = max(lo, min(lo + seg, kv_end))
                    else:
                        lo, hi = 0, kv_end
                    full_hi = max(min(full_end, hi), lo)
                    masked_lo = max(full_end, lo)
                    full = _cdiv(full_hi - lo, bn)
                    diag = _cdiv(max(hi - masked_lo, 0), bn)
                    skipped = total - _cdiv(kv_end, bn) if split == splits - 1 else 0
                    first = lo // bn if full + diag else -1
                    last = first + full + diag - 1 if full + diag else -1
                    sched.programs.append(
                        ProgramTiles(req, kv_head, q_tile, split, full, diag, skipped, first, last)
                    )
    return sched
