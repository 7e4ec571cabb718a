"""Load a llama.cpp GGUF file: dequantized weights under Hugging Face names, config, tokenizer.

Weights are dequantized once at load time (the engine computes in a float dtype). GGUF stores
dimensions innermost-first (ggml `ne` order), and llama.cpp's converter interleaved the rows of
Llama q/k projections for its rotary layout; both are undone here so model code sees exactly
what a Hugging Face checkpoint would give it.

Mixture-of-experts files (`qwen3moe`; `llama` with `expert_count`: Mixtral) store each sparse
layer's experts stacked, `blk.{i}.ffn_{gate,up,down}_exps` [experts, rows, cols], and the router
as `ffn_gate_inp`; they are split back into the per-expert Hugging Face tensors (raw Q4 blocks
too: a block never crosses a row, so an expert's blocks are its rows). llama.cpp renormalizes
the top-k routing weights of both architectures (build_moe_ffn's norm_w), so the config says so.

Hybrid architectures (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, LFM2, LFM2-MoE) have their own names
and transformations to undo: gpu/loader/gguf_hybrid.py.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import structlog
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from gpu.loader.checkpoint import Checkpoint
from gpu.loader.gguf_hybrid import HYBRID_ARCHITECTURES, hybrid_arch_config, hybrid_weights
from gpu.loader.gguf_tokenizer import build_gguf_tokenizer
from gpu.model_config import ModelArchConfig
from gpu.moe.names import HF_NAMES, MIXTRAL_NAMES
from gpu.quant.gguf_blocks import Q4Blocks, is_q4
from gpu.tokenizer import Tokenizer

log = structlog.get_logger("tierserve")

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", *HYBRID_ARCHITECTURES)
_REGISTRY_NAMES = {"qwen3moe": "qwen3_moe"}  # GGUF architecture -> model registry name
_ROPE_PERMUTED = ("llama", "mixtral")  # the converter interleaved their q/k rows

# Per architecture with experts: its checkpoint names, as the model reads them.
_EXPERT_NAMES = {"qwen3_moe": HF_NAMES, "mixtral": MIXTRAL_NAMES}
_EXPERTS_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Precomputed Llama 3 rope frequency factors; the engine derives rope from config instead.
_IGNORED = frozenset({"rope_freqs.weight"})


class _PlainArrayReader(GGUFReader):
    """GGUFReader parsing from a plain ndarray view of its memory map instead of np.memmap.

    The reader slices the map once per metadata item (~250k times for a 49k-token vocabulary)
    and np.memmap's Python-level slicing hooks made that ~3x slower than the same views of a
    plain ndarray. The bytes stay memory-mapped either way; nothing is copied.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)


def open_gguf(path: str) -> GGUFReader:
    return _PlainArrayReader(path)


def load_gguf(path: str, dtype: torch.dtype, keep_blocks: bool = False) -> Checkpoint:
    """Read a GGUF checkpoint into float `dtype` weights with Hugging Face names (and, with
    `keep_blocks`, the raw blocks of its Q4 weights)."""
    reader = open_gguf(path)
    meta = read_metadata(reader)
    arch = build_arch_config(meta, reader.tensors)
    weights = load_weights(reader.tensors, arch, dtype)
    blocks = load_q4_blocks(reader.tensors, arch) if keep_blocks else {}
    return Checkpoint(arch=arch, weights=weights, tokenizer=build_gguf_tokenizer(meta), blocks=blocks)


def load_q4_blocks(tensors: list[ReaderTensor], arch: ModelArchConfig) -> dict[str, Q4Blocks]:
    """Raw Q4_0/Q4_1 blocks of every 2-D weight stored that way, as uint8 [rows, row bytes]
    (a block never crosses a row, so the q/k row permutation applies to them unchanged)."""
    blocks: dict[str, Q4Blocks] = {}
    if arch.architecture in HYBRID_ARCHITECTURES.values():
        return blocks  # their models are float-only, and some rows' undoing would cross blocks
    for t in tensors:
        kind = t.tensor_type.name
        if t.name in _IGNORED or not is_q4(kind) or len(t.shape) not in (2, 3):
            continue
        data = torch.from_numpy(np.array(t.data, dtype=np.uint8))  # [(experts,) rows, row bytes]
        for name, rows in hf_tensors(t.name, data, arch):
            if arch.architecture in _ROPE_PERMUTED:
                rows = _undo_rope_permutation(name, rows, arch)
            blocks[name] = Q4Blocks(kind, rows)
    return blocks


def load_gguf_tokenizer(path: str) -> Tokenizer | None:
    """Only the tokenizer of a GGUF file (no weights are dequantized)."""
    return build_gguf_tokenizer(read_metadata(open_gguf(path)))


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata as plain Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def build_arch_config(meta: Mapping[str, Any], tensors: list[ReaderTensor]) -> ModelArchConfig:
    arch = str(meta.get("general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}")
    names = {t.name for t in tensors}
    if arch in HYBRID_ARCHITECTURES:
        return hybrid_arch_config(meta, names, _vocab_size(meta, tensors), _rope_scaling(meta, arch))
    hidden = int(meta[f"{arch}.embedding_length"])
    heads = int(meta[f"{arch}.attention.head_count"])
    experts = int(meta.get(f"{arch}.expert_count", 0))
    config = ModelArchConfig(
        architecture="mixtral" if arch == "llama" and experts else _REGISTRY_NAMES.get(arch, arch),
        vocab_size=_vocab_size(meta, tensors),
        hidden_size=hidden,
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        num_layers=int(meta[f"{arch}.block_count"]),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta[f"{arch}.context_length"]),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=_rope_scaling(meta, arch),
    )
    if not experts:
        return config
    return dataclasses.replace(
        config,
        num_experts=experts,
        num_experts_per_tok=int(meta[f"{arch}.expert_used_count"]),
        moe_intermediate_size=int(meta.get(f"{arch}.expert_feed_forward_length", config.intermediate_size)),
        norm_topk_prob=True,  # llama.cpp's qwen3moe and llama graphs renormalize (norm_w)
        sparse_layers=tuple(i for i in range(config.num_layers) if f"blk.{i}.ffn_gate_inp.weight" in names),
    )


def load_weights(
    tensors: list[ReaderTensor], arch: ModelArchConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Dequantize every tensor (in parallel) and return them under Hugging Face names."""
    wanted = [t for t in tensors if t.name not in _IGNORED]
    for t in tensors:
        if t.name in _IGNORED:
            log.warning("ignoring GGUF tensor", tensor=t.name)
    # numpy releases the GIL inside large array ops, so on many-core hosts tensors overlap.
    workers = max(1, min(8, os.cpu_count() or 1))
    hybrid = arch.architecture in HYBRID_ARCHITECTURES.values()
    # A hybrid's vectors (norms shifted by 1, -exp(A_log)) are undone in float32, then cast.
    precise = {t.name for t in wanted if hybrid and len(t.shape) == 1}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        loaded = list(pool.map(lambda t: to_torch(t, torch.float32 if t.name in precise else dtype), wanted))
    if hybrid:
        return hybrid_weights({t.name: w for t, w in zip(wanted, loaded)}, arch, dtype)
    weights: dict[str, torch.Tensor] = {}
    for t, stacked in zip(wanted, loaded):
        for name, w in hf_tensors(t.name, stacked, arch):
            if arch.architecture in _ROPE_PERMUTED:
                w = _undo_rope_permutation(name, w, arch)
            weights[name] = w
    return weights


def to_torch(t: ReaderTensor, dtype: torch.dtype) -> torch.Tensor:
    """One tensor dequantized to float32, shaped [out, in] ([experts, out, in] when stacked), then
    cast to `dtype`."""
    values = dequantize(t.data, t.tensor_type)
    values = values.reshape([int(n) for n in reversed(t.shape)])  # ne order is innermost-first
    if not values.flags.writeable:
        # Unquantized tensors come back as read-only views of the memory-mapped file; copy so
        # torch owns writable memory and the file can be closed.
        values = np.array(values)
    return torch.from_numpy(values).to(dtype)


def hf_tensors(gguf_name: str, w: torch.Tensor, arch: ModelArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of one GGUF tensor: itself under its name, or (stacked
    experts) each expert's slice under its own."""
    match = _EXPERTS_RE.fullmatch(gguf_name)
    if match is None:
        yield hf_name(gguf_name, arch.architecture), w
        return
    names = _EXPERT_NAMES[arch.architecture]
    layer, projection = match.groups()
    if w.shape[0] != arch.num_experts:
        raise ValueError(f"GGUF tensor {gguf_name!r} holds {w.shape[0]} experts, the config {arch.num_experts}")
    for e in range(arch.num_experts):
        yield f"model.layers.{layer}.{names.block}.experts.{e}.{getattr(names, projection)}.weight", w[e]


def hf_name(gguf_name: str, architecture: str = "llama") -> str:
    """Hugging Face parameter name of a GGUF tensor name (one tensor; not stacked experts)."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is not None and match.group(2) == "ffn_gate_inp" and architecture in _EXPERT_NAMES:
        return f"model.layers.{match.group(1)}.{_EXPERT_NAMES[architecture].block}.gate.{match.group(3)}"
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation.

    The converter did w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2): within
    each head, rows were interleaved (pairs) instead of split into two halves.
    Reading the result as (n_head, half, 2, *rest) and swapping back restores the halves.
    """
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def _undo_rope_permutation(name: str, w: torch.Tensor, arch: ModelArchConfig) -> torch.Tensor:
    if ".self_attn.q_proj." in name:
        return unpermute_rows(w, arch.num_heads)
    if ".self_attn.k_proj." in name:
        return unpermute_rows(w, arch.num_kv_heads)
    return w


def _vocab_size(meta: Mapping[str, Any], tensors: list[ReaderTensor]) -> int:
    """Vocabulary size: the tokens list, else the declared size, else the embedding rows."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None:
        size = len(tokens)
    else:
        arch = meta["general.architecture"]
        declared = meta.get(f"{arch}.vocab_size")
        size = int(declared) if declared is not None else -1
    rows = next((int(t.shape[-1]) for t in tensors if t.name == "token_embd.weight"), size)
    if size != rows:
        # The logits must cover every embedding row, whatever the tokenizer lists.
        log.warning("GGUF vocabulary size differs from embedding rows; using rows", tokens=size, rows=rows)
        size = rows
    return size


def _rope_scaling(meta: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind is None or kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind)}
    if f"{arch}.rope.scaling.factor" in meta:
        scaling["factor"] = float(meta[f"{arch}.rope.scaling.factor"])
    if f"{arch}.rope.scaling.original_context_length" in meta:
        scaling["original_max_position_embeddings"] = int(
            meta[f"{arch}.rope.scaling.original_context_length"]
        )
    return scaling
