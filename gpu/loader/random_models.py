"""Tiny checkpoints with random weights, in the Hugging Face format, built with transformers:
hybrid models (Qwen3.5 Gated DeltaNet, LFM2 short conv) and both with sparse MoE blocks
(Qwen3-Next, Qwen3.5-MoE, LFM2-MoE).

`model.path: random:<architecture>` (e.g. `random:qwen3_next`, `random:qwen3_next@7` for
seed 7) builds one on first use under ~/.cache/tierserve/random/ (or $TIERSERVE_CACHE), so
a launch file can exercise an architecture whose real weights are not at hand
(config/qwen3-next-seed.yaml); the tests build theirs in temporary folders. Each mixes
linear/conv layers with full-attention layers, uses float32 and a small vocabulary (token
ids only: no tokenizer), and is seeded: the same weights wherever torch's generator is
the same. Checkpoints that need a real tokenizer (llama.cpp's converter checks it:
benchmarks/moe.py, tests/test_moe_gguf.py) save one (`save_tokenizer`; the packaged SmolLM2's
is one the converter knows).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
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


def build_tiny_qwen3_5(folder: Path, seed: int = 0, max_positions: int = 1024,
                       shape: dict[str, Any] | None = None) -> Path:
    """4 layers: linear, full, linear, linear; 2 key heads serve 4 value heads; dk != dv.
    `shape`: config fields that replace these (e.g. head counts that split 3 ways)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**{**_qwen3_5_shape(max_positions), "intermediate_size": 96, **(shape or {})})
    return _save(Qwen3_5ForCausalLM, config, folder, seed)


_MOE: dict[str, Any] = {
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}


def build_tiny_qwen3_next(folder: Path, seed: int = 0, max_positions: int = 1024,
                          shape: dict[str, Any] | None = None) -> Path:
    """Qwen3.5's layers and shapes with sparse MoE blocks (6 experts, top 2, a gated shared
    expert) in layers 0, 1 and 3; layer 2 dense (mlp_only_layers). `shape`: config fields
    that replace these."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    fields = {**_qwen3_5_shape(max_positions), **_MOE, "intermediate_size": 96, "decoder_sparse_step": 1,
              "mlp_only_layers": [2], "norm_topk_prob": True}
    config = Qwen3NextConfig(**{**fields, **(shape or {})})
    return _save(Qwen3NextForCausalLM, config, folder, seed)


def build_tiny_qwen3_5_moe(folder: Path, seed: int = 0, max_positions: int = 1024,
                           shape: dict[str, Any] | None = None) -> Path:
    """Qwen3.5's layers and shapes, every MLP a sparse MoE block with a gated shared expert.
    `shape`: config fields that replace these."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    config = Qwen3_5MoeTextConfig(**{**_qwen3_5_shape(max_positions), **_MOE, **(shape or {})})
    return _save(Qwen3_5MoeForCausalLM, config, folder, seed)


def build_tiny_qwen3_5_multimodal(folder: Path, seed: int = 0, moe: bool = False, tied: bool = False) -> Path:
    """Qwen3.5 (or Qwen3.5-MoE) as the hub ships it: Qwen3_5(Moe)ForConditionalGeneration,
    the text model's config under text_config and its weights under model.language_model.,
    a (one-block) vision tower beside it, and a multi-token-prediction tensor in a shard of
    its own, as the hub's files carry one. `tied`: the head tied to the embeddings (the
    small Qwen3.5 models), which transformers records at the top level only."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

    text = {**_qwen3_5_shape(1024), **(_MOE if moe else {"intermediate_size": 96})}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": text["hidden_size"]}
    config_cls, model_cls = ((Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if moe
                             else (Qwen3_5Config, Qwen3_5ForConditionalGeneration))
    _save(model_cls, config_cls(text_config=text, vision_config=vision, tie_word_embeddings=tied), folder, seed)
    save_file({"mtp.fc.weight": torch.randn(text["hidden_size"], 2 * text["hidden_size"])}, str(folder / "mtp.safetensors"))
    return folder


def build_tiny_lfm2_moe(folder: Path, seed: int = 0, max_positions: int = 1024,
                        shape: dict[str, Any] | None = None) -> Path:
    """LFM2's layers (conv, conv, attention, conv); layer 0 dense, the rest sparse MoE blocks
    (6 experts, top 2, sigmoid routing with an expert bias, no shared expert). `shape`:
    config fields that replace these."""
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    fields: dict[str, Any] = {
        **_COMMON, "max_position_embeddings": max_positions,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 4,
        "layer_types": ["conv", "conv", "full_attention", "conv"], "num_dense_layers": 1,
        "num_experts": 6, "num_experts_per_tok": 2, "routed_scaling_factor": 1.5,
        "conv_L_cache": 3, "conv_bias": True, "norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    config = Lfm2MoeConfig(**{**fields, **(shape or {})})
    return _save(Lfm2MoeForCausalLM, config, folder, seed)


def _qwen3_5_shape(max_positions: int) -> dict[str, Any]:
    return {
        **_COMMON,
        "max_position_embeddings": max_positions,
        "num_hidden_layers": 4,
        "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    }


def _save(model_cls: Any, config: Any, folder: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = model_cls(config)
    _perturb(model)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def build_tiny_lfm2(folder: Path, seed: int = 0, max_positions: int = 1024,
                    shape: dict[str, Any] | None = None) -> Path:
    """4 layers: conv, conv, attention, conv; the ff dim goes through LFM2's auto-adjust.
    `shape`: config fields that replace these."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    fields: dict[str, Any] = {
        **_COMMON, "max_position_embeddings": max_positions,
        "intermediate_size": 160,  # auto-adjusted: int(2 * 160 / 3) = 106 -> rounded up to 128
        "block_multiple_of": 32, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True,
        "num_hidden_layers": 4, "layer_types": ["conv", "conv", "full_attention", "conv"],
        "conv_L_cache": 3, "conv_bias": True, "norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    config = Lfm2Config(**{**fields, **(shape or {})})
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
            elif name.endswith(("mlp.gate.weight", "feed_forward.gate.weight")):  # routers: decisive, so routing is not all ties
                p.normal_(0.0, 2.0 / p.shape[1] ** 0.5)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif p.dim() >= 2:
                fan_in = p[0].numel()
                gain = 4.0 if name.startswith("lm_head") else 1.0
                p.normal_(0.0, gain / fan_in**0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):  # LFM2-MoE: shifts which experts win, not their weights
                buffer.normal_(0.0, 0.3)


RANDOM_PREFIX = "random:"
BUILDERS: dict[str, Callable[[Path, int], Path]] = {
    "qwen3_5_text": build_tiny_qwen3_5,
    "lfm2": build_tiny_lfm2,
    "qwen3_next": build_tiny_qwen3_next,
    "qwen3_5_moe_text": build_tiny_qwen3_5_moe,
    "lfm2_moe": build_tiny_lfm2_moe,
}


def random_checkpoint(spec: str) -> str:
    """The folder of `random:<architecture>[@seed]`, built on first use. Keyed by this
    file's text and the transformers version, so a changed builder never serves an old
    folder; built in a temporary folder and renamed into place (concurrent starts agree)."""
    import transformers

    arch, _, seed_text = spec.partition("@")
    if arch not in BUILDERS:
        raise ValueError(f"model path {RANDOM_PREFIX}{spec}: no random checkpoint for {arch!r}; "
                         f"known: {sorted(BUILDERS)}")
    try:
        seed = int(seed_text or 0)
    except ValueError:
        raise ValueError(f"model path {RANDOM_PREFIX}{spec}: the seed after '@' must be an integer") from None
    key = hashlib.sha256(Path(__file__).read_bytes() + transformers.__version__.encode()).hexdigest()[:12]
    root = os.environ.get("TIERSERVE_CACHE")
    parent = (Path(root) if root else Path.home() / ".cache" / "tierserve") / "random"
    folder = parent / f"{arch}-seed{seed}-{key}"
    if not (folder / "config.json").exists():
        parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=parent) as tmp:
            BUILDERS[arch](Path(tmp) / "model", seed)
            try:
                os.replace(Path(tmp) / "model", folder)
            except OSError:  # another process renamed its copy into place first
                if not (folder / "config.json").exists():
                    raise
    return str(folder)


def save_tokenizer(tok: Any, folder: Path) -> None:
    """tokenizer.json as built, and a tokenizer_config.json that names the plain tokenizers
    backend: without a class, transformers 5 rebuilds a Qwen3 checkpoint's tokenizer with
    Qwen2's pre-tokenizer (and llama.cpp's converter then no longer recognizes it)."""
    import json

    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
        "chat_template": tok.chat_template}))
