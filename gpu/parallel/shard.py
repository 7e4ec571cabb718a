"""One rank's shard of a Llama-family checkpoint (tensor parallelism, Megatron-style).

Pure functions over the loader's in-memory form (Hugging Face names, [out, in] weights,
raw GGUF Q4 blocks with rows in the same order), so a shard is checked without a process
group:
- column-parallel (output rows split): q/k/v (by heads) and gate/up (by channels), with
  their biases;
- row-parallel (input columns split): o_proj and down_proj. Their biases are NOT split:
  the model adds them once, after the all-reduce (gpu/models/llama.py);
- vocab-parallel: the embedding and an untied lm_head, by rows, padded with zero rows to
  `vocab_chunk` per rank so every rank's logits have one width (the gathered logits are
  cut back to the vocabulary);
- replicated: norms (QK-norm included).

KV heads: with more ranks than KV heads each KV head is replicated on `size / kv_heads`
ranks (the ranks whose query heads read it); otherwise each rank takes `kv_heads / size`.
NOTE: rank r's query heads are [r * H / size, (r + 1) * H / size) and its KV heads are the
ones those query heads read (head q reads KV head q // (H / kv_heads)) — the invariant the
planted "KV heads not replicated" bug breaks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

import torch

from gpu.model_config import ModelArchConfig
from gpu.quant.gguf_blocks import Q4Blocks, block_bytes
from gpu.quant.linears import GROUP


class ShardError(ValueError):
    """The model cannot be split `size` ways (the message says which dimension)."""


class Shard(NamedTuple):
    arch: ModelArchConfig  # local head / channel counts; vocab_size stays the whole vocabulary
    weights: dict[str, torch.Tensor]
    blocks: dict[str, Q4Blocks]
    vocab_start: int  # first vocabulary id of this rank's embedding rows
    vocab_chunk: int  # embedding / lm_head rows per rank (the last rank's are zero-padded)


def check_divisible(arch: ModelArchConfig, size: int) -> None:
    """Raise ShardError naming the first dimension that `size` does not split."""
    if arch.layer_types is not None or arch.sparse_layers:
        raise ShardError("tensor parallelism covers dense Llama-family models (llama, qwen2, qwen3) so far; "
                         f"{arch.architecture} is hybrid or mixture-of-experts")
    if arch.num_heads % size:
        raise ShardError(f"{arch.num_heads} attention heads do not split over {size} ranks")
    kv = arch.num_kv_heads
    if kv % size and size % kv:
        raise ShardError(f"{kv} KV heads neither split over {size} ranks nor replicate evenly onto them")
    if arch.intermediate_size % size:
        raise ShardError(f"intermediate size {arch.intermediate_size} does not split over {size} ranks")


def kv_heads_of(arch: ModelArchConfig, rank: int, size: int) -> range:
    """The KV heads rank `rank` holds (replicated ones included)."""
    kv = arch.num_kv_heads
    if kv >= size:
        per = kv // size
        return range(rank * per, (rank + 1) * per)
    return range(rank // (size // kv), rank // (size // kv) + 1)


def shard_checkpoint(
    arch: ModelArchConfig, weights: Mapping[str, torch.Tensor], blocks: Mapping[str, Q4Blocks], rank: int, size: int
) -> Shard:
    """Rank `rank`'s tensors of a dense Llama-family checkpoint split `size` ways."""
    check_divisible(arch, size)
    heads = arch.num_heads // size
    kv_heads = kv_heads_of(arch, rank, size)
    inter = arch.intermediate_size // size
    chunk = -(-arch.vocab_size // size)
    cut = _Cut(rank, size, arch.head_dim)
    out: dict[str, torch.Tensor] = {}
    out_blocks: dict[str, Q4Blocks] = {}
    for name, tensor in weights.items():
        rule = _rule(name)
        if rule == "q":
            part = cut.rows_heads(tensor, range(rank * heads, (rank + 1) * heads))
        elif rule == "kv":
            part = cut.rows_heads(tensor, kv_heads)
        elif rule == "channels":
            part = cut.rows(tensor, rank * inter, inter)
        elif rule == "o":
            part = cut.cols(tensor, rank * heads * arch.head_dim, heads * arch.head_dim)
        elif rule == "down":
            part = cut.cols(tensor, rank * inter, inter)
        elif rule == "vocab":
            part = _pad_rows(tensor[rank * chunk : (rank + 1) * chunk], chunk)
        else:
            part = tensor
        out[name] = part.contiguous()
        if name in blocks:
            out_blocks[name] = _shard_blocks(blocks[name], rule, cut, heads, kv_heads, inter, arch.head_dim)
    local = dataclasses.replace(arch, num_heads=heads, num_kv_heads=len(kv_heads), intermediate_size=inter)
    return Shard(local, out, out_blocks, rank * chunk, chunk)


def _rule(name: str) -> str:
    """How tensor `name` splits (see the module docstring)."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "vocab"
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return "q"
    if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                      "self_attn.v_proj.bias")):
        return "kv"
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.bias")):
        return "channels"
    if name.endswith("self_attn.o_proj.weight"):
        return "o"
    if name.endswith("mlp.down_proj.weight"):
        return "down"
    return "replicated"  # norms, and the row-parallel biases (added once, after the all-reduce)


class _Cut:
    def __init__(self, rank: int, size: int, head_dim: int) -> None:
        self.rank, self.size, self.head_dim = rank, size, head_dim

    def rows(self, t: torch.Tensor, start: int, count: int) -> torch.Tensor:
        return t[start : start + count]

    def rows_heads(self, t: torch.Tensor, heads: range) -> torch.Tensor:
        return t[heads.start * self.head_dim : heads.stop * self.head_dim]

    def cols(self, t: torch.Tensor, start: int, count: int) -> torch.Tensor:
        return t[:, start : start + count]


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _shard_blocks(
    b: Q4Blocks, rule: str, cut: _Cut, heads: int, kv_heads: range, inter: int, head_dim: int
) -> Q4Blocks:
    """The same split on raw Q4 blocks: rows as they are; columns only on whole blocks."""
    if rule == "q":
        return Q4Blocks(b.kind, cut.rows_heads(b.data, range(cut.rank * heads, (cut.rank + 1) * heads)).contiguous())
    if rule == "kv":
        return Q4Blocks(b.kind, cut.rows_heads(b.data, kv_heads).contiguous())
    if rule == "channels":
        return Q4Blocks(b.kind, cut.rows(b.data, cut.rank * inter, inter).contiguous())
    if rule in ("o", "down"):
        width = heads * head_dim if rule == "o" else inter
        if width % GROUP:
            raise ShardError(f"a 4-bit weight's input columns split into {width} per rank, not whole "
                             f"{GROUP}-weight blocks; use model.quantization none or int8")
        per_block = block_bytes(b.kind)
        first = cut.rank * width // GROUP * per_block
        return Q4Blocks(b.kind, b.data[:, first : first + width // GROUP * per_block].contiguous())
    if rule == "vocab":
        chunk = -(-b.data.shape[0] // cut.size)
        return Q4Blocks(b.kind, _pad_rows(b.data[cut.rank * chunk : (cut.rank + 1) * chunk], chunk).contiguous())
    return b  # replicated
