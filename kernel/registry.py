"""A tiny generic registry: handlers by (kind, name); names are YAML values.

Built-in handlers register with the `register` decorator when their module is
imported, and every module of a kind's packages is imported on its first lookup;
third-party classes load by dotted path (`pkg.module:Class`). This is a leaf module:
anything may import it, and it imports nothing of the project at import time.

NOTE: discovery imports every built-in module, so no built-in module may import an
optional dependency (an extra of the package) at module level: a handler that needs one
calls `optional_module` when it is constructed, and a missing extra is then an error at
start-up that names it, never a failed lookup of some other handler of its kind.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")

KINDS = (
    "model",
    "attention",
    "schedule",
    "evict",
    "tier_write",
    "tier_prefetch",
    "state_strategy",
    "storage",
    "tool_parser",
    "drafter",
    "moe",
)

# Packages that hold the built-in handlers of each kind. On the first lookup of a kind
# every module of its packages is imported, so a built-in handler registers itself by
# existing: adding one is adding a file, and registration never depends on import order.
_BUILTIN_PACKAGES: dict[str, tuple[str, ...]] = {
    "model": ("gpu.models",),
    "attention": ("gpu.attention",),
    "schedule": ("handlers",),
    "evict": ("handlers",),
    "tier_write": ("handlers",),
    "tier_prefetch": ("handlers",),
    "state_strategy": ("handlers",),
    "storage": ("cache.storage", "plugins.storage"),
    "tool_parser": ("handlers.tool_parsers",),
    "drafter": ("handlers", "kernel.speculative"),
    "moe": ("gpu.moe",),
}
_imported: set[str] = set()

_handlers: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}


# The optional imports of the built-in handlers, by module, with the extra (pyproject.toml
# `[project.optional-dependencies]`) that installs each.
OPTIONAL_MODULES: dict[str, str] = {"redis": "redis", "triton": "cuda", "zmq": "kv-events", "msgspec": "kv-events"}


class RegistryError(LookupError):
    """Unknown kind or name; the message lists what is known."""


class MissingExtraError(ImportError):
    """An optional dependency that is not installed; the message names the extra."""


def optional_module(module: str, feature: str) -> ModuleType:
    """Import an optional dependency for `feature` (a config setting, e.g.
    `hicache.storage: redis`), or raise MissingExtraError naming the extra to install."""
    extra = OPTIONAL_MODULES[module]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{feature} needs the `{module}` package, which is not installed: "
            f"pip install 'tierserve[{extra}]'"
        ) from exc


def register(kind: str, *names: str) -> Callable[[T], T]:
    """Class/function decorator: `@register("schedule", "fcfs")`."""
    if kind not in _handlers:
        raise RegistryError(f"unknown handler kind {kind!r}; known kinds: {list(KINDS)}")

    def deco(obj: T) -> T:
        for name in names:
            existing = _handlers[kind].get(name)
            if existing is not None and existing is not obj:
                raise RegistryError(f"{kind} handler {name!r} is already registered")
            _handlers[kind][name] = obj
        return obj

    return deco


def lookup(kind: str, name: str) -> Any:
    """The handler registered as `name` of `kind`, or a class named by dotted path."""
    if kind not in _handlers:
        raise RegistryError(f"unknown handler kind {kind!r}; known kinds: {list(KINDS)}")
    if ":" in name:
        return _load_dotted(name)
    _import_builtins(kind)
    try:
        return _handlers[kind][name]
    except KeyError:
        known = sorted(_handlers[kind])
        raise RegistryError(f"unknown {kind} handler {name!r}; known: {known}") from None


def names(kind: str) -> list[str]:
    _import_builtins(kind)
    return sorted(_handlers[kind])


def name_of(kind: str, handler: object) -> str | None:
    """The registered name of a handler instance's class (its qualname if unregistered)."""
    for name in names(kind):
        if type(handler) is _handlers[kind][name]:
            return name
    return type(handler).__qualname__


def _import_builtins(kind: str) -> None:
    for package_name in _BUILTIN_PACKAGES.get(kind, ()):
        if package_name in _imported:
            continue
        package = importlib.import_module(package_name)
        for info in pkgutil.iter_modules(package.__path__, prefix=f"{package_name}."):
            if not info.ispkg:
                importlib.import_module(info.name)
        _imported.add(package_name)


def _load_dotted(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RegistryError(f"cannot import handler module {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise RegistryError(f"module {module_name!r} has no attribute {attr!r}") from None
