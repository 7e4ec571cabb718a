"""First come, first served: admit in arrival order (retracted requests keep theirs)."""

from __future__ import annotations

from collections.abc import Sequence

from cache.prefix_cache import PrefixCache
from kernel.policy import SchedulePolicy
from kernel.registry import register
from kernel.request import Request


@register("schedule", "fcfs")
class FCFS(SchedulePolicy):
    def order(self, waiting: Sequence[Request], cache: PrefixCache) -> list[Request]:
        return sorted(waiting, key=lambda r: r.arrival)
