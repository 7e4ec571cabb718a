"""Architecture hyper-parameters of a loaded checkpoint, independent of its file format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str  # registry name of kind "model": "llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen3_5_text",
    # "qwen3_5_moe_text", "qwen3_next", "lfm2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on per-head q and k
    rope_scaling: dict[str, Any] | None = None
    # Hybrid models (attention + linear-attention / conv layers). None: every layer is
    # attention. Otherwise one entry per layer: "full_attention", or the non-attention
    # kind ("linear_attention" for Qwen3.5's Gated DeltaNet, "conv" for LFM2).
    layer_types: tuple[str, ...] | None = None
    partial_rotary_factor: float = 1.0  # fraction of head_dim that RoPE rotates
    conv_kernel: int = 0  # causal conv width of the linear/conv layers
    conv_bias: bool = False  # LFM2: bias on the conv and its projections
    linear_num_key_heads: int = 0  # Gated DeltaNet heads and dims
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # Mixture of experts (gpu/moe/): routed experts per sparse layer, each an MLP of
    # moe_intermediate_size; `sparse_layers` lists the layers whose MLP is the MoE block.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1
    moe_routing: str = "softmax"  # "softmax" (Qwen3-MoE family, Mixtral) or "sigmoid" (LFM2-MoE)
    routed_scaling_factor: float = 1.0  # sigmoid routing: the weights' final scale
    expert_bias: bool = True  # sigmoid routing: add the checkpoint's expert_bias where it has one (use_expert_bias)
    sparse_layers: tuple[int, ...] = ()

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache (all of them for a non-hybrid model)."""
        if self.layer_types is None:
            return self.num_layers
        return sum(1 for t in self.layer_types if t == "full_attention")
