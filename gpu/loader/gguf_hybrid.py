"""GGUF files of the hybrid architectures, as llama.cpp's converter writes them, back to the
Hugging Face checkpoint: Qwen3.5 (`qwen35`), Qwen3.5-MoE (`qwen35moe`), Qwen3-Next
(`qwen3next`), LFM2 (`lfm2`) and LFM2-MoE (`lfm2moe`).

The converter (convert_hf_to_gguf.py; conversion/qwen.py, conversion/lfm2.py) renames every
tensor and transforms some; each transformation is undone here, so the model classes see the
tensors a Hugging Face folder gives them (gpu/loader/hf.py is the reference). Two of them lose
bits in float32 and are inverted as closely as float32 allows:

* zero-centred norms stored as w + 1: w' = (w + 1) - 1 differs from w in its low bits, but
  1 + w', what the model computes (rms_norm_zero_centred), is the file's value exactly;
* A_log stored as -exp(A_log): the float32 log of it is nudged to the neighbour whose -exp is
  the file's value, so the model's decay -exp(A_log) is the file's exactly.

Query and key rows are as the folder has them: the converter permutes them for the Llama-family
classes only. Multi-token-prediction layers (`nextn_predict_layers`, appended after the decoder layers) are
left out: the models here have none.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import structlog
import torch

from gpu.model_config import ModelArchConfig
from gpu.moe.names import HF_NAMES, ExpertNames

log = structlog.get_logger("tierserve")

# GGUF architecture -> model registry name.
HYBRID_ARCHITECTURES = {
    "qwen35": "qwen3_5_text",
    "qwen35moe": "qwen3_5_moe_text",
    "qwen3next": "qwen3_next",
    "lfm2": "lfm2",
    "lfm2moe": "lfm2_moe",
}
_QWEN = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# The model's expert names (Lfm2MoeModel.NAMES in gpu/models/hybrid_moe.py).
LFM2_EXPERT_NAMES = ExpertNames(block="feed_forward", gate="w1", up="w3", down="w2")
_GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID

# Per family: the part of a GGUF block tensor's name after `blk.{i}.` -> the Hugging Face name
# after `model.layers.{i}.`.
_QWEN_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",  # query and output gate, as the folder has them
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
}
_LFM2_BLOCK = {
    "attn_norm.weight": "operator_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.out_proj.weight",
    "attn_q_norm.weight": "self_attn.q_layernorm.weight",
    "attn_k_norm.weight": "self_attn.k_layernorm.weight",
    "shortconv.conv.weight": "conv.conv.weight",
    "shortconv.conv.bias": "conv.conv.bias",
    "shortconv.in_proj.weight": "conv.in_proj.weight",
    "shortconv.in_proj.bias": "conv.in_proj.bias",
    "shortconv.out_proj.weight": "conv.out_proj.weight",
    "shortconv.out_proj.bias": "conv.out_proj.bias",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "ffn_gate_inp.weight": "feed_forward.gate.weight",
    "exp_probs_b.bias": "feed_forward.expert_bias",
}
_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",  # Qwen
    "token_embd_norm.weight": "model.embedding_norm.weight",  # LFM2: its final norm, despite the name
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
_EXPERTS_RE = re.compile(r"ffn_(gate|up|down)_exps\.weight")


# --- architecture -------------------------------------------------------------------------


def hybrid_arch_config(meta: Mapping[str, Any], names: set[str], vocab_size: int,
                       rope_scaling: dict[str, Any] | None) -> ModelArchConfig:
    """The config gpu/loader/hf.py builds from the folder's config.json, from the metadata the
    converter wrote (TextModel.set_gguf_parameters plus each class's own keys)."""
    arch = str(meta["general.architecture"])
    key = _MetaKey(meta, arch)
    layers = key.as_int("block_count") - key.as_int("nextn_predict_layers", 0)
    hidden, heads = key.as_int("embedding_length"), key.as_int("attention.head_count")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    per_layer_kv = [int(n) for n in kv_heads] if isinstance(kv_heads, list) else [int(kv_heads)] * layers
    experts = key.as_int("expert_count", 0)
    base = ModelArchConfig(
        architecture=HYBRID_ARCHITECTURES[arch],
        vocab_size=vocab_size,
        hidden_size=hidden,
        # Qwen3.5-MoE has no dense MLP and no feed_forward_length; hf.py uses the experts' width.
        intermediate_size=key.as_int("feed_forward_length", key.as_int("expert_feed_forward_length", 0)),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=max(per_layer_kv[:layers]),  # LFM2: 0 for the conv layers
        head_dim=key.as_int("attention.key_length", hidden // heads),
        rms_norm_eps=_shortest(key.as_float("attention.layer_norm_rms_epsilon")),
        # hf.py's default where config.json has none: LFM2's 1e6, else 1e4.
        rope_theta=key.as_float("rope.freq_base", 1e6 if arch.startswith("lfm2") else 1e4),
        max_position_embeddings=key.as_int("context_length"),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=any(n.endswith("attn_q.bias") for n in names),
        rope_scaling=rope_scaling,
    )
    if arch.startswith("lfm2"):
        return _lfm2_fields(base, key, per_layer_kv, names, experts)
    return _qwen_fields(base, key, names, experts)


class _MetaKey:
    """Reads `{arch}.{name}` metadata keys."""

    def __init__(self, meta: Mapping[str, Any], arch: str) -> None:
        self.meta, self.arch = meta, arch

    def get(self, name: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{name}", default)

    def as_int(self, name: str, default: int | None = None) -> int:
        value = self.get(name, default)
        if value is None:
            raise ValueError(f"GGUF metadata {self.arch}.{name} is missing")
        return int(value)

    def as_float(self, name: str, default: float | None = None) -> float:
        value = self.get(name, default)
        if value is None:
            raise ValueError(f"GGUF metadata {self.arch}.{name} is missing")
        return float(value)


def _shortest(value: float) -> float:
    """The float32 the file stores, read back as the shortest decimal that rounds to it (1e-06,
    not 9.99999997e-07): what config.json said."""
    return float(str(np.float32(value)))


def _qwen_fields(base: ModelArchConfig, key: _MetaKey, names: set[str], experts: int) -> ModelArchConfig:
    """Qwen3NextModel.set_gguf_parameters: the Gated DeltaNet sizes as ssm.* keys, the layer
    kinds as attention.recurrent_layers (older files: full_attention_interval), and
    rope.dimension_count = head_dim * partial_rotary_factor."""
    layers = base.num_layers
    recurrent = key.get("attention.recurrent_layers")
    if recurrent is None:
        interval = key.as_int("full_attention_interval", 4)
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    value_heads = key.as_int("ssm.time_step_rank")
    config = dataclasses.replace(
        base,
        layer_types=tuple("linear_attention" if r else "full_attention" for r in recurrent[:layers]),
        partial_rotary_factor=key.as_int("rope.dimension_count", base.head_dim) / base.head_dim,
        conv_kernel=key.as_int("ssm.conv_kernel"),
        linear_num_key_heads=key.as_int("ssm.group_count"),
        linear_num_value_heads=value_heads,
        linear_key_head_dim=key.as_int("ssm.state_size"),
        linear_value_head_dim=key.as_int("ssm.inner_size") // value_heads,
    )
    return _with_experts(config, key, names, experts, routing="softmax")


def _lfm2_fields(base: ModelArchConfig, key: _MetaKey, per_layer_kv: list[int], names: set[str],
                 experts: int) -> ModelArchConfig:
    """LFM2Model / LFM2MoeModel.set_gguf_parameters: head_count_kv per layer, 0 marking the
    short-conv layers; shortconv.l_cache is the conv width; feed_forward_length is already
    LFM2's auto-adjusted MLP width."""
    config = dataclasses.replace(
        base,
        layer_types=tuple("conv" if n == 0 else "full_attention" for n in per_layer_kv[: base.num_layers]),
        conv_kernel=key.as_int("shortconv.l_cache"),
        conv_bias=any(n.endswith("shortconv.conv.bias") for n in names),
    )
    gating = key.as_int("expert_gating_func", _GATING_SIGMOID)
    return _with_experts(config, key, names, experts, routing="sigmoid" if gating == _GATING_SIGMOID else "softmax")


def _with_experts(config: ModelArchConfig, key: _MetaKey, names: set[str], experts: int,
                  routing: str) -> ModelArchConfig:
    """Sparse layers are those with a router. llama.cpp's qwen3next, qwen35moe and lfm2moe graphs
    always renormalize the top-k weights (build_moe_ffn's norm_w) and none reads a weight
    scale the converter would write, so the file means norm_topk_prob and a scale of 1."""
    if not experts:
        return config
    return dataclasses.replace(
        config,
        num_experts=experts,
        num_experts_per_tok=key.as_int("expert_used_count"),
        moe_intermediate_size=key.as_int("expert_feed_forward_length"),
        norm_topk_prob=True,
        moe_routing=routing,
        sparse_layers=tuple(i for i in range(config.num_layers) if f"blk.{i}.ffn_gate_inp.weight" in names),
    )


# --- tensors ------------------------------------------------------------------------------


def hybrid_weights(tensors: Mapping[str, torch.Tensor], arch: ModelArchConfig,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every GGUF tensor (dequantized, [out, in] as gguf.to_torch gives them) under its Hugging
    Face name, each of the converter's transformations undone, in `dtype`."""
    weights: dict[str, torch.Tensor] = {}
    skipped = []
    for gguf_name, w in tensors.items():
        match = _BLOCK_RE.fullmatch(gguf_name)
        if match is not None and int(match.group(1)) >= arch.num_layers:
            skipped.append(gguf_name)  # a multi-token-prediction layer
            continue
        for name, t in renamed(gguf_name, w, arch):
            weights[name] = untransform(name, t, arch).to(dtype)
    if skipped:
        log.warning("ignoring GGUF multi-token-prediction tensors", count=len(skipped))
    if arch.architecture == "qwen3_next":
        merge_qkvz(weights, arch)
    return weights


def renamed(gguf_name: str, w: torch.Tensor, arch: ModelArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face name(s) of one GGUF tensor: stacked experts `ffn_*_exps` [experts, out,
    in] (Qwen2MoeModel / LFM2MoeModel.modify_tensors stack them) split into one per expert."""
    if gguf_name in _TOP_LEVEL:
        yield _TOP_LEVEL[gguf_name], w
        return
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part = match.groups()
    prefix = f"model.layers.{layer}."
    experts = _EXPERTS_RE.fullmatch(part)
    if experts is not None:
        names = HF_NAMES if arch.architecture in _QWEN else LFM2_EXPERT_NAMES
        if w.shape[0] != arch.num_experts:
            raise ValueError(f"GGUF tensor {gguf_name!r} holds {w.shape[0]} experts, the config {arch.num_experts}")
        for e in range(arch.num_experts):
            yield f"{prefix}{names.block}.experts.{e}.{getattr(names, experts.group(1))}.weight", w[e]
        return
    table = _QWEN_BLOCK if arch.architecture in _QWEN else _LFM2_BLOCK
    if part not in table:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for {arch.architecture}")
    yield prefix + table[part], w


def untransform(name: str, w: torch.Tensor, arch: ModelArchConfig) -> torch.Tensor:
    """One tensor, under its Hugging Face name, as the folder holds it."""
    if arch.architecture not in _QWEN:
        # LFM2Model / LFM2MoeModel.modify_tensors squeezed the conv's [channels, 1, width].
        return w.unsqueeze(1) if name.endswith("conv.conv.weight") else w
    if _zero_centred_norm(name):
        w = undo_norm_shift(w)
    elif name.endswith(".A_log"):
        w = undo_neg_exp(w)
    elif name.endswith("conv1d.weight"):
        w = w.unsqueeze(1)  # Qwen3NextModel.modify_tensors squeezed [channels, 1, width]
    return undo_v_head_tiling(name, w, arch)


def _zero_centred_norm(name: str) -> bool:
    # Qwen3NextModel.modify_tensors' rule: every "norm.weight" but the gated DeltaNet norm.
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


def undo_norm_shift(w: torch.Tensor) -> torch.Tensor:
    """Inverse of Qwen3NextModel.modify_tensors' `+ 1` on the zero-centred RMSNorm weights
    (llama.cpp multiplies by the stored weight; the checkpoint's model by 1 + weight)."""
    return w - 1


def undo_neg_exp(a: torch.Tensor) -> torch.Tensor:
    """Inverse of Qwen3NextModel.modify_tensors' A_log -> -exp(A_log) (llama.cpp's ssm_a).

    log(-a) is within an ulp or two; of it and its float32 neighbours, the nearest whose
    -exp is `a` again is taken, so the model's -exp(A_log) reproduces the file exactly."""
    start = torch.log(-a)
    best, found = start, -torch.exp(start) == a
    for steps in (1, -1, 2, -2):  # nearest first
        candidate = _ulps_away(start, steps)
        hit = ~found & (-torch.exp(candidate) == a)
        best, found = torch.where(hit, candidate, best), found | hit
    return best


def _ulps_away(x: torch.Tensor, steps: int) -> torch.Tensor:
    toward = torch.full_like(x, float("inf") if steps > 0 else float("-inf"))
    for _ in range(abs(steps)):
        x = torch.nextafter(x, toward)
    return x


def undo_v_head_tiling(name: str, w: torch.Tensor, arch: ModelArchConfig) -> torch.Tensor:
    """Inverse of _LinearAttentionVReorderBase.modify_tensors (Qwen3.5 and Qwen3.5-MoE, when
    value heads outnumber key heads): the value heads of the DeltaNet tensors were moved from
    grouped order (by key head: g0v0, g0v1, g1v0, ...) to tiled (g0v0, g1v0, g0v1, ...)."""
    groups, value_heads = arch.linear_num_key_heads, arch.linear_num_value_heads
    if arch.architecture == "qwen3_next" or ".linear_attn." not in name or groups in (0, value_heads):
        return w
    dv, qk_rows = arch.linear_value_head_dim, 2 * groups * arch.linear_key_head_dim
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # only the value rows moved
        return torch.cat([w[:qk_rows], _grouped(w[qk_rows:], 0, groups, dv)])
    if name.endswith("in_proj_z.weight"):
        return _grouped(w, 0, groups, dv)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", ".A_log", ".dt_bias")):
        return _grouped(w, 0, groups, 1)
    if name.endswith("out_proj.weight"):  # its input columns
        return _grouped(w, 1, groups, dv)
    return w


def _grouped(w: torch.Tensor, dim: int, groups: int, head_dim: int) -> torch.Tensor:
    """Along `dim`, heads read as (per_group, groups, head_dim), the tiled order, are put back
    as (groups, per_group, head_dim)."""
    shape = list(w.shape)
    per_group = shape[dim] // (groups * head_dim)
    tiled = w.reshape(*shape[:dim], per_group, groups, head_dim, *shape[dim + 1:])
    return tiled.transpose(dim, dim + 1).reshape(shape).contiguous()


def merge_qkvz(weights: dict[str, torch.Tensor], arch: ModelArchConfig) -> None:
    """Inverse of Qwen3NextModel.modify_tensors' in_proj_qkvz split: the checkpoint's rows are,
    per key head g, [q_g | k_g | v_g | z_g] (v and z: that head's value heads); the file holds
    attn_qkv = [all q | all k | all v] and attn_gate = [all z]. Rebuilt in place."""
    groups, dk = arch.linear_num_key_heads, arch.linear_key_head_dim
    for qkv_name in [n for n in weights if n.endswith("linear_attn.in_proj_qkv.weight")]:
        prefix = qkv_name.removesuffix("in_proj_qkv.weight")
        qkv, z = weights.pop(qkv_name), weights.pop(prefix + "in_proj_z.weight")
        hidden = qkv.shape[-1]
        q, k, v = qkv.split([groups * dk, groups * dk, qkv.shape[0] - 2 * groups * dk])
        per_head = [t.reshape(groups, -1, hidden) for t in (q, k, v, z)]
        weights[prefix + "in_proj_qkvz.weight"] = torch.cat(per_head, dim=1).reshape(-1, hidden)
