"""Checkpoint names of the sparse blocks' experts, per architecture family (the model code and
the GGUF loader read the same table)."""

from __future__ import annotations

from typing import NamedTuple


class ExpertNames(NamedTuple):
    """Checkpoint names: the block after `model.layers.{i}.`, each expert's three projections."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


HF_NAMES = ExpertNames()  # Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE
MIXTRAL_NAMES = ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")
