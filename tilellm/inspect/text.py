"""Compact terminal rendering of an `Inspection` (what `tilellm inspect` prints by default)."""

from __future__ import annotations

from tilellm.inspect import words
from tilellm.inspect.geometry import downsample, segment_text, tile_runs, visible_fraction
from tilellm.inspect.model import Inspection, RequestView

MATRIX_COLS = 48  # characters per request row in the attention sketch
MATRIX_ROWS = 6
MAX_REQUESTS = 12  # per-request sections list this many, then say how many more
TILE_CHARS = {"full": "F", "diagonal": "D", "skipped": "."}
STATE_CHARS = {"shared": "S", "used": "U", "cached": "C", "free": "."}


def render_text(
    insp: Inspection,
    *,
    width: int = MATRIX_COLS,
    max_rows: int = MATRIX_ROWS,
    max_requests: int = MAX_REQUESTS,
) -> str:
    """A few screens of plain text: requests, attention sketch, launch grid and tiles, page map.

    Per-request sections show the first `max_requests` requests (the HTML page shows all).
    """
    shown = insp.requests[:max_requests]
    more = len(insp.requests) - len(shown)
    out: list[str] = []
    out += _header(insp)
    out += _requests(shown, more)
    out += _matrix(shown, more, width, max_rows)
    out += _grid(insp)
    out += _tiles(insp, shown, more)
    out += _pages(insp, shown, more)
    return "\n".join(out) + "\n"


def _more(more: int) -> list[str]:
    return [f"  ... {more} more requests (the HTML page, --html FILE, shows all)"] if more > 0 else []


def _header(insp: Inspection) -> list[str]:
    s = insp.schedule
    lines = [
        f"tilellm inspect: {insp.title} ({insp.source})",
        f"  {len(insp.requests)} requests, {insp.num_tokens} new tokens; heads {insp.num_q_heads}/"
        f"{insp.num_kv_heads} (q/kv), head_dim {insp.head_dim}, block_size {insp.block_size}, {insp.dtype}",
        f"  kernel {s.kernel}: grid {s.grid}, tile {s.block_m} rows x {s.block_n} keys"
        + (f", {s.block_q} tokens per query tile" if s.block_q is not None else ""),
    ]
    lines += [f"  note: {n}" for n in insp.notes]
    return lines + [""]


def _requests(shown: tuple[RequestView, ...], more: int) -> list[str]:
    lines = ["requests", "    #  id          kind      q_len   kv_len  context  cached  blocks"]
    for r in shown:
        lines.append(
            f"  {r.index:3d}  {r.request_id[:10]:10s}  {r.kind:8s} {r.q_len:6d} {r.seq_len:8d} "
            f"{r.context_len:8d} {r.num_cached_tokens:7d} {len(r.block_table):7d}"
        )
    return lines + _more(more) + [""]


def _sketch(req: RequestView, width: int, max_rows: int) -> list[str]:
    """`width` characters for `req.seq_len` keys, at most `max_rows` lines for its new tokens."""
    rows = downsample(req.q_len, max_rows)
    cols = downsample(req.seq_len, width)
    lines = []
    for r0, r1 in rows:
        chars = []
        for c0, c1 in cols:
            f = visible_fraction(req, r0, r1, c0, c1)
            chars.append("#" if f >= 0.999 else ("+" if f > 0 else "."))
        lines.append("".join(chars))
    return lines


def _matrix(shown: tuple[RequestView, ...], more: int, width: int, max_rows: int) -> list[str]:
    longest = max(r.seq_len for r in shown)
    lines = [
        f"attention matrix, one block per request (columns: keys, about {max(1, round(longest / width))} "
        f"per character for every request; rows: new tokens, at most {max_rows} lines; "
        "# attended, + partly, . masked)"
    ]
    for r in shown:
        # One key scale for all requests: a request half as long is half as wide.
        sketch = _sketch(r, max(1, round(width * r.seq_len / longest)), max_rows)
        label = f"  req {r.index} ({r.q_len}x{r.seq_len})"
        for i, line in enumerate(sketch):
            lines.append(f"{label if i == 0 else '':24s}|{line}|")
    return lines + _more(more) + [""]


def _grid(insp: Inspection) -> list[str]:
    s = insp.schedule
    if s.persistent:
        first = (
            f"tiles {s.grid} = {len(s.programs)}, each one query tile of one request on one "
            f"{insp.schedule_head}, {words.PERSISTENT_PROGRAMS}"
        )
    else:
        first = (
            f"launch grid {s.grid} = {len(s.programs)} programs, each one query tile of one request on "
            f"one {insp.schedule_head}"
        )
    lines = [first, f"  {words.idle_programs(insp)}"]
    if s.split_plan is not None:
        p = s.split_plan
        lines.append(f"  split-KV: {p.num_splits} segment(s) per query tile: {segment_text(p)}")
    else:
        lines.append("  split-KV: not used")
    lines.append(f"    {words.split_plan(insp)}")
    return lines + [""]


def _tiles(insp: Inspection, shown: tuple[RequestView, ...], more: int) -> list[str]:
    s = insp.schedule
    lines = [
        f"key tiles per class (all heads): full={s.num_full} "
        f"diagonal={s.num_diagonal} skipped={s.num_skipped}",
        "   req     full  diagonal  skipped   (head 0 programs: F full, D diagonal/masked, . skipped)",
    ]
    for r in shown:
        c = insp.tile_counts(request=r.index)
        lines.append(f"  {r.index:4d} {c['full']:8d} {c['diagonal']:9d} {c['skipped']:8d}")
        runs = tile_runs(insp, r, head=0)
        programs: dict[tuple[int, int], list] = {}
        for run in runs:
            programs.setdefault((run.program.q_tile, run.program.split), []).append(run)
        shown = 0
        for (q_tile, split), prog_runs in programs.items():
            if shown == 4:
                lines.append(f"        ... {len(programs) - shown} more programs")
                break
            total = sum(run.count for run in prog_runs)
            if total <= 64:
                bar = "".join(TILE_CHARS[run.tile_class] * run.count for run in sorted(prog_runs, key=_first))
            else:
                bar = " ".join(
                    f"{TILE_CHARS[run.tile_class]}x{run.count}" for run in sorted(prog_runs, key=_first)
                )
            lines.append(f"        q_tile {q_tile:3d} split {split:2d}  {bar}")
            shown += 1
    return lines + _more(more) + [""]


def _first(run) -> int:
    return run.first_tile


def _pages(insp: Inspection, shown: tuple[RequestView, ...], more: int) -> list[str]:
    pool = insp.pool
    counts = {k: pool.count(k) for k in STATE_CHARS}
    lines = [
        f"page map: pool of {pool.num_blocks} blocks x {pool.block_size} tokens: "
        + ", ".join(f"{v} {k}" for k, v in counts.items()),
        "  block tables (logical -> physical; * = shared through the prefix cache)",
    ]
    for r in shown:
        cells = [f"{b}{'*' if pool.blocks[b].ref_count > 1 else ''}" for b in r.block_table]
        if len(cells) > 24:
            cells = cells[:20] + [f"... ({len(cells) - 22} more)"] + cells[-2:]
        lines.append(f"  req {r.index:3d}: [{' '.join(cells)}]")
    lines += _more(more)
    lines.append("  pool (S shared, U used, C cached, . free):")
    chars = "".join(STATE_CHARS[b.state] for b in pool.blocks)
    for i in range(0, len(chars), 64):
        if i >= 64 * 8:
            lines.append(f"    ... {len(chars) - i} more blocks")
            break
        lines.append(f"    {i:6d} {chars[i : i + 64]}")
    return lines
