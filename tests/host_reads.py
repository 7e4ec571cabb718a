"""Traps for host traffic of tensors, the CPU stand-in for CUDA's sync checks.

`trap_host_reads`: inside it, everything that reads a tensor's values on the host (on
CUDA: waits for the device) raises `HostRead` - the reads proper (`tolist`, `item`,
`bool`, ...), the ops whose output size depends on the values (`nonzero`, `unique`,
`masked_select`, one-argument `torch.where`, boolean-mask indexing, `repeat_interleave`
by a tensor without `output_size`), and the uploads that block on CUDA (indexing with a
host list, `torch.tensor` / `torch.as_tensor` straight onto a device).

`trap_host_tensors` adds, for a captured forward, every tensor made from host values
(the graph would freeze the capture's): `torch.tensor`, `as_tensor`, `asarray`,
`from_numpy`, `scalar_tensor`, and `full` / `full_like` / `new_full` / `new_tensor` /
`fill_` with a Python int or bool (counts, lengths, slots, positions). A float fill is a
numeric constant of the forward (a running max's start) and passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
# Tensor methods and torch functions whose output shape is the data's: a device sync.
VALUE_SHAPED = ("nonzero", "argwhere", "unique", "unique_consecutive", "masked_select")
HOST_CONSTRUCTORS = ("tensor", "as_tensor", "asarray", "from_numpy", "scalar_tensor")
INT_FILLS = {"full": 1, "full_like": 1}  # torch function -> index of its fill value
INT_FILL_METHODS = {"new_full": 1, "fill_": 0}  # Tensor method -> index of its fill value (after self)


class HostRead(AssertionError):
    """A tensor was read on the host (or made from host values) where nothing may be."""


def _refuse(what: str, where: str) -> Callable[..., Any]:
    def trap(*args: Any, **kwargs: Any) -> Any:
        raise HostRead(f"{what} during {where}")
    return trap


def _host_index(index: Any) -> str | None:
    """What in a subscript needs the host: a bool tensor (mask) or a host list."""
    parts = index if isinstance(index, tuple) else (index,)
    for part in parts:
        if isinstance(part, torch.Tensor) and part.dtype == torch.bool:
            return "boolean-mask indexing"
        if isinstance(part, list):
            return "indexing with a host list"
    return None


def _trap_indexing(mp: pytest.MonkeyPatch, where: str) -> None:
    real_get, real_set = torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def getitem(self: torch.Tensor, index: Any) -> Any:
        if (what := _host_index(index)) is not None:
            raise HostRead(f"{what} during {where}")
        return real_get(self, index)

    def setitem(self: torch.Tensor, index: Any, value: Any) -> None:
        if (what := _host_index(index)) is not None:
            raise HostRead(f"{what} during {where}")
        real_set(self, index, value)

    mp.setattr(torch.Tensor, "__getitem__", getitem)
    mp.setattr(torch.Tensor, "__setitem__", setitem)


def _trap_value_shaped(mp: pytest.MonkeyPatch, where: str) -> None:
    for name in VALUE_SHAPED:
        mp.setattr(torch.Tensor, name, _refuse(f"Tensor.{name}", where))
        mp.setattr(torch, name, _refuse(f"torch.{name}", where))
    real_where = torch.where

    def where_(condition: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs:
            raise HostRead(f"torch.where with one argument during {where}")
        return real_where(condition, *args, **kwargs)

    mp.setattr(torch, "where", where_)
    for owner, prefix in ((torch, "torch"), (torch.Tensor, "Tensor")):
        real = owner.repeat_interleave
        mp.setattr(owner, "repeat_interleave", _sized_repeat(real, f"{prefix}.repeat_interleave", where))


def _sized_repeat(real: Callable[..., Any], name: str, where: str) -> Callable[..., Any]:
    def repeat(input_: Any, repeats: Any = None, *args: Any, **kwargs: Any) -> Any:
        by_tensor = isinstance(repeats, torch.Tensor) or repeats is None  # (repeats,) alone: a tensor
        if by_tensor and kwargs.get("output_size") is None:
            raise HostRead(f"{name} by a tensor without output_size during {where}")
        return real(input_, *args, **kwargs) if repeats is None else real(input_, repeats, *args, **kwargs)
    return repeat


def _trap_device_uploads(mp: pytest.MonkeyPatch, where: str) -> None:
    for name in ("tensor", "as_tensor"):
        real = getattr(torch, name)

        def upload(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            if kwargs.get("device") is not None and not isinstance(args[0] if args else None, torch.Tensor):
                raise HostRead(f"torch.{_name} onto a device from host values during {where}")
            return _real(*args, **kwargs)

        mp.setattr(torch, name, upload)


def trap_host_reads(mp: pytest.MonkeyPatch, where: str) -> None:
    """Make every host read of a tensor raise HostRead naming `where` (undone with `mp`)."""
    for name in HOST_READS:
        mp.setattr(torch.Tensor, name, _refuse(f"Tensor.{name}", where))
    _trap_value_shaped(mp, where)
    _trap_indexing(mp, where)
    _trap_device_uploads(mp, where)


def _int_fill(real: Callable[..., Any], name: str, at: int, where: str) -> Callable[..., Any]:
    def fill(*args: Any, **kwargs: Any) -> Any:
        value = args[at] if len(args) > at else kwargs.get("fill_value", kwargs.get("value"))
        if isinstance(value, int):  # bool too
            raise HostRead(f"{name} with a host value during {where}")
        return real(*args, **kwargs)
    return fill


def trap_host_tensors(mp: pytest.MonkeyPatch, where: str) -> None:
    """trap_host_reads, and every tensor made from host values raises HostRead too."""
    trap_host_reads(mp, where)
    for name in HOST_CONSTRUCTORS:
        real = getattr(torch, name)

        def construct(data: Any = None, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            if _name == "as_tensor" and isinstance(data, torch.Tensor):
                return _real(data, *args, **kwargs)  # a tensor already: no host values
            raise HostRead(f"torch.{_name} during {where}")

        mp.setattr(torch, name, construct)
    for name, at in INT_FILLS.items():
        mp.setattr(torch, name, _int_fill(getattr(torch, name), f"torch.{name}", at, where))
    for name, at in INT_FILL_METHODS.items():
        mp.setattr(torch.Tensor, name, _int_fill(getattr(torch.Tensor, name), f"Tensor.{name}", at + 1, where))
    mp.setattr(torch.Tensor, "new_tensor", _refuse("Tensor.new_tensor", where))
