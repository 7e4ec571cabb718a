"""Llama, Qwen2 (QKV bias), Qwen3 (QK-norm, head_dim != hidden/heads) and Qwen3-MoE (sparse
and dense layers, top-3 of 6 experts) and Mixtral (top-2 of 5) from Hugging Face folders match transformers, teacher-forced (tests/numerics_compare.py): transformers' greedy
tokens scored by the engine and the engine's scored by transformers, float32 both. Measured on
an AMD EPYC AVX2, model.cpu_kernels auto and off alike: mean |Δ logprob| <= 1.1e-7, p99 and max
4.8e-7; the same on an Intel Xeon AVX-512/BF16/AMX (mean <= 1.1e-7, max 4.8e-7). Bounds: mean < 1e-5, p99 < 1e-4, every top-1 equal past a 1e-3 margin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernel import Engine
from tests.conftest import FLOAT32
from tests.numerics_compare import Bounds, against_transformers, check_report
from tests.tiny_models import VOCAB, build_tiny

BOUNDS = Bounds(mean=1e-5, p99=1e-4, agreement=1.0, gap=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_tiny_checkpoint_matches_transformers(arch: str, tmp_path: Path) -> None:
    folder = build_tiny(arch, tmp_path / arch)
    if arch == "qwen3":  # the checkpoint exercises an explicit head_dim
        config = json.loads((folder / "config.json").read_text())
        assert config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]
    prompts = [[(i * 37 + j) % VOCAB for j in range(n)] for i, n in enumerate((3, 17, 40))]
    engine = Engine(
        None,
        {
            **FLOAT32,
            "model.path": str(folder),
            "cache.num_pages": 64,
            "cache.page_size": 4,
            "scheduler.chunked_prefill_size": 16,  # 17- and 40-token prompts are chunked
            "scheduler.max_num_batched_tokens": 32,
            "debug.check_invariants": True,
        },
    )
    try:
        report = against_transformers(engine, folder, prompts, BOUNDS.gap)
    finally:
        engine.shutdown()
    check_report(report, BOUNDS)
