"""plugins/ reach the engine through its public surface only.

The engine's internals (scheduler, components, counters) are reshaped freely in
kernel/; plugins import from kernel/ only the modules below (and from cache/ only the
KV event types) and never touch `engine.scheduler`, `engine.parts` or `engine.counters`.
"""

from __future__ import annotations

import ast
from pathlib import Path

PLUGINS = Path(__file__).resolve().parent.parent / "plugins"
ALLOWED_MODULES = {
    "kernel.async_engine", "kernel.config", "kernel.sampling_params", "kernel.results.events", "kernel.registry",
    "kernel.results.output", "kernel.cli", "cache.kv_events",
    # The interface of the tool_parser registry kind (the chat route reads replies with it).
    "kernel.structured.tool_parser",
    # Storage backends that need a server implement the cache's storage interface.
    "cache.storage.base", "cache.storage.keys", "cache.storage.page_file",
}
ENGINE_NAMES = {
    "AsyncEngine", "OutputChunk", "PolicyError", "RequestError", "EngineInfo", "ContextOverflow", "EngineUnavailable",
}
INTERNALS = {"scheduler", "parts", "counters"}


def project_imports(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every import of kernel/ or cache/ in `tree`."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
    return [(m, names) for m, names in found if m.split(".")[0] in ("kernel", "cache")]


def engine_internals(tree: ast.AST) -> list[str]:
    """`<...>engine.scheduler` and the like: an internal read off something named engine."""
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in INTERNALS:
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name == "engine":
                hits.append(f"line {node.lineno}: engine.{node.attr}")
    return hits


def test_plugins_import_only_the_public_kernel_modules() -> None:
    files = sorted(PLUGINS.rglob("*.py"))
    assert len(files) > 10
    bad = []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for module, names in project_imports(tree):
            if module == "kernel" and set(names) <= {"registry", "cli"}:
                continue  # `from kernel import registry`
            if module not in ALLOWED_MODULES:
                bad.append(f"{path.name}: {module}")
            elif module == "kernel.async_engine" and not set(names) <= ENGINE_NAMES:
                bad.append(f"{path.name}: {module}.{set(names) - ENGINE_NAMES}")
        bad += [f"{path.name} {hit}" for hit in engine_internals(tree)]
    assert not bad, bad


def test_the_check_sees_an_internal_read() -> None:
    tree = ast.parse("from cache.radix_tree import RadixTree\nn = self.engine.scheduler.waiting\n")
    assert project_imports(tree) == [("cache.radix_tree", ["RadixTree"])]
    assert engine_internals(tree) == ["line 2: engine.scheduler"]
