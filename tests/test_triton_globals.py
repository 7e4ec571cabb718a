"""Every `@triton.jit` function under gpu/ reads only module globals that compiled Triton
accepts.

Compiled Triton resolves a name a kernel reads from its module's globals only when the
value is a `tl.constexpr(...)`, a module, another jitted function, or one of triton's own
objects (dtypes, builtins, namedtuples); a plain `_NEG = -1.0e30` or `_PRECISION = "ieee"`
is a NameError ("Cannot access global variable ...") when the kernel is first compiled on
a GPU (triton/compiler/code_generator.py, `global_lookup`). The Triton interpreter, which
runs the kernels on CPU (TRITON_INTERPRET=1), executes the Python function as it is and
reads any global, so the suite on CPU never sees that error. Checked here statically: each
kernel's code (its nested code objects too) is scanned for global loads (LOAD_GLOBAL), each
resolved in the kernel's `__globals__` and judged by compiled Triton's rule. Planted: a
global put back to a plain float, a plain Python helper called from a kernel.
"""

from __future__ import annotations

import dis
import importlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from types import CodeType, FunctionType, ModuleType
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # as the other triton tests: set before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.runtime import jit as triton_jit

ROOT = Path(__file__).resolve().parent.parent
JIT_DECORATOR = re.compile(r"^\s*@triton\.jit\b", re.MULTILINE)

# What a kernel is, compiled (JITFunction; JITCallable in newer triton) or interpreted.
_JIT_TYPES: tuple[type, ...] = tuple(
    t for t in (getattr(triton_jit, "JITCallable", None), triton_jit.JITFunction) if t is not None
)
try:
    from triton.runtime.interpreter import InterpretedFunction

    _JIT_TYPES += (InterpretedFunction,)
except ImportError:  # pragma: no cover - older triton
    pass


def is_kernel(obj: Any) -> bool:
    return isinstance(obj, _JIT_TYPES)


def python_function(obj: Any) -> FunctionType:
    """The Python function under a jitted object (through autotune / heuristics wrappers)."""
    while not isinstance(obj, FunctionType):
        obj = obj.fn
    return obj


def triton_modules() -> Iterator[ModuleType]:
    """The modules under gpu/ that jit a kernel (imported as the engine imports them)."""
    for path in sorted((ROOT / "gpu").rglob("*.py")):
        if JIT_DECORATOR.search(path.read_text()):
            yield importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))


def kernels_of(module: ModuleType) -> dict[str, Any]:
    """The module's jitted functions defined in it (wrappers such as triton.autotune included)."""
    found = {}
    for name, obj in vars(module).items():
        inner, jitted = obj, False
        while hasattr(inner, "fn") and not isinstance(inner, FunctionType):
            jitted = jitted or is_kernel(inner)
            inner = inner.fn
        if jitted and isinstance(inner, FunctionType) and inner.__module__ == module.__name__:
            found[name] = obj
    return found


def global_loads(code: CodeType) -> Iterator[str]:
    """Names the code reads as globals (LOAD_GLOBAL), nested code objects included."""
    for ins in dis.get_instructions(code):
        if ins.opname == "LOAD_GLOBAL":
            yield str(ins.argval)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from global_loads(const)


def allowed_in_compiled_triton(value: Any) -> bool:
    """triton/compiler/code_generator.py `global_lookup`: the globals a compiled kernel may read."""
    return (
        isinstance(value, (ModuleType, tl.constexpr, tl.dtype))
        or is_kernel(value)
        or getattr(value, "__triton_builtin__", False)
        or getattr(value, "__triton_aggregate__", False)
        or str(getattr(value, "__module__", "")).startswith("triton.language")
        or (isinstance(value, tuple) and hasattr(type(value), "_fields"))  # a namedtuple
    )


def rejected_globals(kernel: Any) -> list[str]:
    """'name: type' of each global the kernel reads that compiled Triton would refuse."""
    fn = python_function(kernel)
    bad = []
    for name in sorted(set(global_loads(fn.__code__))):
        if name not in fn.__globals__:
            continue  # a builtin (range, float, min): Triton's builtin namespace or the AST's
        value = fn.__globals__[name]
        if not allowed_in_compiled_triton(value):
            bad.append(f"{name}: {type(value).__name__} {value!r:.60}")
    return bad


def all_kernels() -> dict[str, Any]:
    return {f"{m.__name__}.{name}": k for m in triton_modules() for name, k in kernels_of(m).items()}


def test_every_triton_module_is_scanned() -> None:
    """The scan finds every kernel: as many as the modules have `@triton.jit` decorators
    (a kernel made inside a factory would not be a module global, and would be missed)."""
    modules = list(triton_modules())
    assert any(m.__name__ == "gpu.kernels.triton_attention" for m in modules)
    for module in modules:
        assert module.__file__ is not None
        decorated = len(JIT_DECORATOR.findall(Path(module.__file__).read_text()))
        assert len(kernels_of(module)) == decorated, (module.__name__, sorted(kernels_of(module)))


def test_kernels_read_only_globals_compiled_triton_accepts() -> None:
    kernels = all_kernels()
    assert kernels
    bad = {name: rejected for name, k in kernels.items() if (rejected := rejected_globals(k))}
    assert not bad, f"globals a compiled @triton.jit kernel cannot read (make them tl.constexpr): {bad}"


def test_red_a_plain_float_global(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: `_NEG` back to a plain float (what compiled Triton rejected on the GPU)."""
    from gpu.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "_NEG", -1.0e30)
    monkeypatch.setattr(triton_attention, "_PRECISION", "ieee")
    rejected = {name: rejected_globals(k) for name, k in kernels_of(triton_attention).items()}
    assert any(r.startswith("_NEG: float") for r in rejected["_decode_split_kernel"]), rejected
    assert any(r.startswith("_NEG: float") for r in rejected["_extend_kernel"]), rejected
    assert any(r.startswith("_PRECISION: str") for r in rejected["_attend_keys"]), rejected
    with pytest.raises(AssertionError, match="_NEG"):
        test_kernels_read_only_globals_compiled_triton_accepts()


def test_red_a_plain_python_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a kernel global that is a plain (not jitted) Python function, or an int."""
    from gpu.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "_attend_keys", python_function(triton_attention._attend_keys))
    monkeypatch.setattr(triton_attention, "tl", 3)
    rejected = rejected_globals(triton_attention._extend_kernel)
    assert any(r.startswith("_attend_keys: function") for r in rejected), rejected
    assert any(r.startswith("tl: int") for r in rejected), rejected
