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
        "from kernel import registry, scheduler\n"
    )
    bad = violations("cache", [planted])
    assert any("kernel.request" in b for b in bad)
    assert any("plugins.http.server" in b for b in bad)
    assert any("kernel.scheduler" in b for b in bad)
    assert not any(b.endswith("imports kernel.registry") for b in bad)
    assert sum(":2 " in b for b in bad) == 0, "a leaf-only `from kernel import registry` is allowed"
