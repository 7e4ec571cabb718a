"""Offline Engine: a synchronous face over AsyncEngine, whose loop runs in its own thread.

    from kernel import Engine
    engine = Engine(config="config/default.yaml", overrides={"cache.page_size": 16})
    out = engine.generate(["The capital of France is"], {"max_new_tokens": 8, "temperature": 0})
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, TypeVar

import structlog
import uvloop

from kernel.async_engine import AsyncEngine
from kernel.config import Config
from kernel.sampling_params import SamplingParams

T = TypeVar("T")
log = structlog.get_logger("tierserve")

Prompt = str | Sequence[int]
Params = Mapping[str, Any] | None


class Engine:
    def __init__(self, config: Config | str | None = None, overrides: Mapping[str, Any] | None = None) -> None:
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tierserve-loop", daemon=True)
        self._thread.start()
        self.engine: AsyncEngine = self._call(AsyncEngine.create(config, overrides))
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: Params | Sequence[Params] = None
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """One dict per prompt ({text, output_ids, meta_info}); a single prompt gives one dict."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and len(prompts) > 0 and isinstance(prompts[0], int)
        )
        batch: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item,arg-type]
        if sampling_params is None or isinstance(sampling_params, Mapping):
            params_list: list[Params] = [sampling_params] * len(batch)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(batch):
                raise ValueError(f"{len(batch)} prompts but {len(params_list)} sampling_params")
        results = self._call(self._generate_all(batch, params_list))
        return results[0] if single else results

    async def _generate_all(self, prompts: list[Prompt], params: list[Params]) -> list[dict[str, Any]]:
        # Validate every prompt before queueing any, so a bad one changes nothing.
        parsed = [SamplingParams.from_dict(p) for p in params]
        await self.engine.prepare_grammars(parsed)  # a bad grammar raises here, before any is queued
        rids: list[str] = []
        try:
            for prompt, p in zip(prompts, parsed):
                rids.append(self.engine.add_request(prompt, p))
        except Exception:
            for rid in rids:
                self.engine.abort(rid)
            raise
        return list(await asyncio.gather(*(self.engine.collect(rid) for rid in rids)))

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refuses (False, with a logged reason) while requests run."""
        ok, reason = self._call(self._flush())
        if not ok:
            log.warning("flush_refused", reason=reason)
        return ok

    async def _flush(self) -> tuple[bool, str]:
        await self.engine.settle_copies()  # tier copies in flight hold cached nodes
        return self.engine.flush_cache()  # on the loop thread, which owns the cache

    def shutdown(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self.engine.shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    def __enter__(self) -> Engine:  # noqa: PYI034 - Engine is not meant to be subclassed
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _call(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]
