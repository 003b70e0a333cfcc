"""The package's import graph has no mutual imports: no two modules import each other, at module level or
inside a function (a lazy import hides a cycle, it does not remove it)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "megatron_rl"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports (``from pkg import name`` counts as pkg.name when that is a
    module, else as pkg)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in modules else node.module)
    return {m for m in out if m in modules}


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, modules) - {name} for name, path in files.items()}


def test_no_two_modules_import_each_other():
    graph = import_graph()
    mutual = sorted(
        (a, b)
        for a, deps in graph.items()
        for b in deps
        if a < b and a in graph.get(b, set()) and not (a == b.rsplit(".", 1)[0] or b == a.rsplit(".", 1)[0])
    )
    assert not mutual, f"modules that import each other: {mutual}"
