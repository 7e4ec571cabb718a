"""First come, first served: admit in arrival order (retracted requests keep theirs)."""

from __future__ import annotations

from collections.abc import Sequence

from kernel.registry import register
from kernel.request import Request
from kernel.scheduling.policy import SchedulePolicy
from kernel.scheduling.prefix_reuse import PrefixReuse


@register("schedule", "fcfs")
class FCFS(SchedulePolicy):
    def order(self, waiting: Sequence[Request], prefix: PrefixReuse) -> list[Request]:
        return sorted(waiting, key=lambda r: r.arrival)
