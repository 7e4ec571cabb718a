"""Abstract bases of the policy handlers the kernel calls (implementations: handlers/)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kernel.request import Request


class SchedulePolicy(ABC):
    """Orders waiting requests for admission.

    Contract: `order` returns the same requests (a permutation), is pure with respect to
    the scheduler's state, and must be cheap: it runs every step the queue is non-empty.
    Admission stops at the first request in this order that cannot be admitted, so a
    policy also decides who waits behind whom.
    """

    @abstractmethod
    def order(self, waiting: Sequence[Request]) -> list[Request]: ...
