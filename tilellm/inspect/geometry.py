"""Geometry shared by the renderers: which keys each query sees, and where each tile lies.

Coordinates are per request: query row `r` (0..q_len-1, the r-th new token, at absolute
position `context_len + r`) and key column `c` (0..seq_len-1). Row r sees keys 0..context_len + r.
"""

from __future__ import annotations

from dataclasses import dataclass

from tilellm.inspect.model import Inspection, RequestView
from tilellm.inspect.tiles import ProgramTiles

TILE_CLASSES = ("full", "diagonal", "skipped")


def visible_fraction(req: RequestView, r0: int, r1: int, c0: int, c1: int) -> float:
    """Fraction of the (query rows r0..r1-1) x (keys c0..c1-1) cells that are attended."""
    if r1 <= r0 or c1 <= c0:
        return 0.0
    # Row r sees clamp(a + r, 0, w) of the w columns: zero, then a linear ramp, then all of them.
    a, w = req.context_len + 1 - c0, c1 - c0
    full_from = max(r0, w - a)
    ramp_lo, ramp_hi = max(r0, 1 - a), min(r1, w - a)
    seen = max(0, r1 - full_from) * w
    if ramp_hi > ramp_lo:
        n = ramp_hi - ramp_lo
        seen += n * a + (ramp_lo + ramp_hi - 1) * n // 2
    return seen / ((r1 - r0) * w)


def downsample(n: int, cells: int) -> list[tuple[int, int]]:
    """Split 0..n-1 into at most `cells` contiguous, near-equal ranges."""
    cells = max(1, min(n, cells))
    edges = [round(i * n / cells) for i in range(cells + 1)]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


@dataclass(frozen=True)
class TileRun:
    """Consecutive key tiles of one class visited (or skipped) by one program."""

    program: ProgramTiles
    tile_class: str
    first_tile: int  # key tile index
    count: int
    rows: tuple[int, int]  # query rows [r0, r1) of the program's query tile
    cols: tuple[int, int]  # key columns [c0, c1) covered by the run


def query_rows(insp: Inspection, req: RequestView, q_tile: int) -> tuple[int, int]:
    """Query rows (new tokens) of a query tile: block_m tokens (prefill), block_q tokens
    (paged), or a verification program's (token, head) columns (`TileSchedule.query_tokens`)."""
    return insp.schedule.query_tokens(q_tile, req.q_len)


def tile_runs(insp: Inspection, req: RequestView, head: int = 0) -> list[TileRun]:
    """The full / diagonal / skipped runs of every program of `req` on `head`, in launch order."""
    bn = insp.schedule.block_n
    total = -(-req.seq_len // bn)
    runs = []
    for p in insp.schedule.programs:
        if p.request != req.index or p.head != head:
            continue
        rows = query_rows(insp, req, p.q_tile)
        spans = []
        if p.first_kv_tile >= 0:
            spans.append(("full", p.first_kv_tile, p.full))
            spans.append(("diagonal", p.first_kv_tile + p.full, p.diagonal))
        spans.append(("skipped", total - p.skipped, p.skipped))
        for cls, first, count in spans:
            if count > 0:
                cols = (first * bn, min((first + count) * bn, req.seq_len))
                runs.append(TileRun(p, cls, first, count, rows, cols))
    return runs


def segment_text(plan) -> str:
    """How a split plan cuts keys: fixed-length segments, or each request into equal parts."""
    if plan.num_splits == 1:
        return "one segment per program"
    kv = getattr(plan, "kv_per_split", getattr(plan, "kv_len_per_split", 0))
    if kv > 0:
        return f"segments of {kv} keys (long requests get more of them)"
    return f"each request's keys cut into {plan.num_splits} equal parts"


def is_empty(program: ProgramTiles) -> bool:
    """A program that exits at once: its query tile or key segment is past the request's end."""
    return program.first_kv_tile < 0 and program.full + program.diagonal == 0
