"""The inspector page in a real browser: Debian's headless Chromium, driven over the DevTools pipe.

Checks that the elements for every request, tile class and block are present, laid out (non-zero
boxes) and consistent with the schedule; that hovering a request highlights its elements; and
saves a full-page screenshot under artifacts/ (git-ignored) for people to look at.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.inspect.cdp import Browser, find_chromium
from tests.inspect.pagecheck import PAGE_FACTS_JS, TILE_CLASSES, expected_facts
from tilellm.inspect import describe_batch, render_html
from tilellm.inspect.html import matrix_scale

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium found (apt-get install chromium, or set TILELLM_CHROMIUM): browser test skipped",
)

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("TILELLM_ARTIFACTS", REPO / "artifacts"))

PAGES = {
    "mixed": ("1:1328,5:18,129:463", dict(num_q_heads=32, num_kv_heads=8, head_dim=128)),
    "shared-prefix": (
        "1:1328,6:300,129:463",
        dict(num_q_heads=32, num_kv_heads=8, head_dim=128, shared_prefix=256, num_splits=2),
    ),
    "prefill": ("300,40,129", dict(num_q_heads=8, num_kv_heads=2, head_dim=64)),
}


# For each tile class: the computed paint of a matrix tile and of its legend swatch, and what
# shows through it (the attended region's paint, or nothing; an opaque one hides what is under it).
LEGEND_JS = r"""
(() => {
  const paint = (e) => { if (!e) return null; const s = getComputedStyle(e);
    return [s.fill, s.opacity, s.stroke, s.strokeWidth]; };
  const out = {};
  for (const cls of ['full', 'diagonal', 'skipped']) {
    const tile = document.querySelector('#attention-matrix .tile[data-tile-class="' + cls + '"]');
    const sw = document.querySelector('#matrix-legend .swatch-tile[data-tile-class="' + cls + '"]');
    const under = (e) => {
      if (!e || getComputedStyle(e).opacity === '1') return null;
      const g = e.closest('g.request, svg.sw'); const r = e.getBoundingClientRect();
      const hit = Array.from(g.querySelectorAll('.visible')).some(v => {
        const b = v.getBoundingClientRect();
        return b.right > r.left && b.left < r.right && b.bottom > r.top && b.top < r.bottom; });
      return hit ? paint(g.querySelector('.visible')) : null;
    };
    out[cls] = {tile: [paint(tile), under(tile)], swatch: [paint(sw), under(sw)]};
  }
  return out;
})()
"""


@pytest.fixture(scope="module")
def browser():
    with Browser(CHROMIUM, width=1200, height=900) as b:
        yield b


@pytest.mark.parametrize("name", list(PAGES))
def test_page_in_browser(browser, tmp_path, name):
    batch, kw = PAGES[name]
    insp = describe_batch(batch, **kw)
    facts = expected_facts(insp)
    page = tmp_path / f"inspector-{name}.html"
    page.write_text(render_html(insp), encoding="utf-8")
    browser.goto(page.as_uri())
    got = browser.evaluate(PAGE_FACTS_JS)

    assert got["kernel"] == facts["kernel"]
    assert got["numRequests"] == facts["num_requests"]
    assert got["rows"] == [[i, q, k] for i, (q, k) in enumerate(zip(facts["q_lens"], facts["kv_lens"]))]
    # One laid-out box per request in the attention matrix, all at one scale: a one-token decode
    # is a single row (a few px), a long prefill as tall as its tokens.
    row_px, key_px = matrix_scale(insp)
    assert [b[0] for b in got["boxes"]] == list(range(facts["num_requests"]))
    for (_, w, h), q, k in zip(got["boxes"], facts["q_lens"], facts["kv_lens"]):
        assert w == pytest.approx(k * key_px, abs=1.5), got["boxes"]
        assert h == pytest.approx(q * row_px, abs=1.5), got["boxes"]
    assert got["tiles"] == facts["head0_tiles"]
    assert got["summaryTiles"] == facts["all_tiles"]
    assert got["visibleTiles"] == got["numTileElements"] > 0
    assert got["programs"] == facts["head0_programs"]
    assert [{c: r[c] for c in TILE_CLASSES} for r in got["perReq"]] == facts["per_request_tiles"]
    assert [got["tables"].get(str(i), []) for i in range(facts["num_requests"])] == facts["block_tables"]
    assert got["poolCount"] == facts["num_blocks"]
    assert all(facts["ref_counts"][int(b)] == rc for b, rc in got["refs"].items())
    assert got["numSplits"] == facts["num_splits"]

    # Hovering a request's row highlights that request's elements everywhere on the page.
    hl = browser.evaluate(
        """(() => {
          const row = document.querySelector('.request-row[data-request="1"]');
          row.dispatchEvent(new MouseEvent('mouseenter'));
          const lit = Array.from(document.querySelectorAll('.hl'));
          const res = [document.body.classList.contains('dim'), lit.length,
                       lit.every(e => e.dataset.request === '1')];
          row.dispatchEvent(new MouseEvent('mouseleave'));
          return res.concat([document.querySelectorAll('.hl').length]);
        })()"""
    )
    assert hl[0] and hl[1] > 0 and hl[2] and hl[3] == 0, hl

    # Each legend swatch is painted like the tiles it names: same fill, opacity and layer below.
    legend = browser.evaluate(LEGEND_JS)
    for cls in TILE_CLASSES:
        if facts["head0_tiles"][cls]:
            assert legend[cls]["swatch"] == legend[cls]["tile"], (cls, legend[cls])

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / f"inspector-{name}.png"
    browser.screenshot(str(shot))
    assert shot.stat().st_size > 10_000
