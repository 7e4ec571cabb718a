"""Prefetch policies of the host tier: `best_effort` never waits (the load helps later
requests), `wait_complete` always waits, `timeout` waits a budget that grows with the
number of tokens loaded (`hicache.prefetch_timeout_s` + per-token seconds)."""

from __future__ import annotations

import math

from kernel.registry import register
from kernel.tiers.tier_policy import PrefetchPolicy


@register("tier_prefetch", "best_effort")
class BestEffort(PrefetchPolicy):
    def budget_s(self, num_tokens: int) -> float:
        return 0.0


@register("tier_prefetch", "wait_complete")
class WaitComplete(PrefetchPolicy):
    def budget_s(self, num_tokens: int) -> float:
        return math.inf


@register("tier_prefetch", "timeout")
class Timeout(PrefetchPolicy):
    def budget_s(self, num_tokens: int) -> float:
        base = float(self.config.get("prefetch_timeout_s", 0.02))  # type: ignore[arg-type]
        per_token = float(self.config.get("prefetch_timeout_per_token_s", 2e-5))  # type: ignore[arg-type]
        return base + per_token * num_tokens
