"""tierserve microkernel: request lifecycle, step loop, registry, config, Engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernel.async_engine import AsyncEngine
    from kernel.engine import Engine

__all__ = ["AsyncEngine", "Engine"]


def __getattr__(name: str) -> Any:
    # Lazy: `import kernel.config` must not pull in torch and the model code.
    if name == "Engine":
        from kernel.engine import Engine

        return Engine
    if name == "AsyncEngine":
        from kernel.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
