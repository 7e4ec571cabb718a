"""Tiny random Hugging Face hybrid checkpoints (Qwen3.5 Gated DeltaNet, LFM2 short conv).

Both mix linear/conv layers with full-attention layers, use float32 and a small
vocabulary, and are seeded, so tests build them in well under a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 384

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}


def build_tiny_qwen3_5(folder: Path, seed: int = 0, max_positions: int = 1024) -> Path:
    """4 layers: linear, full, linear, linear; 2 key heads serve 4 value heads; dk != dv."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        **{**_COMMON, "max_position_embeddings": max_positions},
        intermediate_size=96,
        num_hidden_layers=4,
        head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config)
    _perturb(model)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def build_tiny_lfm2(folder: Path, seed: int = 0, max_positions: int = 1024) -> Path:
    """4 layers: conv, conv, attention, conv; the ff dim goes through LFM2's auto-adjust."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(
        **{**_COMMON, "max_position_embeddings": max_positions},
        intermediate_size=160,  # auto-adjusted: int(2 * 160 / 3) = 106 -> rounded up to 128
        block_multiple_of=32,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True,
        num_hidden_layers=4,
        layer_types=["conv", "conv", "full_attention", "conv"],
        conv_L_cache=3,
        conv_bias=True,
        norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    model = Lfm2ForCausalLM(config)
    _perturb(model)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _perturb(model: torch.nn.Module) -> None:
    """Weights large enough that every layer, and the carried state, moves the logits.

    transformers' init (std 0.02) leaves a tiny model's logits nearly flat and its conv
    and recurrent states almost irrelevant: a lost state would change logprobs by less
    than the test tolerance. Here matrices get std 1/sqrt(fan_in) (signals keep their
    scale through the layers), the output head is sharpened, norms and biases are
    random, and the DeltaNet decays are kept mild so state reaches across chunks.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.05, 2.0).log())
            elif name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif p.dim() >= 2:
                fan_in = p[0].numel()
                gain = 4.0 if name.startswith("lm_head") else 1.0
                p.normal_(0.0, gain / fan_in**0.5)
