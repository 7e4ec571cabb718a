"""The import rules of ../shared/ARCHITECTURE.md, read from the source with `ast`.

`gpu/` and `cache/` never import `kernel/` or `plugins/` (the registry, a leaf module,
is the one exception); `cache/` never imports `gpu/`; `kernel/` never imports
`plugins/`; `handlers/` never import `gpu/` or `plugins/`. Every import counts, also
inside functions and under TYPE_CHECKING: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernel", "gpu", "cache", "handlers", "plugins")
LEAVES = frozenset({"kernel.registry"})  # anyone may import these

FORBIDDEN: dict[str, frozenset[str]] = {
    "gpu": frozenset({"kernel", "plugins"}),
    "cache": frozenset({"kernel", "plugins", "gpu"}),
    "kernel": frozenset({"plugins"}),
    "handlers": frozenset({"gpu", "plugins"}),
    "plugins": frozenset(),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.append((node.lineno, node.module))
            # `from kernel import registry` imports the module kernel.registry
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def violations(package: str, files: list[Path]) -> list[str]:
    bad = []
    for path in files:
        for line, module in imported_modules(path):
            if module.split(".")[0] not in FORBIDDEN[package] or _in_leaf(module):
                continue
            if _is_leaf_parent(module, path, line):
                continue
            name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            bad.append(f"{name}:{line} imports {module}")
    return bad


def _in_leaf(module: str) -> bool:
    """A leaf module, or a name inside one (`from kernel.registry import register`)."""
    return any(module == leaf or module.startswith(leaf + ".") for leaf in LEAVES)


def _is_leaf_parent(module: str, path: Path, line: int) -> bool:
    """`from kernel import registry` names `kernel` too; it is fine when every name it
    imports is a leaf module."""
    if module not in {leaf.rsplit(".", 1)[0] for leaf in LEAVES}:
        return False
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.lineno == line and node.module == module:
            return all(f"{module}.{alias.name}" in LEAVES for alias in node.names)
    return False


def python_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_no_forbidden_imports(package: str) -> None:
    assert python_files(package), f"{package}/ has no Python files"
    bad = violations(package, python_files(package))
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


def test_registry_is_a_leaf() -> None:
    imports = [m for _, m in imported_modules(ROOT / "kernel" / "registry.py")]
    assert not [m for m in imports if m.split(".")[0] in PACKAGES]


def test_red_a_planted_edge_is_reported(tmp_path: Path) -> None:
    """The walk sees imports at module level, in functions and under TYPE_CHECKING."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from typing import TYPE_CHECKING\n"
        "from kernel import registry\n"
        "if TYPE_CHECKING:\n    from kernel.request import Request\n"
        "def f():\n    import plugins.http.server\n"
        "from kernel import registry, config\n"
    )
    bad = violations("cache", [planted])
    assert any("kernel.request" in b for b in bad)
    assert any("plugins.http.server" in b for b in bad)
    assert any("kernel.config" in b for b in bad)
    assert not any(b.endswith("imports kernel.registry") for b in bad)
    assert sum(":2 " in b for b in bad) == 0, "a leaf-only `from kernel import registry` is allowed"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(files: list[Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (any import counts, as above). `from pkg
    import x` imports the package itself too, unless every name it imports is a submodule
    (`from kernel import registry` reads kernel/registry.py, not kernel/__init__.py's names)."""
    modules = {module_name(p): p for p in files}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
                subs = [f"{node.module}.{alias.name}" for alias in node.names]
                targets = [s for s in subs if s in modules]
                if len(targets) < len(subs):
                    targets.append(node.module)
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def project_files() -> list[Path]:
    return [p for package in PACKAGES for p in python_files(package)]


def test_no_import_cycles() -> None:
    """No module imports itself through others: with a cycle, no file of it can be read,
    tested or moved alone (TYPE_CHECKING and function-level imports count too)."""
    found = cycles(import_graph(project_files()))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_red_a_planted_cycle_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A type-only import back from the request to the scheduler (the shape of the cycles this
    test was written against) is a cycle."""
    request = ROOT / "kernel" / "request.py"
    planted = request.read_text() + "\nif TYPE_CHECKING:\n    from kernel.scheduling.scheduler import Scheduler\n"
    original = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: planted if self == request else original(self, *a, **k))
    found = cycles(import_graph(project_files()))
    assert any("kernel.request" in c and "kernel.scheduling.scheduler" in c for c in found), found


def test_kernel_top_level_stays_small() -> None:
    """kernel/ groups what belongs together in subpackages (scheduling, tiers, structured,
    states, results); its top level keeps the lifecycle, the registry, config and the request."""
    flat = sorted(p.name for p in (ROOT / "kernel").glob("*.py"))
    assert len(flat) <= 14, f"kernel/ has {len(flat)} top-level modules: {flat}"
