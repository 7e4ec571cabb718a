"""The in-memory form every loader returns (gpu/loader/gguf.py, gpu/loader/hf.py)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch

from gpu.model_config import ModelArchConfig
from gpu.quant.gguf_blocks import Q4Blocks
from gpu.tokenizer import Tokenizer


class Checkpoint(NamedTuple):
    arch: ModelArchConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    # Raw GGUF Q4_0/Q4_1 blocks of the 2-D weights stored that way (only when asked for:
    # the 4-bit linears serve them as they are), rows in the same order as `weights`.
    blocks: Mapping[str, Q4Blocks] = MappingProxyType({})
