"""When cached pages move between tiers (registry kinds `tier_write`, `tier_prefetch`;
YAML `hicache.write_policy`, `hicache.prefetch_policy`; implementations in
handlers/tier_*.py). The host tier (kernel/tiers/host_tier.py) asks; policies only answer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class WritePolicy(ABC):
    """Whether a cached, device-resident node should get a host copy now.

    Contract: `should_copy` is pure and cheap (it runs for the nodes on a request's path
    after every insert); it sees the node's hit count only. A policy with `on_evict`
    True is asked nothing at insert time: instead, whenever free device pages fall below
    `hicache.write_back_headroom` of the pool, the nodes eviction would take next are
    copied first (and so move to host instead of being dropped). Built with the hicache
    config's fields as keyword arguments, which it may ignore.
    """

    on_evict = False

    def __init__(self, **config: object) -> None:
        self.config = config

    @abstractmethod
    def should_copy(self, hit_count: int) -> bool: ...


class PrefetchPolicy(ABC):
    """How long a request whose prefix is on host waits for it to be loaded back before
    it computes the rest itself (the load still completes and serves later requests).

    Contract: `budget_s(num_tokens)` is pure: 0 means do not wait, `inf` wait until done.
    """

    def __init__(self, **config: object) -> None:
        self.config = config

    @abstractmethod
    def budget_s(self, num_tokens: int) -> float: ...
