"""Abstract bases of the policy handlers the kernel calls (implementations: handlers/)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kernel.request import Request
from kernel.scheduling.prefix_reuse import PrefixReuse


class SchedulePolicy(ABC):
    """Orders waiting requests for admission.

    Contract: `order` returns the same requests (a permutation), changes no request and
    uses the cache only through `prefix.probe(req)` (which locks and counts nothing), and must be cheap:
    it runs every step the queue is non-empty. Admission stops at the first request in
    this order that cannot be admitted, so a policy also decides who waits behind whom.
    Handlers are built with the scheduler config as keyword arguments they may ignore.
    """

    def __init__(self, **config: object) -> None:
        self.config = config

    @abstractmethod
    def order(self, waiting: Sequence[Request], prefix: PrefixReuse) -> list[Request]: ...
