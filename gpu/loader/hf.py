"""Load a Hugging Face model folder: config.json, *.safetensors and the tokenizer files."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import structlog
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as BackendTokenizer

from gpu.loader.checkpoint import Checkpoint
from gpu.model_config import ModelArchConfig
from gpu.tokenizer import Tokenizer

log = structlog.get_logger("tierserve")

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    # The hub's Qwen3.5 folders: the text model under text_config and model.language_model.
    "Qwen3_5ForConditionalGeneration": "qwen3_5_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe_text",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Lfm2ForCausalLM": "lfm2",
    "Lfm2MoeForCausalLM": "lfm2_moe",
}


def load_hf_folder(path: str, dtype: torch.dtype) -> Checkpoint:
    """Weights, architecture and (when tokenizer.json exists) tokenizer of a HF folder."""
    config = _read_json(os.path.join(path, "config.json"))
    if config is None:
        raise FileNotFoundError(f"{path} has no config.json; not a Hugging Face model folder")
    config = text_config(config)
    arch = build_arch_config(config)
    weights = load_safetensors(path, dtype, arch.tie_word_embeddings)
    return Checkpoint(arch=arch, weights=weights, tokenizer=load_hf_tokenizer(path, config))


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: a multimodal folder's text_config (its own values
    first, the top level's for the rest), else the config as it is. NOTE: whether the head
    is tied is the top level's to say: transformers ties a multimodal model's embeddings by
    it, and writes text_config's own flag as its default (false) beside a top-level true."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    top = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    tied = {"tie_word_embeddings": top["tie_word_embeddings"]} if "tie_word_embeddings" in top else {}
    return {**top, **text, **tied, "architectures": config.get("architectures") or []}


# A multimodal folder's tensors: the language model's under model.language_model. (read as
# model.); the vision tower's and the multi-token-prediction head's are not used.
LANGUAGE_MODEL = "model.language_model."
UNUSED_PREFIXES = ("model.visual.", "visual.", "mtp.")


def build_arch_config(config: dict[str, Any]) -> ModelArchConfig:
    arch = _architecture(config)
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    base = ModelArchConfig(
        architecture=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        # Qwen3.5-MoE has no dense MLP, so no intermediate_size: its experts' width stands in.
        intermediate_size=int(config.get("intermediate_size") or config["moe_intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(config),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; its config has no flag for it.
        attention_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        rope_scaling=_rope_scaling(config),
    )
    if arch == "qwen3_5_text":
        return _qwen3_5_fields(base, config)
    if arch == "lfm2":
        return _lfm2_fields(base, config)
    if arch == "lfm2_moe":
        return _lfm2_moe_fields(_lfm2_fields(base, config), config)
    if arch in ("qwen3_moe", "mixtral"):
        return _moe_fields(base, config, always_renormalize=arch == "mixtral")
    if arch in ("qwen3_5_moe_text", "qwen3_next"):
        # Qwen3.5-MoE: every layer sparse, always renormalized (Qwen3_5MoeTopKRouter).
        every = arch == "qwen3_5_moe_text"
        moe = config if not every else {**config, "decoder_sparse_step": 1, "mlp_only_layers": []}
        # norm_topk_prob defaults to true in Qwen3NextConfig (false in Qwen3MoeConfig).
        return _moe_fields(_qwen3_5_fields(base, config), moe, always_renormalize=every, renormalize_default=True)
    return base


def _moe_fields(base: ModelArchConfig, config: dict[str, Any], always_renormalize: bool,
                renormalize_default: bool = False) -> ModelArchConfig:
    """Qwen3-MoE, Qwen3-Next: layer i's MLP is the sparse block unless i is in
    mlp_only_layers, with experts, where (i + 1) % decoder_sparse_step == 0
    (Qwen3MoeDecoderLayer). Mixtral: every layer, experts as wide as intermediate_size,
    top-k weights always renormalized."""
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    if window is not None and int(window) < base.max_position_embeddings:
        raise ValueError(f"sliding-window attention (sliding_window {window}) is not supported")
    # transformers 5 writes num_local_experts; hub configs (and older versions) num_experts.
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    step = int(config.get("decoder_sparse_step", 1))
    dense = {int(i) for i in config.get("mlp_only_layers") or ()}
    sparse = tuple(i for i in range(base.num_layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    return dataclasses.replace(
        base,
        num_experts=experts,
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config.get("moe_intermediate_size") or base.intermediate_size),
        norm_topk_prob=always_renormalize or bool(config.get("norm_topk_prob", renormalize_default)),
        sparse_layers=sparse,
    )


def _qwen3_5_fields(base: ModelArchConfig, config: dict[str, Any]) -> ModelArchConfig:
    layers = base.num_layers
    types = config.get("layer_types")
    if types is None:  # older configs: every `full_attention_interval`-th layer is attention
        interval = int(config.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    params = config.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    return dataclasses.replace(
        base,
        layer_types=tuple(types),
        partial_rotary_factor=float(partial),
        conv_kernel=int(config.get("linear_conv_kernel_dim", 4)),
        linear_num_key_heads=int(config["linear_num_key_heads"]),
        linear_num_value_heads=int(config["linear_num_value_heads"]),
        linear_key_head_dim=int(config["linear_key_head_dim"]),
        linear_value_head_dim=int(config["linear_value_head_dim"]),
    )


def _lfm2_fields(base: ModelArchConfig, config: dict[str, Any]) -> ModelArchConfig:
    types = config.get("layer_types")
    if types is None:
        attn = config.get("full_attn_idxs")
        attn_set = set(range(base.num_layers)) if attn is None else {int(i) for i in attn}
        types = ["full_attention" if i in attn_set else "conv" for i in range(base.num_layers)]
    # Older LFM2 configs spell these block_ff_dim and tie_embedding; those win, as in transformers.
    tied = bool(config.get("tie_embedding", config.get("tie_word_embeddings", True)))
    return dataclasses.replace(
        base,
        intermediate_size=_lfm2_ff_dim(config),
        rms_norm_eps=float(config.get("norm_eps", 1e-5)),
        rope_theta=_rope_theta(config, default=1000000.0),
        tie_word_embeddings=tied,
        layer_types=tuple(types),
        conv_kernel=int(config.get("conv_L_cache", 3)),
        conv_bias=bool(config.get("conv_bias", False)),
    )


def _lfm2_moe_fields(lfm2: ModelArchConfig, config: dict[str, Any]) -> ModelArchConfig:
    """LFM2-MoE: LFM2's layers; the first num_dense_layers MLPs dense (intermediate_size as
    it is: no auto-adjust), the rest sparse with sigmoid routing (Lfm2MoeTopKRouter), its
    expert bias as use_expert_bias says."""
    dense = int(config.get("num_dense_layers", 2))
    return dataclasses.replace(
        lfm2,
        intermediate_size=int(config["intermediate_size"]),
        num_experts=int(config["num_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["moe_intermediate_size"]),
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        moe_routing="sigmoid",
        routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
        # Off: transformers builds no expert_bias buffer, so one the file still holds is unused.
        expert_bias=bool(config.get("use_expert_bias", True)),
        sparse_layers=tuple(range(dense, lfm2.num_layers)),
    )


def _lfm2_ff_dim(config: dict[str, Any]) -> int:
    """LFM2's MLP width: with block_auto_adjust_ff_dim, 2/3 of the configured size, times
    the multiplier, rounded up to block_multiple_of (Lfm2MLP in transformers)."""
    size = int(config.get("block_ff_dim", config["intermediate_size"]))
    if not config.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier = config.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        size = int(float(multiplier) * size)
        multiple = int(config.get("block_multiple_of", 256))
        size = multiple * ((size + multiple - 1) // multiple)
    return size


def load_safetensors(path: str, dtype: torch.dtype, tied: bool) -> dict[str, torch.Tensor]:
    """All tensors of the folder's safetensors files (one or many shards), cast to `dtype`."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weight files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(file).items():
            if name.endswith("rotary_emb.inv_freq") or name.startswith(UNUSED_PREFIXES):
                continue  # a buffer some old exports saved (rope comes from the config), or not the text model's
            if name.startswith(LANGUAGE_MODEL):
                name = "model." + name[len(LANGUAGE_MODEL):]
            weights[name] = tensor.to(dtype)
    if tied:
        # Tied models share the embedding; a saved copy would only waste memory.
        weights.pop("lm_head.weight", None)
    elif "lm_head.weight" not in weights:
        raise ValueError(f"{path}: tie_word_embeddings is false but lm_head.weight is missing")
    return weights


def load_hf_tokenizer(path: str, config: dict[str, Any]) -> Tokenizer | None:
    """tokenizer.json plus the special-token and template settings around it, if present."""
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tokenizer_file):
        log.warning("no tokenizer.json; only token-id prompts will be accepted", path=path)
        return None
    backend = BackendTokenizer.from_file(tokenizer_file)
    tok_config = _read_json(os.path.join(path, "tokenizer_config.json")) or {}
    gen_config = _read_json(os.path.join(path, "generation_config.json")) or {}
    bos_id = _special_id(backend, tok_config.get("bos_token"), config.get("bos_token_id"))
    eos_id = _special_id(backend, tok_config.get("eos_token"), config.get("eos_token_id"))
    add_bos = tok_config.get("add_bos_token")
    if add_bos is None:
        add_bos = _post_processor_adds(backend, bos_id)
    return Tokenizer(
        backend,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        add_bos_token=bool(add_bos),
        chat_template=_chat_template(path, tok_config),
        extra_eos_token_ids=_id_list(gen_config.get("eos_token_id")) + _id_list(config.get("eos_token_id")),
    )


def _architecture(config: dict[str, Any]) -> str:
    names = config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(f"unsupported architecture {names!r}; supported: {sorted(ARCHITECTURES)}")


def _rope_theta(config: dict[str, Any], default: float = 10000.0) -> float:
    # transformers >= 5 writes rope settings under rope_parameters; older configs at top level.
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta") or config.get("rope_theta") or default)


def _rope_scaling(config: dict[str, Any]) -> dict[str, Any] | None:
    scaling = config.get("rope_scaling")
    if scaling is None:
        params = config.get("rope_parameters") or {}
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    return None if kind in (None, "default") else scaling


def _special_id(backend: BackendTokenizer, token: Any, fallback: Any) -> int | None:
    """Id of a special token given as text (or {"content": text}), else the config's id."""
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str):
        found = backend.token_to_id(token)
        if found is not None:
            return int(found)
    ids = _id_list(fallback)
    return ids[0] if ids else None


def _post_processor_adds(backend: BackendTokenizer, bos_id: int | None) -> bool:
    """Whether tokenizer.json's post-processor prepends BOS (e.g. Llama 3 files)."""
    if bos_id is None:
        return False
    with_special = backend.encode("a", add_special_tokens=True).ids
    return (
        bool(with_special)
        and with_special[0] == bos_id
        and backend.encode("a", add_special_tokens=False).ids[:1] != [bos_id]
    )


def _chat_template(path: str, tok_config: dict[str, Any]) -> str | None:
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None:
        # Newer exports keep the template in its own file.
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
    return template if isinstance(template, str) else None


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


def _read_json(file: str) -> dict[str, Any] | None:
    if not os.path.exists(file):
        return None
    with open(file, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else None
