"""The package's layers import one way only: host -> device -> models -> attention -> kernels.

Read from the source (module-level imports, not those under `if TYPE_CHECKING:` or inside
functions): every import of another tilellm package must point to a lower layer, and the
packages' import graph has no cycle.
"""

from __future__ import annotations

import ast
import pathlib

import tilellm

ROOT = pathlib.Path(tilellm.__file__).parent

# Lower number = lower layer. Packages on one level may not import each other.
LAYERS = {
    "kernels": 0,
    "attention": 1,
    "models": 2,
    "distributed": 2,
    "worker": 3,
    "cache": 4,
    "spec_decode": 4,  # proposers and their counters (host side)
    "engine": 5,
    "inspect": 6,
    "demo": 6,
    "server": 7,
    "commands": 8,  # the CLI's commands and their shared flags and user errors
    "bench": 9,  # the benchmark commands, on the CLI's shared helpers
    "cli": 10,
}
SHARED = {
    "config",
    "assets",
    "testing",
    "__init__",
}  # importable from anywhere; import nothing of tilellm's layers


def _package(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "tilellm" or len(parts) < 2:
        return None
    return parts[1]


def _module_level_imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body:  # module level only
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in [node] if not isinstance(node, ast.Try) else node.body:
            if isinstance(sub, ast.Import):
                found.update(a.name for a in sub.names)
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                found.add(sub.module)
    return found


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        own = rel.parts[0].removesuffix(".py")
        for module in _module_level_imports(path):
            other = _package(module)
            if other is not None and other != own:
                edges.setdefault(own, set()).add(other)
    return edges


def test_every_package_has_a_layer():
    packages = {
        p.name.removesuffix(".py")
        for p in ROOT.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    assert packages - SHARED <= set(LAYERS), packages - SHARED - set(LAYERS)


def test_imports_point_down():
    wrong = []
    for own, others in _edges().items():
        for other in others:
            if own in SHARED or other in SHARED:
                if own in SHARED and other not in SHARED and own != "__init__" and own != "testing":
                    wrong.append(f"{own} -> {other} (a shared module imports a layer)")
                continue
            if LAYERS[other] >= LAYERS[own]:
                wrong.append(f"{own} -> {other}")
    assert not wrong, "imports against the layering: " + ", ".join(sorted(wrong))


def test_no_import_cycle_between_packages():
    edges = _edges()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in edges.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, node, nxt]))
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in list(edges):
        if node not in state:
            visit(node, [])
