"""The hub's Qwen3.5 folders are multimodal (Qwen3_5(Moe)ForConditionalGeneration): the
text model's config under text_config, its weights under model.language_model., a vision
tower and a multi-token-prediction head beside them. tierserve serves the text model:
teacher-forced against transformers reading the same folder (float32, bound 1e-3 as in
tests/test_hybrid_moe.py), the vision and MTP tensors left unread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpu.loader.hf import load_hf_folder
from gpu.loader.random_models import build_tiny_qwen3_5_multimodal
from tests.hybrid_driver import load_model, reference_generate, teacher_forced_error

PROMPTS = [[(5 * j + 2 * i + 3) % 384 for j in range(n)] for i, n in enumerate((45, 23))]
CHUNKS = [[20, 25], [16, 7]]
NUM_DECODE = 8


# Qwen3.5 with its head tied to the embeddings (as the small hub models are: transformers
# writes true at the top level and text_config's default, false, beside it), Qwen3.5-MoE untied.
@pytest.fixture(scope="module", params=[False, True], ids=["qwen3_5-tied", "qwen3_5_moe"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[bool, str]:
    moe = bool(request.param)
    return moe, str(build_tiny_qwen3_5_multimodal(tmp_path_factory.mktemp("vlm"), 0, moe=moe, tied=not moe))


def test_the_text_model_is_read(folder: tuple[bool, str]) -> None:
    moe, path = folder
    config = json.loads((Path(path) / "config.json").read_text())
    assert config["tie_word_embeddings"] is not moe and config["text_config"]["tie_word_embeddings"] is False
    checkpoint = load_hf_folder(path, torch.float32)
    assert checkpoint.arch.architecture == ("qwen3_5_moe_text" if moe else "qwen3_5_text")
    assert checkpoint.arch.num_experts == (6 if moe else 0)
    assert checkpoint.arch.tie_word_embeddings is not moe and ("lm_head.weight" in checkpoint.weights) is moe
    names = list(checkpoint.weights)
    assert "model.embed_tokens.weight" in names and "model.layers.0.input_layernorm.weight" in names
    assert not [n for n in names if n.startswith(("model.language_model.", "model.visual.", "mtp."))]


def test_teacher_forced_matches_transformers(folder: tuple[bool, str]) -> None:
    """Against the folder's own class (Qwen3_5(Moe)ForConditionalGeneration, text only):
    AutoModelForCausalLM would load the text class, which reads text_config's flag and
    leaves a tied model's head untied and random."""
    _, path = folder
    import transformers

    architecture = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    reference = reference_generate(path, PROMPTS, NUM_DECODE, getattr(transformers, architecture))
    worst, flips, _ = teacher_forced_error(load_model(path), PROMPTS, CHUNKS, NUM_DECODE, reference)
    assert worst < 1e-3 and flips == 0, (worst, flips)
