"""First come, first served: admit in arrival order (retracted requests keep theirs)."""

from __future__ import annotations

from collections.abc import Sequence

from kernel.policy import SchedulePolicy
from kernel.prefix_reuse import PrefixReuse
from kernel.registry import register
from kernel.request import Request


@register("schedule", "fcfs")
class FCFS(SchedulePolicy):
    def order(self, waiting: Sequence[Request], prefix: PrefixReuse) -> list[Request]:
        return sorted(waiting, key=lambda r: r.arrival)
