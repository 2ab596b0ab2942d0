"""The GPU benchmark scripts (`benchmarks/*.py`), which CI cannot run: every name they take from
tilellm exists.

Read from the source: `from tilellm... import name` must find the name (or a submodule of that
name), and `name.attr` on a module imported as `import tilellm... as name` must find the
attribute. A renamed or moved function then fails here, not on the GPU machine.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

SCRIPTS = sorted((pathlib.Path(__file__).parent.parent / "benchmarks").glob("*.py"))


def _missing_names(source: str) -> list[str]:
    tree = ast.parse(source)
    missing = []
    aliases: dict[str, str] = {}  # local name -> the tilellm module it names
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "tilellm":
                    importlib.import_module(a.name)
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tilellm":
            module = importlib.import_module(node.module)
            for a in node.names:
                if hasattr(module, a.name):
                    continue
                try:
                    importlib.import_module(f"{node.module}.{a.name}")
                except ImportError:
                    missing.append(f"{node.module}.{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            module = importlib.import_module(aliases[node.value.id])
            if not hasattr(module, node.attr):
                missing.append(f"{aliases[node.value.id]}.{node.attr}")
    return missing


def test_the_scripts_are_found():
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_tilellm_name_a_script_uses_exists(script):
    assert _missing_names(script.read_text()) == []


def test_a_missing_name_is_found():
    """The check itself: a module attribute and an imported name that do not exist (the first as
    `decode_layer_ops.py` once called `apply_rotary` on `tilellm.kernels`)."""
    source = "\n".join(
        [
            "import tilellm.kernels as tk",
            "from tilellm.kernels import fused, no_such_op",
            "tk.apply_rotary(1)",
        ]
    )
    assert _missing_names(source) == ["tilellm.kernels.no_such_op", "tilellm.kernels.apply_rotary"]
