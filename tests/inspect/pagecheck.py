"""What an inspector page should contain, computed from the `Inspection` it renders.

Shared by the HTML-parser test and the headless-browser test, so both check the same numbers.
"""

from __future__ import annotations

from html.parser import HTMLParser

from tilellm.inspect import Inspection

TILE_CLASSES = ("full", "diagonal", "skipped")


def expected_facts(insp: Inspection) -> dict:
    """Counts the page must show: per request, per tile class (head 0 and all heads), per block."""
    s = insp.schedule
    head0 = [p for p in s.programs if p.head == 0]
    return {
        "kernel": s.kernel,
        "num_requests": len(insp.requests),
        "q_lens": [r.q_len for r in insp.requests],
        "kv_lens": [r.seq_len for r in insp.requests],
        "num_programs": len(s.programs),
        "head0_programs": len(head0),
        "head0_tiles": {c: sum(getattr(p, c) for p in head0) for c in TILE_CLASSES},
        "all_tiles": {"full": s.num_full, "diagonal": s.num_diagonal, "skipped": s.num_skipped},
        "per_request_tiles": [insp.tile_counts(request=r.index) for r in insp.requests],
        "block_tables": [list(r.block_table) for r in insp.requests],
        "num_blocks": insp.pool.num_blocks,
        "pool_states": {k: insp.pool.count(k) for k in ("shared", "used", "cached", "free")},
        "ref_counts": [b.ref_count for b in insp.pool.blocks],
        "num_splits": s.split_plan.num_splits if s.split_plan else 1,
    }


# JavaScript that reads the same facts back from a rendered page (run by the browser test).
PAGE_FACTS_JS = r"""
(() => {
  const all = (q) => Array.from(document.querySelectorAll(q));
  const num = (e, k) => parseInt(e.getAttribute(k), 10);
  const summary = document.getElementById('summary');
  const tiles = {full: 0, diagonal: 0, skipped: 0};
  all('#attention-matrix .tile').forEach(t => { tiles[t.dataset.tileClass] += num(t, 'data-tiles'); });
  const perReq = all('.tile-counts').map(r => ({
    request: num(r, 'data-request'), full: num(r, 'data-full'),
    diagonal: num(r, 'data-diagonal'), skipped: num(r, 'data-skipped')}));
  const tables = {};
  all('.table-block').forEach(b => {
    const r = b.dataset.request; (tables[r] = tables[r] || []).push(num(b, 'data-block'));
  });
  let poolCount = 0; const refs = {};
  all('#pool .pool-block').forEach(b => {
    poolCount += 1; refs[b.dataset.block] = num(b, 'data-ref-count');
  });
  all('#pool .pool-run').forEach(b => { poolCount += num(b, 'data-count'); });
  const boxes = all('#attention-matrix g.request').map(g => {
    const r = g.querySelector('.req-box').getBoundingClientRect();
    return [num(g, 'data-request'), r.width, r.height];
  });
  const visibleTiles = all('#attention-matrix .tile').filter(t => {
    const r = t.getBoundingClientRect(); return r.width > 0 && r.height > 0; }).length;
  return {
    kernel: summary.dataset.kernel,
    summaryTiles: {full: num(summary, 'data-tiles-full'), diagonal: num(summary, 'data-tiles-diagonal'),
                   skipped: num(summary, 'data-tiles-skipped')},
    numRequests: num(summary, 'data-num-requests'),
    rows: all('.request-row').map(r => [num(r, 'data-request'), num(r, 'data-q-len'), num(r, 'data-kv-len')]),
    boxes: boxes,
    tiles: tiles,
    numTileElements: all('#attention-matrix .tile').length,
    visibleTiles: visibleTiles,
    programs: all('#program-map .program').length,
    perReq: perReq,
    tables: tables,
    poolCount: poolCount,
    refs: refs,
    numSplits: num(document.getElementById('split-plan'), 'data-num-splits'),
  };
})()
"""


class Elements(HTMLParser):
    """Every start tag with its attributes, in document order (stdlib parser, no browser)."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.items: list[tuple[str, dict[str, str]]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.items.append((tag, {k: (v if v is not None else "") for k, v in attrs}))

    def with_class(self, cls: str) -> list[dict[str, str]]:
        return [a for _, a in self.items if cls in a.get("class", "").split()]

    def by_id(self, ident: str) -> dict[str, str]:
        found = [a for _, a in self.items if a.get("id") == ident]
        assert len(found) == 1, f"expected one #{ident}, found {len(found)}"
        return found[0]
