"""Self-contained HTML rendering of an `Inspection`: inline CSS, SVG and a few lines of JS.

Stable hooks for tests and scripts (all on plain elements):
  #summary           data-kernel, data-num-requests, data-num-programs, data-num-empty-programs,
                     data-tiles-full / -diagonal / -skipped (all heads), data-num-splits,
                     data-num-blocks, data-blocks-shared / -used / -cached / -free
  .request-row       one per request: data-request, data-q-len, data-kv-len, data-kind
  #matrix-legend     .legend-item[data-legend] swatches, drawn with the matrix's own classes
                     (.swatch-tile[data-tile-class] for the tile classes)
  #attention-matrix  SVG at one scale for all requests: data-row-px (per new token), data-key-px;
                     g.request[data-request] holds .req-box, the attended region (.visible) and
                     .tile runs of head 0: data-tile-class="full|diagonal|skipped", data-tiles (count),
                     data-q-tile, data-split, data-first-tile
  .program           one per head-0 program of the launch grid: data-request, data-q-tile,
                     data-split, data-full, data-diagonal, data-skipped, data-empty
  .tile-counts       per request (all heads): data-request, data-full, data-diagonal, data-skipped
  #idle-programs     the sentence on programs that exit immediately
  #split-plan        data-num-splits, data-reason (the kernels' words; the text is plain)
  .table-block       a block-table entry: data-request, data-logical, data-block, data-state
  .pool-block        a physical block: data-block, data-ref-count, data-state, data-cached;
                     .pool-run stands for data-count consecutive free blocks from data-block
"""

from __future__ import annotations

import html

from tilellm.inspect import words
from tilellm.inspect.geometry import TILE_CLASSES, is_empty, query_rows, tile_runs
from tilellm.inspect.model import Inspection, RequestView

MATRIX_WIDTH = 960  # px for the longest request's keys
MIN_KEY_PX, MAX_KEY_PX = 0.25, 6.0  # px per key: longer requests scroll sideways, short ones stay small
MATRIX_HEIGHT = 560  # px shared by all new tokens of the batch
MIN_ROW_PX, MAX_ROW_PX = 2.0, 12.0  # px per new token: long prefills make the page scroll
LABEL_H, BAND_GAP, PAD_L = 18, 8, 4  # px: a request's label line, space below its band, left margin
STAIRCASE_MAX_ROWS = 512  # above this the causal edge is drawn as a straight line
POOL_RUN_MIN = 16  # free blocks in a row beyond this are drawn as one run

CSS = """
:root { --full: #2e7d32; --diagonal: #f9a825; --skipped: #9e9e9e; --visible: #90caf9;
        --shared: #7b1fa2; --used: #1565c0; --cached: #00897b; --free: #e0e0e0; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #212121; }
h1 { font-size: 20px; margin: 0 0 6px; } h2 { font-size: 16px; margin: 26px 0 8px; }
code, .mono { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; font-size: 12px; }
table { border-collapse: collapse; } td, th { padding: 2px 10px; text-align: right; }
th { border-bottom: 1px solid #bbb; } td.l, th.l { text-align: left; }
.note { color: #616161; font-size: 12px; }
.legend span { display: inline-block; margin-right: 14px; }
.sw { display: inline-block; width: 12px; height: 12px; vertical-align: -2px; margin-right: 4px;
      border-radius: 2px; }
svg.sw { width: 14px; height: 14px; border-radius: 0; background: #fafafa; outline: 0.6px solid #9e9e9e; }
svg text { font: 11px system-ui, sans-serif; fill: #424242; }
.req-box { fill: #fafafa; stroke: #9e9e9e; stroke-width: 0.6; }
.visible { fill: var(--visible); }
.tile, .swatch-tile { stroke: #fff; stroke-width: 0.5; opacity: 0.45; }
[data-tile-class="full"] { fill: var(--full); }
[data-tile-class="diagonal"] { fill: var(--diagonal); opacity: 0.55; }
[data-tile-class="skipped"] { fill: url(#hatch); opacity: 1; }
.scroll { overflow-x: auto; }
.req-label { font-size: 11px; }
.gridline { stroke: #fff; stroke-width: 0.6; opacity: 0.8; }
.split-edge { stroke: #c62828; stroke-width: 2; stroke-dasharray: 3 2; }
.cached-prefix { fill: var(--shared); }
.program { stroke: #fff; stroke-width: 1; }
.program[data-empty="1"] { fill: url(#hatch); }
.blocks { display: flex; flex-wrap: wrap; gap: 2px; margin: 2px 0 8px; }
.table-block, .pool-block, .pool-run { display: inline-block; min-width: 26px; padding: 1px 3px;
  border-radius: 3px; font: 10px/14px ui-monospace, Menlo, Consolas, monospace; text-align: center;
  color: #fff; }
[data-state="shared"] { background: var(--shared); } [data-state="used"] { background: var(--used); }
[data-state="cached"] { background: var(--cached); }
[data-state="free"] { background: var(--free); color: #757575; }
.pool-run { min-width: 60px; }
.pool-block[data-cached="1"], .table-block[data-cached="1"] { box-shadow: inset 0 -3px 0 #4db6ac; }
.dim .request, .dim .request-row, .dim .table-block, .dim .program, .dim .tile-counts { opacity: 0.25; }
.dim .hl { opacity: 1 !important; }
.rowlabel { font-size: 12px; color: #424242; margin-top: 4px; }
"""

# Patterns used by the matrix, its legend and the program map (ids are global to the page).
DEFS = (
    '<svg width="0" height="0" style="position:absolute" aria-hidden="true"><defs>'
    '<pattern id="hatch" width="5" height="5" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
    '<rect width="5" height="5" fill="#eeeeee"/><line x1="0" y1="0" x2="0" y2="5" stroke="#9e9e9e" '
    'stroke-width="2"/></pattern>'
    '<pattern id="hatch2" width="4" height="4" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
    '<rect width="4" height="4" fill="#f5f5f5"/><line x1="0" y1="0" x2="0" y2="4" stroke="#bdbdbd" '
    'stroke-width="1.5"/></pattern></defs></svg>'
)

JS = """
(function () {
  function sel(attr, v) { return document.querySelectorAll('[' + attr + '="' + v + '"]'); }
  function clear() {
    document.body.classList.remove('dim');
    document.querySelectorAll('.hl').forEach(function (e) { e.classList.remove('hl'); });
  }
  function mark(list) {
    document.body.classList.add('dim');
    list.forEach(function (e) { e.classList.add('hl'); });
  }
  document.querySelectorAll('[data-request]').forEach(function (el) {
    el.addEventListener('mouseenter', function () {
      clear();
      mark(sel('data-request', el.dataset.request));
    });
    el.addEventListener('mouseleave', clear);
  });
  document.querySelectorAll('.pool-block').forEach(function (el) {
    el.addEventListener('mouseenter', function () {
      var users = document.querySelectorAll('.table-block[data-block="' + el.dataset.block + '"]');
      if (users.length) { clear(); mark(users); el.classList.add('hl'); }
    });
    el.addEventListener('mouseleave', clear);
  });
})();
"""


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _attrs(**kv: object) -> str:
    return " ".join(f'{k.rstrip("_").replace("_", "-")}="{_e(v)}"' for k, v in kv.items())


def render_html(insp: Inspection, *, title: str | None = None) -> str:
    """The whole page as one string (no external scripts, styles or fonts)."""
    title = title or f"tilellm inspect: {insp.title}"
    body = [
        _summary(insp, title),
        _requests(insp),
        _matrix(insp),
        _grid(insp),
        _pages(insp),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{CSS}</style></head>\n<body>\n{DEFS}\n"
        + "\n".join(body)
        + f"\n<script>{JS}</script>\n</body></html>\n"
    )


def _summary(insp: Inspection, title: str) -> str:
    s, pool = insp.schedule, insp.pool
    plan = s.split_plan
    attrs = _attrs(
        id="summary",
        data_kernel=s.kernel,
        data_source=insp.source,
        data_num_requests=len(insp.requests),
        data_num_tokens=insp.num_tokens,
        data_num_programs=len(s.programs),
        data_num_empty_programs=s.num_empty_programs,
        data_grid="x".join(map(str, s.grid)),
        data_block_m=s.block_m,
        data_block_n=s.block_n,
        data_tiles_full=s.num_full,
        data_tiles_diagonal=s.num_diagonal,
        data_tiles_skipped=s.num_skipped,
        data_num_splits=plan.num_splits if plan else 1,
        data_num_blocks=pool.num_blocks,
        data_block_size=pool.block_size,
        data_blocks_shared=pool.count("shared"),
        data_blocks_used=pool.count("used"),
        data_blocks_cached=pool.count("cached"),
        data_blocks_free=pool.count("free"),
    )
    notes = "".join(f'<div class="note">{_e(n)}</div>' for n in insp.notes)
    return (
        f"<header {attrs}><h1>{_e(title)}</h1>"
        f"<div>{len(insp.requests)} requests, {insp.num_tokens} new tokens &middot; heads "
        f"{insp.num_q_heads}/{insp.num_kv_heads} (q/kv) &middot; head_dim {insp.head_dim} &middot; "
        f"block_size {insp.block_size} &middot; {_e(insp.dtype)} &middot; source: {_e(insp.source)}</div>"
        f"<div>kernel <code>{_e(s.kernel)}</code>: grid <code>{_e(s.grid)}</code> = "
        + (
            f"{len(s.programs)} tiles, {words.PERSISTENT_PROGRAMS}, "
            if s.persistent
            else f"{len(s.programs)} programs, "
        )
        + f"tile {s.block_m} rows &times; {s.block_n} keys"
        + (f", {s.block_q} tokens per query tile" if s.block_q is not None else "")
        + f" &middot; key tiles: <b>{s.num_full}</b> full, <b>{s.num_diagonal}</b> diagonal, "
        f"<b>{s.num_skipped}</b> skipped</div>{notes}</header>"
    )


def _requests(insp: Inspection) -> str:
    rows = [
        '<section id="requests"><h2>Requests</h2><table><tr><th>#</th><th class="l">id</th>'
        "<th "
        'class="l">kind</th><th>q_len</th><th>kv_len</th><th>context</th><th>cached</th><th>blocks</th></tr>'
    ]
    for r in insp.requests:
        a = _attrs(
            class_="request-row",
            data_request=r.index,
            data_request_id=r.request_id,
            data_q_len=r.q_len,
            data_kv_len=r.seq_len,
            data_kind=r.kind,
        )
        rows.append(
            f'<tr {a}><td>{r.index}</td><td class="l mono">{_e(r.request_id)}</td><td class="l">{r.kind}</td>'
            f"<td>{r.q_len}</td><td>{r.seq_len}</td><td>{r.context_len}</td><td>{r.num_cached_tokens}</td>"
            f"<td>{len(r.block_table)}</td></tr>"
        )
    rows.append("</table></section>")
    return "".join(rows)


def matrix_scale(insp: Inspection) -> tuple[float, float]:
    """(px per query row, px per key), one pair for every request of the batch.

    Keys: the longest request spans MATRIX_WIDTH px, within [MIN_KEY_PX, MAX_KEY_PX] per key (a
    very long one scrolls). Rows: all new tokens share MATRIX_HEIGHT px, within [MIN_ROW_PX,
    MAX_ROW_PX] per token, so a decode is one thin row and a long prefill is tall (the page scrolls).
    """
    longest = max(r.seq_len for r in insp.requests)
    key_px = min(MAX_KEY_PX, max(MIN_KEY_PX, MATRIX_WIDTH / longest))
    row_px = min(MAX_ROW_PX, max(MIN_ROW_PX, MATRIX_HEIGHT / insp.num_tokens))
    return row_px, key_px


def _visible_points(req: RequestView, sx: float, sy: float) -> str:
    """Outline of the attended region: the context rectangle, then the causal staircase."""
    ctx, q = req.context_len, req.q_len
    pts = [(0.0, 0.0)]
    if q <= STAIRCASE_MAX_ROWS:
        for r in range(q):
            pts += [((ctx + r + 1) * sx, r * sy), ((ctx + r + 1) * sx, (r + 1) * sy)]
    else:
        pts += [((ctx + 1) * sx, 0.0), (req.seq_len * sx, q * sy)]
    pts.append((0.0, q * sy))
    return " ".join(f"{x:.2f},{y:.2f}" for x, y in pts)


def _request_label(r: RequestView) -> str:
    tokens = "1 new token" if r.q_len == 1 else f"{r.q_len} new tokens"
    cached = f", {r.num_cached_tokens} from the prefix cache" if r.num_cached_tokens else ""
    keys = f"{r.seq_len} keys ({r.context_len} context{cached})"
    return f"req {r.index} \u00b7 {r.kind}: {tokens} \u00d7 {keys}"


def _matrix(insp: Inspection) -> str:
    reqs = insp.requests
    sy, sx = matrix_scale(insp)
    sched = insp.schedule
    width = PAD_L + max(r.seq_len for r in reqs) * sx + 8
    tops, y = [], 0.0
    for r in reqs:
        tops.append(y + LABEL_H)
        y += LABEL_H + r.q_len * sy + BAND_GAP
    height = y
    rows_text = f"{sy:.1f} px per new token" if sy != 1 else "1 px per new token"
    parts = [
        f'<section id="matrix"><h2>Attention matrix and tiles</h2>'
        f'<div class="note">One band per request: its rows are its new tokens, its columns its keys '
        "(context + new), all drawn at one scale "
        f"({rows_text}, {sx:.2f} px per key), so a decode is a single row and a long prefill is tall. "
        "Blue: the keys each query attends to; over it, the key tiles of the "
        f"{insp.schedule_head} 0 programs ({sched.block_n} keys wide): full (no mask needed), "
        "diagonal (partly masked), skipped (never loaded).</div>",
        _legend(),
        '<div class="scroll">'
        f'<svg id="attention-matrix" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
        f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" role="img" '
        f'aria-label="attention matrix" {_attrs(data_row_px=f"{sy:.4f}", data_key_px=f"{sx:.4f}")}>',
    ]
    for r, top in zip(reqs, tops):
        bw, bh = r.seq_len * sx, r.q_len * sy
        parts.append(
            f'<g class="request" {_attrs(data_request=r.index)} transform="translate({PAD_L},{top:.2f})">'
            f"<title>request {r.index} ({_e(r.request_id)}): {r.q_len} new tokens, {r.seq_len} keys, "
            f"{r.context_len} context</title>"
            f'<text class="req-label" x="0" y="-5">{_e(_request_label(r))}</text>'
            f'<rect class="req-box" width="{bw:.2f}" height="{bh:.2f}"/>'
            f'<polygon class="visible" points="{_visible_points(r, sx, sy)}"/>'
        )
        for run in tile_runs(insp, r, head=0):
            (r0, r1), (c0, c1) = run.rows, run.cols
            p = run.program
            a = _attrs(
                class_="tile",
                data_tile_class=run.tile_class,
                data_request=r.index,
                data_q_tile=p.q_tile,
                data_split=p.split,
                data_first_tile=run.first_tile,
                data_tiles=run.count,
            )
            parts.append(
                f'<rect {a} x="{c0 * sx:.2f}" y="{r0 * sy:.2f}" width="{(c1 - c0) * sx:.2f}" '
                f'height="{(r1 - r0) * sy:.2f}"><title>q tile {p.q_tile}, split {p.split}: {run.count} '
                f"{run.tile_class} tile(s) from key tile {run.first_tile}</title></rect>"
            )
        parts.append(_gridlines(insp, r, sx, sy, bw, bh))
        parts.append(_split_edges(insp, r, sx, sy))
        if r.num_cached_tokens > 0:
            a = _attrs(class_="cached-prefix", data_request=r.index, data_tokens=r.num_cached_tokens)
            parts.append(
                f'<rect {a} x="0" y="-3" width="{min(r.num_cached_tokens, r.seq_len) * sx:.2f}" height="3">'
                f"<title>{r.num_cached_tokens} tokens from the prefix cache</title></rect>"
            )
        parts.append("</g>")
    parts.append("</svg></div></section>")
    return "".join(parts)


def _gridlines(insp: Inspection, r: RequestView, sx: float, sy: float, bw: float, bh: float) -> str:
    """Tile boundaries inside a request's box, when they are far enough apart to be seen."""
    bn = insp.schedule.block_n
    lines = []
    if bn * sx >= 3:
        for c in range(bn, r.seq_len, bn):
            lines.append(f'<line class="gridline" x1="{c * sx:.2f}" y1="0" x2="{c * sx:.2f}" y2="{bh:.2f}"/>')
    q_tile = 1
    while True:
        r0, _ = query_rows(insp, r, q_tile)
        if r0 >= r.q_len:
            break
        if (r0 - query_rows(insp, r, q_tile - 1)[0]) * sy >= 3:
            lines.append(
                f'<line class="gridline" x1="0" y1="{r0 * sy:.2f}" x2="{bw:.2f}" y2="{r0 * sy:.2f}"/>'
            )
        q_tile += 1
    return "".join(lines)


def _split_edges(insp: Inspection, r: RequestView, sx: float, sy: float) -> str:
    """Dashed lines where a split-KV segment starts, over its program's query rows (KV head 0)."""
    bn = insp.schedule.block_n
    lines = []
    for p in insp.schedule.programs:
        if p.request != r.index or p.head != 0 or p.split == 0 or p.first_kv_tile <= 0:
            continue
        r0, r1 = query_rows(insp, r, p.q_tile)
        x = p.first_kv_tile * bn * sx
        lines.append(
            f'<line class="split-edge" {_attrs(data_request=r.index, data_split=p.split)} '
            f'x1="{x:.2f}" y1="{r0 * sy:.2f}" x2="{x:.2f}" y2="{r1 * sy:.2f}"/>'
        )
    return "".join(lines)


# Each legend swatch is drawn with the matrix's own classes, layered the same way (the attended
# region under a tile), so its colour is the colour of the tiles it names.
_SWATCHES = {
    "visible": ('<rect class="visible" width="14" height="14"/>', "attended (causal, with cached context)"),
    "full": (
        '<rect class="visible" width="14" height="14"/>'
        '<rect class="swatch-tile" data-tile-class="full" width="14" height="14"/>',
        "full tile: every key attended, no mask",
    ),
    "diagonal": (
        '<polygon class="visible" points="0,0 7,0 7,7 14,7 14,14 0,14"/>'
        '<rect class="swatch-tile" data-tile-class="diagonal" width="14" height="14"/>',
        "diagonal tile: partly masked",
    ),
    "skipped": (
        '<rect class="swatch-tile" data-tile-class="skipped" width="14" height="14"/>',
        "skipped tile: never loaded",
    ),
    "cached-prefix": (
        '<rect class="cached-prefix" y="5" width="14" height="4"/>',
        "context from the prefix cache (bar above a band)",
    ),
    "split-edge": (
        '<line class="split-edge" x1="7" y1="0" x2="7" y2="14"/>',
        "where a split-KV segment starts",
    ),
}


def _legend() -> str:
    items = "".join(
        f'<span class="legend-item" data-legend="{k}"><svg class="sw" width="14" height="14" '
        f'viewBox="0 0 14 14">{shape}</svg>{_e(text)}</span>'
        for k, (shape, text) in _SWATCHES.items()
    )
    return f'<div class="legend" id="matrix-legend">{items}</div>'


def _grid(insp: Inspection) -> str:
    s = insp.schedule
    plan = s.split_plan
    tile = f"one query tile of one request on one {insp.schedule_head}"
    parts = [
        f'<section id="grid"><h2>Launch grid</h2><div>grid <code>{_e(s.grid)}</code>: '
        + (
            f"{len(s.programs)} tiles, each {tile}, {words.PERSISTENT_PROGRAMS}. "
            if s.persistent
            else f"{len(s.programs)} programs, each {tile}. "
        )
        + f'<span id="idle-programs">{_e(_sentence(words.idle_programs(insp)))}.</span></div>',
    ]
    if plan is not None:
        parts.append(
            f'<div id="split-plan" {_attrs(data_num_splits=plan.num_splits, data_reason=plan.reason)}>'
            f"Split-KV: <b>{plan.num_splits}</b> segment(s) per query tile. "
            f"{_e(_sentence(words.split_plan(insp)))}.</div>"
        )
    else:
        parts.append(
            f'<div id="split-plan" {_attrs(data_num_splits=1, data_reason="not used by " + s.kernel)}>'
            f"Split-KV: not used. {_e(_sentence(words.split_plan(insp)))}.</div>"
        )
    parts.append(_program_map(insp))
    parts.append(
        "<h2>Key tiles per request (all heads)</h2><table><tr><th>request</th><th>full</th>"
        "<th>diagonal</th><th>skipped</th></tr>"
    )
    for r in insp.requests:
        c = insp.tile_counts(request=r.index)
        a = _attrs(
            class_="tile-counts",
            data_request=r.index,
            data_full=c["full"],
            data_diagonal=c["diagonal"],
            data_skipped=c["skipped"],
        )
        parts.append(
            "<tr "
            f"{a}><td>{r.index}</td><td>{c['full']}</td><td>{c['diagonal']}</td><td>{c['skipped']}</td></tr>"
        )
    parts.append(
        f'<tr id="tile-totals"><th>total</th><th>{s.num_full}</th><th>{s.num_diagonal}</th>'
        f"<th>{s.num_skipped}</th></tr></table></section>"
    )
    return "".join(parts)


def _program_map(insp: Inspection) -> str:
    """Head-0 programs: one row per request, one cell per (query tile, split); darker = more tiles."""
    progs = [p for p in insp.schedule.programs if p.head == 0]
    if not progs:
        return ""
    cols = max(p.q_tile for p in progs) + 1
    splits = max(p.split for p in progs) + 1
    per_row = cols * splits
    cell = max(6, min(22, 900 // max(per_row, 1)))
    most = max((p.full + p.diagonal for p in progs), default=1) or 1
    w = per_row * cell + 70
    h = len(insp.requests) * (cell + 2) + 4
    parts = [
        f'<div class="note">{insp.schedule_head[0].upper() + insp.schedule_head[1:]} 0: one row '
        "per request, one cell per program "
        "(query tile &times; split), darker = more key tiles read; hatched = its tile is past the "
        "request's end, so it exits immediately.</div>",
        f'<svg id="program-map" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'viewBox="0 0 {w} {h}">',
    ]
    for p in progs:
        x = 64 + (p.q_tile * splits + p.split) * cell
        y = 2 + p.request * (cell + 2)
        work = p.full + p.diagonal
        empty = int(is_empty(p))
        fill = "url(#hatch2)" if empty else f"rgba(21,101,192,{0.15 + 0.85 * work / most:.3f})"
        a = _attrs(
            class_="program",
            data_request=p.request,
            data_head=p.head,
            data_q_tile=p.q_tile,
            data_split=p.split,
            data_full=p.full,
            data_diagonal=p.diagonal,
            data_skipped=p.skipped,
            data_empty=empty,
        )
        parts.append(
            f'<rect {a} x="{x}" y="{y}" width="{cell}" height="{cell}" '
            f'fill="{fill}"><title>request {p.request}, '
            f"q tile {p.q_tile}, split {p.split}: {p.full} full, {p.diagonal} diagonal, {p.skipped} skipped"
            "</title></rect>"
        )
    for r in insp.requests:
        parts.append(f'<text x="0" y="{2 + r.index * (cell + 2) + cell * 0.75:.1f}">req {r.index}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _pages(insp: Inspection) -> str:
    pool = insp.pool
    parts = [
        f'<section id="pages"><h2>Page map</h2><div>pool of {pool.num_blocks} blocks &times; '
        f"{pool.block_size} "
        f"tokens: {pool.count('shared')} shared, {pool.count('used')} used, {pool.count('cached')} cached "
        f"(free but reusable), {pool.count('free')} free</div>",
        '<div class="legend">'
        + "".join(
            f'<span><i class="sw" style="background:var(--{k})"></i>{k}</span>'
            for k in ("shared", "used", "cached", "free")
        )
        + '<span><i class="sw" style="background:var(--used);box-shadow:inset 0 -3px 0 #4db6ac"></i>'
        "underlined: registered in the prefix cache</span></div>",
        "<h2>Block tables (logical &rarr; physical)</h2>",
    ]
    for r in insp.requests:
        parts.append(
            f'<div class="rowlabel" {_attrs(data_request=r.index)}>request {r.index} ({_e(r.request_id)}), '
            f'{len(r.block_table)} blocks</div><div class="blocks">'
        )
        for j, b in enumerate(r.block_table):
            blk = pool.blocks[b]
            a = _attrs(
                class_="table-block",
                data_request=r.index,
                data_logical=j,
                data_block=b,
                data_state=blk.state,
                data_cached=int(blk.cached),
                title=f"logical {j} -> physical {b}, ref count {blk.ref_count}"
                + (", in the prefix cache" if blk.cached else ""),
            )
            parts.append(f"<span {a}>{b}</span>")
        parts.append("</div>")
    parts.append('<h2>Physical blocks</h2><div class="blocks" id="pool">')
    i = 0
    blocks = pool.blocks
    while i < len(blocks):
        b = blocks[i]
        if b.state == "free":
            j = i
            while j < len(blocks) and blocks[j].state == "free":
                j += 1
            if j - i > POOL_RUN_MIN:
                a = _attrs(class_="pool-run", data_block=i, data_count=j - i, data_state="free")
                parts.append(f"<span {a}>{i}&hellip;{j - 1} free</span>")
                i = j
                continue
        a = _attrs(
            class_="pool-block",
            data_block=b.block,
            data_ref_count=b.ref_count,
            data_state=b.state,
            data_cached=int(b.cached),
            title=f"block {b.block}: {b.state}, ref count {b.ref_count}" + (", hashed" if b.cached else ""),
        )
        label = f"{b.block}" + (f"&times;{b.ref_count}" if b.ref_count > 1 else "")
        parts.append(f"<span {a}>{label}</span>")
        i += 1
    parts.append("</div></section>")
    return "".join(parts)


__all__ = ["render_html", "TILE_CLASSES"]
