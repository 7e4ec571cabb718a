"""A trap for host reads of tensors: inside `trap_host_reads`, every call that reads a
tensor's values on the host (on CUDA: waits for the device) raises `HostRead`."""

from __future__ import annotations

from typing import Any

import pytest
import torch

HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


class HostRead(AssertionError):
    """A tensor was read on the host where nothing may be."""


def trap_host_reads(mp: pytest.MonkeyPatch, where: str) -> None:
    """Make every Tensor method of HOST_READS raise HostRead naming `where` (undone with `mp`)."""
    for name in HOST_READS:
        def trap(self: torch.Tensor, *args: Any, _name: str = name, **kwargs: Any) -> Any:
            raise HostRead(f"Tensor.{_name} during {where}")
        mp.setattr(torch.Tensor, name, trap)
