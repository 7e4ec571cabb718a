"""The host-side control of a static-shape forward: what a CUDA graph freezes at capture.

A captured graph replays kernels with the launch parameters and Python decisions of its
capture. The tensors it reads are registered buffers (gpu/graphs/static_buffers.py); what
else the forward decides by is plain host values: the attention backend's scalar
attributes after `bind_static` (grid extents, split sizes, ...) and, for hybrid models,
the step's lengths and tracked points. `control_of` collects them; a replay whose control
differs from its bucket's capture would run another step's kernels, so it is an error
(checked in emulation too, so CPU tests catch a backend that binds a per-step value).

NOTE: hybrid prefill buckets branch on each request's length by design; they are never
captured (only emulated), so their step control is not compared. Hybrid verify buckets
read the lengths from a registered buffer (HybridStep.static_lens): their control is the
static steps and request slots alone.
"""

from __future__ import annotations

from typing import Any

from gpu.attention.base import AttentionBackend
from gpu.graphs.static_buffers import StaticBufferError
from gpu.models.hybrid_step import HybridStep

_PLAIN = (int, float, bool, str, type(None))


def _plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def control_of(attention: AttentionBackend, step: HybridStep | None, kind: str) -> dict[str, Any]:
    """The plain values the bucket's forward decides by (see the module docstring)."""
    control = {f"attention.{k}": v for k, v in vars(attention).items() if _plain(v)}
    if step is not None and kind == "decode":
        control.update({"step.extend_lens": step.extend_lens, "step.track_points": step.track_points})
    elif step is not None and kind == "verify":  # the lengths are a buffer: only the shape is frozen
        control.update({"step.static_steps": step.static_steps, "step.slots": len(step.extend_lens)})
    return control


def check_control(live: dict[str, Any], captured: dict[str, Any], bucket: object) -> None:
    if live != captured:
        changed = sorted(k for k in live.keys() | captured.keys() if live.get(k) != captured.get(k))
        detail = {k: (captured.get(k), live.get(k)) for k in changed}
        raise StaticBufferError(f"{bucket}: host-side control differs from its capture (captured, live): {detail}")
