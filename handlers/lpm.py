"""Longest prefix match first: admit the requests with the most cached tokens first, so
hot prefixes are used while they are still cached. Above `lpm_fallback_queue` waiting
requests the probes cost more than they save: fall back to arrival order."""

from __future__ import annotations

from collections.abc import Sequence

from handlers.fcfs import FCFS
from kernel.registry import register
from kernel.request import Request
from kernel.scheduling.policy import SchedulePolicy
from kernel.scheduling.prefix_reuse import PrefixReuse


@register("schedule", "lpm")
class LongestPrefixMatch(SchedulePolicy):
    def order(self, waiting: Sequence[Request], prefix: PrefixReuse) -> list[Request]:
        limit = int(self.config.get("lpm_fallback_queue", 128))  # type: ignore[call-overload]
        if len(waiting) > limit:
            return FCFS().order(waiting, prefix)
        cached = {id(r): prefix.probe(r).length for r in waiting}
        return sorted(waiting, key=lambda r: (-cached[id(r)], r.arrival))
