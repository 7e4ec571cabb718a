"""Tiny random hybrid checkpoints for the tests: the product's builders (gpu/loader/random_models.py,
which `model.path: random:<architecture>` uses too)."""

from gpu.loader.random_models import (
    VOCAB,
    build_tiny_lfm2,
    build_tiny_lfm2_moe,
    build_tiny_qwen3_5,
    build_tiny_qwen3_5_moe,
    build_tiny_qwen3_next,
)

__all__ = ["VOCAB", "build_tiny_lfm2", "build_tiny_lfm2_moe", "build_tiny_qwen3_5", "build_tiny_qwen3_5_moe", "build_tiny_qwen3_next"]
