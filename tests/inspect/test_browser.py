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
    # One laid-out box per request in the attention matrix, even a one-token decode next to a long one.
    assert [b[0] for b in got["boxes"]] == list(range(facts["num_requests"]))
    assert all(w >= 10 and h >= 10 for _, w, h in got["boxes"]), got["boxes"]
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

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / f"inspector-{name}.png"
    browser.screenshot(str(shot))
    assert shot.stat().st_size > 10_000
