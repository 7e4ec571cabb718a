"""The static-buffer registry: every buffer a captured graph reads, with its sentinel.

NOTE: invariant 5. A buffer is registered once, sized for the largest bucket, with
the sentinel its padding rows must hold (`seq_lens` -> its fill value, `out_cache_loc`
-> slot 0 of the reserved page, a state-track mask -> 0, track indices -> the reserved
state slot 0). `stage` is the only way in: it copies the live rows of *every*
registered buffer and resets rows [live:bucket) of *every* registered buffer, so no
per-buffer clean-up exists to forget, and it refuses a live value for a buffer that
was never registered (a graph would read something the registry does not reset) as
well as a registered buffer left without live rows (invariant 6: missing metadata is
an error, never zero-filled).

Rows are counted in named units (`tokens`, `requests`, and whatever a backend adds,
e.g. `tiles`); a bucket says how many rows of each unit its graph reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

Sentinel = int | float | bool


class BufferSpec(NamedTuple):
    """A static buffer: rows counted in `unit`, each row of shape `inner`."""

    unit: str
    inner: tuple[int, ...]
    dtype: torch.dtype
    sentinel: Sentinel


class StaticBufferError(RuntimeError):
    """A batch or a capture that does not match the registry (never silently padded)."""


class StaticBuffers:
    def __init__(self, max_rows: Mapping[str, int], device: torch.device) -> None:
        self.max_rows = dict(max_rows)
        self.device = device
        self.specs: dict[str, BufferSpec] = {}
        self.tensors: dict[str, torch.Tensor] = {}

    def register(self, name: str, spec: BufferSpec) -> torch.Tensor:
        if name in self.specs:
            raise StaticBufferError(f"static buffer {name!r} registered twice")
        if self.max_rows.get(spec.unit, 0) < 1:
            raise StaticBufferError(f"static buffer {name!r}: row unit {spec.unit!r} is unknown or empty")
        shape = (self.max_rows[spec.unit], *spec.inner)
        tensor = torch.full(shape, spec.sentinel, dtype=spec.dtype, device=self.device)
        self.specs[name] = spec
        self.tensors[name] = tensor
        return tensor

    def stage(self, live: Mapping[str, torch.Tensor], bucket: Mapping[str, int]) -> dict[str, torch.Tensor]:
        """Copy each buffer's live rows, reset rows [live:bucket) to its sentinel, and
        return the views [:bucket] a graph of this bucket reads."""
        unregistered = sorted(set(live) - set(self.specs))
        if unregistered:
            raise StaticBufferError(f"live values for unregistered static buffers: {unregistered}")
        missing = sorted(set(self.specs) - set(live))
        if missing:
            raise StaticBufferError(f"batch lacks metadata for static buffers {missing}")
        views: dict[str, torch.Tensor] = {}
        for name, spec in self.specs.items():
            rows = bucket[spec.unit]
            value = live[name]
            n = value.shape[0]
            if n > rows or tuple(value.shape[1:]) != spec.inner:
                raise StaticBufferError(
                    f"static buffer {name!r}: live shape {tuple(value.shape)} does not fit "
                    f"[{rows}, *{spec.inner}]"
                )
            tensor = self.tensors[name]
            tensor[:n].copy_(value)
            self.reset_tail(name, n, rows)
            views[name] = tensor[:rows]
        return views

    def reset_tail(self, name: str, live: int, rows: int) -> None:
        """Rows [live:rows) of buffer `name` back to its sentinel (padding rows)."""
        self.tensors[name][live:rows].fill_(self.specs[name].sentinel)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is (a view of) a registered buffer."""
        ptr = tensor.untyped_storage().data_ptr()
        return ptr != 0 and any(t.untyped_storage().data_ptr() == ptr for t in self.tensors.values())
