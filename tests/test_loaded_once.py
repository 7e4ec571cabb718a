"""tests/loaded_once.py, the suite's cache of the packaged file: each engine gets its own copy,
and a monkeypatched loader is never served from it."""

from __future__ import annotations

import pytest
import torch

from gpu.loader import gguf
from kernel import model_build
from tests.conftest import SMOLLM


def test_each_load_is_a_copy_of_its_own() -> None:
    first = model_build.load_checkpoint(SMOLLM, torch.float32, keep_blocks=True)
    name = "model.layers.0.self_attn.q_proj.weight"
    want = first.weights[name].clone()
    first.weights[name].zero_()
    next(iter(first.blocks.values())).data.zero_()
    second = model_build.load_checkpoint(SMOLLM, torch.float32, keep_blocks=True)
    assert torch.equal(second.weights[name], want)
    assert next(iter(second.blocks.values())).data.any()
    assert second.tokenizer is not first.tokenizer and second.tokenizer is not None


def test_a_patched_loader_loads_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    model_build.load_checkpoint(SMOLLM, torch.float32)  # cached, if it was not
    calls: list[str] = []
    real = gguf.to_torch

    def counted(t: object, dtype: torch.dtype) -> torch.Tensor:
        calls.append(t.name)  # type: ignore[attr-defined]
        return real(t, dtype)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf, "to_torch", counted)
    model_build.load_checkpoint(SMOLLM, torch.float32)
    assert calls  # the patched function ran: the file was read, not the cache
