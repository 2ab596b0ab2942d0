#!/usr/bin/env python
"""Render an inspector page and screenshot it with headless Chromium (the README's docs/inspector.png).

    python tools/inspector_screenshot.py                      # -> docs/inspector.png
    python tools/inspector_screenshot.py --batch 1:3000,64:64 --out /tmp/x.png --html /tmp/x.html

Uses the same DevTools-pipe client as the browser test (tests/inspect/cdp.py); needs /usr/bin/chromium.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.pop("TRITON_INTERPRET", None)  # show the GPU kernels' tiles, not the interpreter's

from tests.inspect.cdp import Browser, find_chromium  # noqa: E402
from tilellm.inspect import describe_batch, parse_heads, render_html  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1:1328,6:300,129:463")
    parser.add_argument("--heads", default="32/8")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--shared-prefix", type=int, default=256)
    parser.add_argument("--num-splits", type=int, default=None)
    parser.add_argument("--width", type=int, default=1200)
    parser.add_argument("--out", default=str(REPO / "docs" / "inspector.png"))
    parser.add_argument("--html", default=None, help="also keep the HTML page here")
    args = parser.parse_args(argv)

    chromium = find_chromium()
    if chromium is None:
        print("no Chromium found (apt-get install chromium)", file=sys.stderr)
        return 1
    hq, hkv = parse_heads(args.heads)
    insp = describe_batch(
        args.batch,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=args.head_dim,
        shared_prefix=args.shared_prefix,
        num_splits=args.num_splits,
    )
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(args.html) if args.html else Path(tmp) / "inspector.html"
        page.write_text(render_html(insp), encoding="utf-8")
        with Browser(chromium, width=args.width, height=900) as browser:
            browser.goto(page.resolve().as_uri())
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            browser.screenshot(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
