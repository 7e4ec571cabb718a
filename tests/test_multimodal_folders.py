"""The hub's Qwen3.5 folders are multimodal (Qwen3_5(Moe)ForConditionalGeneration): the
text model's config under text_config, its weights under model.language_model., a vision
tower and a multi-token-prediction head beside them. tierserve serves the text model:
teacher-forced against transformers reading the same folder (float32, bound 1e-3 as in
tests/test_hybrid_moe.py), the vision and MTP tensors left unread."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu.loader.hf import load_hf_folder
from gpu.loader.random_models import build_tiny_qwen3_5_multimodal
from tests.hybrid_driver import load_model, reference_generate, teacher_forced_error

PROMPTS = [[(5 * j + 2 * i + 3) % 384 for j in range(n)] for i, n in enumerate((45, 23))]
CHUNKS = [[20, 25], [16, 7]]
NUM_DECODE = 8


@pytest.fixture(scope="module", params=[False, True], ids=["qwen3_5", "qwen3_5_moe"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[bool, str]:
    moe = bool(request.param)
    return moe, str(build_tiny_qwen3_5_multimodal(tmp_path_factory.mktemp("vlm"), 0, moe=moe))


def test_the_text_model_is_read(folder: tuple[bool, str]) -> None:
    moe, path = folder
    assert "text_config" in (Path(path) / "config.json").read_text()
    checkpoint = load_hf_folder(path, torch.float32)
    assert checkpoint.arch.architecture == ("qwen3_5_moe_text" if moe else "qwen3_5_text")
    assert checkpoint.arch.num_experts == (6 if moe else 0)
    names = list(checkpoint.weights)
    assert "model.embed_tokens.weight" in names and "model.layers.0.input_layernorm.weight" in names
    assert not [n for n in names if n.startswith(("model.language_model.", "model.visual.", "mtp."))]


def test_teacher_forced_matches_transformers(folder: tuple[bool, str]) -> None:
    _, path = folder
    reference = reference_generate(path, PROMPTS, NUM_DECODE)  # transformers' own multimodal class
    worst, flips, _ = teacher_forced_error(load_model(path), PROMPTS, CHUNKS, NUM_DECODE, reference)
    assert worst < 1e-3 and flips == 0, (worst, flips)
