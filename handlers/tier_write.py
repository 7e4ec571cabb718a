"""Write policies of the host tier: `write_through` copies every cached node to host as
soon as it is cached; `write_through_selective` only once it has been hit
`hicache.write_threshold` times (hot prefixes only, less copy traffic); `write_back`
only what is about to be evicted (least copy traffic while the device pool has room)."""

from __future__ import annotations

from kernel.registry import register
from kernel.tiers.tier_policy import WritePolicy


@register("tier_write", "write_through")
class WriteThrough(WritePolicy):
    def should_copy(self, hit_count: int) -> bool:
        return True


@register("tier_write", "write_through_selective")
class WriteThroughSelective(WritePolicy):
    def should_copy(self, hit_count: int) -> bool:
        return hit_count >= int(self.config.get("write_threshold", 2))  # type: ignore[call-overload]


@register("tier_write", "write_back")
class WriteBack(WritePolicy):
    on_evict = True

    def should_copy(self, hit_count: int) -> bool:
        return False
