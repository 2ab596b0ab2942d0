"""What the attention kernels will do for a batch: launch grid, tiles per program, split-KV plan.

No engine we know of shows its tile schedule; tilellm does, so that people can see why a batch
runs the way it does (`tilellm inspect`) and tests can check the kernels' promises (no future
tile is ever visited). The arithmetic here mirrors the kernels' loop bounds, and the kernels can
record their own counts (`prefill_tile_stats`, `paged_tile_stats`) to check it against. Which
kernel runs and its split plan come from the kernels' own planner (`tilellm.kernels.schedule`).

Tile classes, per program (one query tile of one request, one head or KV-head group):
  full      key tile wholly visible to every query row: computed without any mask
  diagonal  key tile crossing the causal diagonal (or the request's end): masked in registers
  skipped   key tile wholly in the future: never loaded
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tilellm.kernels.config import GLUON_KEY_TILE, GLUON_QUERY_TILE, paged_config, prefill_config
from tilellm.kernels.schedule import (
    SplitPlan,
    as_list,
    cdiv,
    decode_fp8_grid,
    fp8_query_columns,
    hopper_plan,
    paged_grid,
    plan_paged,
    query_tiles_first,
    split_segment,
)


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
    # decode_fp8.py's verification: (COLS, GROUP), a program's MMA columns are (token, head)
    # pairs t * GROUP + h, COLS of them (`column_tokens`)
    columns: tuple[int, int] | None = None
    # hopper.py: one persistent program per SM claims these tiles in order (the grid numbers
    # them), skipping those past a request's end; otherwise one program per tile
    persistent: bool = False

    def query_tokens(self, q_tile: int, q_len: int) -> tuple[int, int]:
        """The new tokens [t0, t1) of a request of q_len that query tile (or column group)
        `q_tile` holds rows of."""
        if self.columns is not None:
            return column_tokens(q_tile, *self.columns, q_len)
        per_tile = self.block_q if self.block_q is not None else self.block_m
        return q_tile * per_tile, min((q_tile + 1) * per_tile, q_len)

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


def prefill_schedule(
    cu_seqlens: torch.Tensor | Sequence[int],
    max_seqlen: int,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    *,
    causal: bool = True,
    v_head_dim: int | None = None,
) -> TileSchedule:
    """Tiles of `prefill_attention`: grid (query tiles, heads, requests), query tiles issued
    longest-first (on Hopper, long batches run `hopper.py`: the same tiles, claimed in this order
    by one persistent program per SM). `v_head_dim`: the values' head dim where it differs (MLA's
    expanded heads)."""
    cu = as_list(cu_seqlens)
    cfg = prefill_config(head_dim, dtype, max_seqlen, v_head_dim=v_head_dim)
    bm, bn = cfg.block_m, cfg.block_n
    num_m = cdiv(max(max_seqlen, 1), bm)
    gluon = cfg.kernel == "gluon" and causal  # prefill_attention's dispatch: hopper.py
    name = "prefill_attention (hopper.py)" if gluon else "prefill_attention"
    sched = TileSchedule(name, (num_m, num_heads, len(cu) - 1), bm, bn, persistent=gluon)
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
    total = cdiv(seq_len, bn)
    if causal:
        full, visited = (context + t0 + 1) // bn, cdiv(context + min(t0 + bm, q_len), bn)
    else:
        full, visited = seq_len // bn, total
    return ProgramTiles(req, head, q_tile, 0, full, visited - full, total - visited, 0, visited - 1)


def gluon_paged_schedule(q_lens, lens, num_q_heads: int, num_sms: int | None = None) -> TileSchedule:
    """Tiles of `hopper.py`'s paged kernel: (query tiles, query heads, requests), each one query
    head's 128 tokens over 128-key tiles, no split (the kernel runs them from one persistent
    program per SM, in this order)."""
    bm, bn = GLUON_QUERY_TILE, GLUON_KEY_TILE
    q_tiles = cdiv(max(max(q_lens, default=1), 1), bm)
    sched = TileSchedule(
        "paged_attention (hopper.py)",
        (q_tiles, num_q_heads, len(lens)),
        bm,
        bn,
        split_plan=hopper_plan(len(lens), num_q_heads, q_tiles, lens, num_sms),
        block_q=bm,
        persistent=True,
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
    kv_fp8: bool = False,
) -> TileSchedule:
    """Tiles of `paged_attention`: grid (KV heads, requests, query tiles x splits), or
    (query tiles x splits, KV heads, requests) when there are several query tiles. On Hopper,
    batches that `hopper.py` serves (`plan_paged`): grid (query tiles, query
    heads, requests), programs of one query head's 128 tokens, 128-key tiles, no split.

    `skipped` (future tiles of the request) is reported on each query tile's last segment.
    `kv_fp8`: an FP8 cache (its own tiles and split rule, never `hopper.py`); a decode batch over
    it on Hopper runs `decode_fp8.py` (kernel "decode_fp8"): the same programs, segments and
    32-key tiles, the group's query heads in 8 MMA columns instead of 16 rows; so does a
    verification batch of a few tokens, its (token, head) rows in programs of 8 or 16 columns
    (`block_m`), each walking its request's keys (grid: KV heads x column groups, requests, splits).
    """
    cu = as_list(cu_seqlens_q)
    lens = as_list(seq_lens)
    q_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    max_q = max(q_lens, default=1)
    group = num_q_heads // num_kv_heads
    is_decode = bool(q_lens) and max_q == 1 and min(q_lens) == 1
    kernel_plan = plan_paged(
        len(lens), num_q_heads, num_kv_heads, head_dim, dtype, block_size, max_q,
        num_tokens=sum(q_lens), seq_lens=lens, num_splits=num_splits, num_sms=num_sms, kv_fp8=kv_fp8,
        is_decode=is_decode,
    )  # fmt: skip
    if kernel_plan.kernel == "gluon":
        return gluon_paged_schedule(q_lens, lens, num_q_heads, num_sms)
    cfg, block_q = paged_config(head_dim, dtype, group, max_q, kv_fp8=kv_fp8)
    bn = cfg.block_n
    q_tiles = cdiv(max(max_q, 1), block_q)
    plan = kernel_plan.split
    splits = plan.num_splits
    decode_fp8 = kernel_plan.kernel == "gluon-decode-fp8"
    block_m, columns = cfg.block_m, None
    if decode_fp8:
        from tilellm.kernels.decode_fp8 import BLOCK_N

        bn, block_q = BLOCK_N, None
        block_m, q_tiles = fp8_query_columns(1 if is_decode else max_q, group)
        columns = None if is_decode else (block_m, group)
        grid = decode_fp8_grid(num_kv_heads, len(lens), q_tiles, splits)
    else:
        grid = paged_grid(num_kv_heads, len(lens), q_tiles, splits, query_tiles_first(q_tiles))
    sched = TileSchedule(
        "decode_fp8" if decode_fp8 else "paged_attention",
        grid,
        block_m,
        bn,
        split_plan=plan,
        block_q=block_q,
        columns=columns,
    )
    for req, (q_len, seq_len) in enumerate(zip(q_lens, lens)):
        context = seq_len - q_len
        total = cdiv(seq_len, bn)
        for kv_head in range(num_kv_heads):
            for q_tile in range(q_tiles):
                t0, t1 = sched.query_tokens(q_tile, q_len)
                for split in range(splits):
                    if t0 >= q_len:
                        sched.programs.append(ProgramTiles(req, kv_head, q_tile, split, 0, 0, 0, -1, -1))
                        continue
                    # (decode_fp8.py's programs walk the request's keys, masking each column's own)
                    kv_end = seq_len if decode_fp8 else context + t1
                    full_end = (context + t0 + 1) // bn * bn
                    if splits > 1:
                        seg = split_segment(kv_end, splits, bn, plan.min_keys_per_split)
                        lo = split * seg
                        hi = max(lo, min(lo + seg, kv_end))
                    else:
                        lo, hi = 0, kv_end
                    sched.programs.append(
                        _segment_tiles(
                            req, kv_head, q_tile, split, splits, lo, hi, kv_end, full_end, bn, total
                        )
                    )
    return sched


def column_tokens(col_group: int, cols: int, group: int, q_len: int) -> tuple[int, int]:
    """The new tokens [t0, t1) whose rows a `decode_fp8.py` verification program holds: columns
    [col_group * cols, (col_group + 1) * cols) of the (token, head) pairs t * group + h."""
    return col_group * cols // group, min(q_len, ((col_group + 1) * cols - 1) // group + 1)


def _segment_tiles(
    req: int, head: int, q_tile: int, split: int, splits: int,
    lo: int, hi: int, kv_end: int, full_end: int, bn: int, total: int,
) -> ProgramTiles:  # fmt: skip
    """One program's key tiles over its segment [lo, hi) of the keys: unmasked below `full_end`
    (visible to every row), masked above; `skipped` (future tiles) on the last segment only."""
    full = cdiv(max(min(full_end, hi), lo) - lo, bn)
    diag = cdiv(max(hi - max(full_end, lo), 0), bn)
    skipped = total - cdiv(kv_end, bn) if split == splits - 1 else 0
    first = lo // bn if full + diag else -1
    last = first + full + diag - 1 if full + diag else -1
    return ProgramTiles(req, head, q_tile, split, full, diag, skipped, first, last)


def mla_schedule(
    cu_seqlens_q: torch.Tensor | Sequence[int],
    seq_lens: torch.Tensor | Sequence[int],
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    block_size: int,
    *,
    num_splits: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    num_sms: int | None = None,
) -> TileSchedule:
    """Tiles of `mla_paged_attention` (and `mla_decode_attention`, its one-token case): grid
    ((query tiles x splits) x head tiles x value splits, requests). A program holds up to
    `block_h` query heads x `block_q` tokens as its rows, all reading the one latent row per key;
    `head` below is the program's head tile. Split segments as the kernel cuts them."""
    from tilellm.kernels.config import num_sms as _num_sms
    from tilellm.kernels.mla import plan_mla, tile_shape

    cu = as_list(cu_seqlens_q)
    lens = as_list(seq_lens)
    q_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    max_q = max(q_lens, default=1)
    plan = plan_mla(
        len(lens), num_heads, max_q, max(lens, default=1), dtype, block_size,
        kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, num_splits=num_splits, num_sms_=num_sms,
    )  # fmt: skip
    cfg = plan.config
    heads, block_q, block_m = tile_shape(cfg, num_heads, max_q)
    bn, splits = cfg.block_n, plan.num_splits
    q_tiles = cdiv(max(max_q, 1), block_q)
    head_tiles = cdiv(num_heads, heads)
    kernel = "mla_decode_attention" if max_q == 1 else "mla_paged_attention"
    split_plan = SplitPlan(
        splits, plan.reason, num_sms or _num_sms(), plan.programs, 0, plan.min_keys_per_split
    )
    grid = (q_tiles * splits * head_tiles * cfg.value_splits, len(lens))
    sched = TileSchedule(kernel, grid, block_m, bn, split_plan=split_plan, block_q=block_q)
    for req, (q_len, seq_len) in enumerate(zip(q_lens, lens)):
        context = seq_len - q_len
        total = cdiv(seq_len, bn)
        for head_tile in range(head_tiles):
            for q_tile in range(q_tiles):
                t0 = q_tile * block_q
                for split in range(splits):
                    if t0 >= q_len:
                        sched.programs.append(ProgramTiles(req, head_tile, q_tile, split, 0, 0, 0, -1, -1))
                        continue
                    kv_end = context + min(t0 + block_q, q_len)
                    full_end = (context + t0 + 1) // bn * bn
                    if splits > 1:
                        seg = cdiv(cdiv(kv_end, splits), bn) * bn
                        seg = max(seg, cdiv(plan.min_keys_per_split, bn) * bn)
                        lo = split * seg
                        hi = max(lo, min(lo + seg, kv_end))
                    else:
                        lo, hi = 0, kv_end
                    sched.programs.append(
                        _segment_tiles(
                            req, head_tile, q_tile, split, splits, lo, hi, kv_end, full_end, bn, total
                        )
                    )
    return sched
