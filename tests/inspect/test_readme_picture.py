"""docs/inspector.png is the page of README.md's own inspector command, made by the current code.

tools/inspector_screenshot.py records in the PNG the command it ran and the page's summary
numbers; a README edit or a change to what the page shows without a new picture fails here
(regenerate: `python tools/inspector_screenshot.py`).
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import struct
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PICTURE = REPO / "docs" / "inspector.png"


def _tool():
    path = REPO / "tools" / "inspector_screenshot.py"
    spec = importlib.util.spec_from_file_location("inspector_screenshot", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _tool()


def test_picture_shows_the_readme_command():
    recorded = tool.read_png_text(PICTURE.read_bytes())
    assert tool.COMMAND_KEY in recorded, "docs/inspector.png was not made by tools/inspector_screenshot.py"
    assert shlex.split(recorded[tool.COMMAND_KEY]) == tool.readme_command(REPO / "README.md"), (
        "README.md's inspector command and docs/inspector.png disagree: "
        "run python tools/inspector_screenshot.py"
    )


def test_picture_numbers_are_the_current_page(tmp_path, monkeypatch):
    """The summary numbers in the picture are what the README's command renders now (GPU tiles)."""
    from tilellm.cli import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the picture shows the GPU kernels' tiles
    page = tmp_path / "page.html"
    command = tool.with_html(tool.readme_command(REPO / "README.md"), str(page))
    assert main(["inspect", *command, "--quiet"]) == 0
    recorded = json.loads(tool.read_png_text(PICTURE.read_bytes())[tool.FACTS_KEY])
    assert recorded == tool.page_facts(page.read_text(encoding="utf-8")), (
        "docs/inspector.png shows other numbers than the page renders now: "
        "run python tools/inspector_screenshot.py"
    )


def test_picture_is_a_whole_page_screenshot():
    png = PICTURE.read_bytes()
    width, height = struct.unpack(">II", png[16:24])
    assert width >= tool.PAGE_WIDTH - 40 and height > 900  # full page, not only the window


def test_png_text_round_trip_and_readme_parsing(tmp_path):
    png = PICTURE.read_bytes()
    out = tool.add_png_text(png, {"k": "v w"})
    assert tool.read_png_text(out)["k"] == "v w" and out.endswith(png[-12:])
    readme = tmp_path / "README.md"
    readme.write_text(
        '# x\n## The inspector\n\nRun `tilellm inspect --batch "3:9" --html p.html` to see.\n## Next\n'
    )
    assert tool.readme_command(readme) == ["--batch", "3:9", "--html", "p.html"]
    readme.write_text("# x\n## Other\n`tilellm inspect --html a.html`\n")
    with pytest.raises(ValueError, match="no '## The inspector' section"):
        tool.readme_command(readme)
