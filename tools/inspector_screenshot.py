#!/usr/bin/env python
"""Regenerate docs/inspector.png from the README's own inspector command.

    python tools/inspector_screenshot.py              # README.md's command -> docs/inspector.png
    python tools/inspector_screenshot.py --out /tmp/x.png --keep-html /tmp/x.html

Reads the `tilellm inspect ... --html page.html` command from README.md's "The inspector"
section, runs it (the page goes to a temporary file unless --keep-html), screenshots the whole
page with Debian's headless Chromium (`apt-get install -y chromium`; TILELLM_CHROMIUM overrides
the path) and records in the PNG (tEXt chunks) the command and the page's summary numbers, so
tests/inspect/test_readme_picture.py notices when README, code and picture disagree.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import struct
import sys
import tempfile
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMAND_KEY = "tilellm-inspect-command"  # tEXt key: the README command the picture shows
FACTS_KEY = "tilellm-inspect-facts"  # tEXt key: JSON of the page's #summary numbers
PAGE_WIDTH = 1200  # px: the browser window the picture is taken in


def readme_command(readme: Path = REPO / "README.md") -> list[str]:
    """The arguments after `tilellm inspect` of the first inspector command in README's section."""
    text = readme.read_text(encoding="utf-8")
    section = re.search(r"^## The inspector\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    if section is None:
        raise ValueError(f"{readme}: no '## The inspector' section")
    m = re.search(r"`tilellm inspect ([^`]*--html[^`]*)`", section.group(1))
    if m is None:
        raise ValueError(f"{readme}: its inspector section has no `tilellm inspect ... --html FILE` command")
    return shlex.split(m.group(1))


def with_html(args: list[str], path: str) -> list[str]:
    """`args` with the value of --html replaced by `path`."""
    i = args.index("--html")
    return args[: i + 1] + [path] + args[i + 2 :]


def page_facts(html: str) -> dict[str, str]:
    """The `data-*` attributes of the page's #summary header (its counts of programs, tiles, blocks)."""
    tag = re.search(r'<header id="summary"([^>]*)>', html)
    if tag is None:
        raise ValueError("the page has no #summary header")
    return dict(re.findall(r'(data-[\w-]+)="([^"]*)"', tag.group(1)))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def add_png_text(png: bytes, entries: dict[str, str]) -> bytes:
    """`png` with one tEXt chunk per entry, placed right after IHDR (Latin-1 text, per the PNG spec)."""
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file")
    ihdr_end = 8 + 12 + struct.unpack(">I", png[8:12])[0]
    text = b"".join(
        _chunk(b"tEXt", k.encode("latin-1") + b"\0" + v.encode("latin-1")) for k, v in entries.items()
    )
    return png[:ihdr_end] + text + png[ihdr_end:]


def read_png_text(png: bytes) -> dict[str, str]:
    """Every tEXt chunk of `png` as {keyword: text}."""
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file")
    out, i = {}, 8
    while i < len(png):
        (n,) = struct.unpack(">I", png[i : i + 4])
        kind, data = png[i + 4 : i + 8], png[i + 8 : i + 8 + n]
        if kind == b"tEXt":
            key, _, value = data.partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        if kind == b"IEND":
            break
        i += 12 + n
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", default=str(REPO / "README.md"))
    parser.add_argument("--out", default=str(REPO / "docs" / "inspector.png"))
    parser.add_argument("--keep-html", default=None, metavar="FILE", help="also keep the rendered page here")
    args = parser.parse_args(argv)

    # The picture shows the GPU kernels' tiles, as `tilellm inspect` prints them on a GPU machine.
    os.environ.pop("TRITON_INTERPRET", None)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.inspect.cdp import Browser, find_chromium
    from tilellm.cli import main as tilellm_main

    chromium = find_chromium()
    if chromium is None:
        print("no Chromium found: apt-get install -y chromium (or set TILELLM_CHROMIUM)", file=sys.stderr)
        return 1
    command = readme_command(Path(args.readme))
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(args.keep_html) if args.keep_html else Path(tmp) / "page.html"
        if tilellm_main(["inspect", *with_html(command, str(page)), "--quiet"]) != 0:
            print(f"the README's command failed: tilellm inspect {shlex.join(command)}", file=sys.stderr)
            return 1
        shot = Path(tmp) / "shot.png"
        with Browser(chromium, width=PAGE_WIDTH, height=900) as browser:
            browser.goto(page.resolve().as_uri())
            browser.screenshot(str(shot))
        facts = page_facts(page.read_text(encoding="utf-8"))
        png = add_png_text(
            shot.read_bytes(),
            {COMMAND_KEY: shlex.join(command), FACTS_KEY: json.dumps(facts, sort_keys=True)},
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png)
    print(f"wrote {out} (tilellm inspect {shlex.join(command)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
