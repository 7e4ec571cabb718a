"""Host values to the device without a host<->device synchronization.

`torch.tensor(values, device=cuda)` and `cpu_tensor.to(cuda)` from pageable memory are
blocking copies: the host waits until the stream has run everything queued before the
copy, which on the device thread means waiting for the previous step and losing the
overlap of a step's Python launch work with the GPU. Here the values go through a pinned
block of torch's caching host allocator and are copied with non_blocking=True on the
current stream.

NOTE: reusing a pinned block is safe without any bookkeeping of ours: the allocator
records an event on the copy's stream and hands the block out again only after that
event completed. On CPU these are the plain constructors (no pinning, no copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)`, asynchronous on CUDA."""
    return copy_to_device(torch.tensor(values, dtype=dtype), device)


def copy_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`, copied from pinned memory without blocking on CUDA."""
    if device.type == "cpu":
        return host
    if device.type != "cuda":
        return host.to(device)
    # `host` is the caller's fresh tensor: pin_memory copies it into an allocator block.
    return host.pin_memory().to(device, non_blocking=True)
