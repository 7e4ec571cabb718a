"""One rank's shard of a checkpoint (tensor parallelism, Megatron-style).

Pure functions over the loader's in-memory form (Hugging Face names, [out, in] weights,
raw GGUF Q4 blocks with rows in the same order), so a shard is checked without a process
group:
- column-parallel (output rows split): q/k/v (by heads) and gate/up (by channels), with
  their biases; a Gated DeltaNet's input projections and conv (each segment q | k | v by
  its own heads, z / b / a / A_log / dt_bias by value heads); a short conv's B | C | x
  projection, conv and conv bias (by channels);
- row-parallel (input columns split): o_proj / out_proj and down_proj. Their biases are
  NOT split: the model adds them once, after the all-reduce;
- vocab-parallel: the embedding and an untied lm_head, by rows, padded with zero rows to
  `vocab_chunk` per rank so every rank's logits have one width (the gathered logits are
  cut back to the vocabulary);
- replicated: norms (QK-norm and the gated RMSNorm's per-head weight included);
- mixture of experts: every expert (and the shared expert) split like a dense MLP, along
  its own intermediate dimension — gate/up rows, down columns — while the router, the
  expert bias and the shared expert's gate are replicated, so every rank routes every
  token the same way and the block's partial output needs one all-reduce. Qwen3-Next's
  fused linear-attention projections (`in_proj_qkvz`, `in_proj_ba`) are grouped by key
  head in the checkpoint, so they split by whole key-head groups.

KV heads: with more ranks than KV heads each KV head is replicated on `size / kv_heads`
ranks (the ranks whose query heads read it); otherwise each rank takes `kv_heads / size`.
NOTE: rank r's query heads are [r * H / size, (r + 1) * H / size) and its KV heads are the
ones those query heads read (head q reads KV head q // (H / kv_heads)) — the invariant the
planted "KV heads not replicated" bug breaks. A Gated DeltaNet's value heads keep reading
their key heads the same way (both split `size` ways, the ratio unchanged).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

import torch

from gpu.model_config import ModelArchConfig
from gpu.quant.gguf_blocks import Q4Blocks, block_bytes
from gpu.quant.linears import GROUP

QWEN3_5_FAMILY = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")  # Gated DeltaNet + gated attention
LFM2_FAMILY = ("lfm2", "lfm2_moe")  # short convs + attention
HYBRIDS = QWEN3_5_FAMILY + LFM2_FAMILY
EXPERT_ROWS = ("gate_proj", "up_proj", "w1", "w3")  # an expert's gate / up: output rows split
EXPERT_COLS = ("down_proj", "w2")  # its down projection: input columns split


class ShardError(ValueError):
    """The model cannot be split `size` ways (the message says which dimension)."""


class Shard(NamedTuple):
    arch: ModelArchConfig  # local head / channel counts; vocab_size and hidden_size stay whole
    weights: dict[str, torch.Tensor]
    blocks: dict[str, Q4Blocks]
    vocab_start: int  # first vocabulary id of this rank's embedding rows
    vocab_chunk: int  # embedding / lm_head rows per rank (the last rank's are zero-padded)


class Part(NamedTuple):
    """A segment of a tensor's split dimension: `total` units of `unit` rows (or columns),
    of which this rank takes the units in `take`."""

    unit: int
    total: int
    take: range


class Split(NamedTuple):
    dim: int  # 0: output rows (column-parallel), 1: input columns (row-parallel)
    parts: tuple[Part, ...]  # the dimension's segments in order


def check_divisible(arch: ModelArchConfig, size: int) -> None:
    """Raise ShardError naming the first dimension that `size` does not split."""
    if arch.layer_types is not None and arch.architecture not in HYBRIDS:
        raise ShardError("tensor parallelism covers Llama-family models and the Qwen3.5 / LFM2 hybrids; "
                         f"{arch.architecture} is not one of them")
    if arch.num_heads % size:
        raise ShardError(f"{arch.num_heads} attention heads do not split over {size} ranks")
    kv = arch.num_kv_heads
    if kv % size and size % kv:
        raise ShardError(f"{kv} KV heads neither split over {size} ranks nor replicate evenly onto them")
    if arch.intermediate_size % size:
        raise ShardError(f"intermediate size {arch.intermediate_size} does not split over {size} ranks")
    if arch.sparse_layers and arch.moe_intermediate_size % size:
        raise ShardError(f"the experts' intermediate size {arch.moe_intermediate_size} does not split over {size} ranks")
    if arch.architecture in QWEN3_5_FAMILY and (arch.linear_num_key_heads % size or arch.linear_num_value_heads % size):
        raise ShardError(f"{arch.linear_num_key_heads} key / {arch.linear_num_value_heads} value heads of the "
                         f"linear-attention layers do not split over {size} ranks")
    if arch.architecture in LFM2_FAMILY and arch.hidden_size % size:
        raise ShardError(f"the short conv's {arch.hidden_size} channels do not split over {size} ranks")


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
    """Rank `rank`'s tensors of the checkpoint split `size` ways."""
    check_divisible(arch, size)
    chunk = -(-arch.vocab_size // size)
    rules = _Rules(arch, rank, size)
    out: dict[str, torch.Tensor] = {}
    out_blocks: dict[str, Q4Blocks] = {}
    for name, tensor in weights.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _pad_rows(tensor[rank * chunk : (rank + 1) * chunk], chunk).contiguous()
            if name in blocks:
                b = blocks[name]
                out_blocks[name] = Q4Blocks(b.kind, _pad_rows(b.data[rank * chunk : (rank + 1) * chunk], chunk))
            continue
        split = rules.split(name, tensor.shape)
        out[name] = tensor if split is None else _take(tensor, split).contiguous()
        if name in blocks:
            out_blocks[name] = blocks[name] if split is None else _take_blocks(blocks[name], split)
    return Shard(rules.local_arch(), out, out_blocks, rank * chunk, chunk)


class _Rules:
    """Which split each tensor name gets, for one rank of one architecture."""

    def __init__(self, arch: ModelArchConfig, rank: int, size: int) -> None:
        self.arch, self.rank, self.size = arch, rank, size

    def mine(self, count: int) -> range:
        """This rank's share of `count` things split `size` ways."""
        per = count // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def local_arch(self) -> ModelArchConfig:
        a, n = self.arch, self.size
        return dataclasses.replace(
            a, num_heads=a.num_heads // n, num_kv_heads=len(kv_heads_of(a, self.rank, n)),
            intermediate_size=a.intermediate_size // n, moe_intermediate_size=a.moe_intermediate_size // n,
            linear_num_key_heads=a.linear_num_key_heads // n, linear_num_value_heads=a.linear_num_value_heads // n,
        )

    def split(self, name: str, shape: torch.Size) -> Split | None:
        """How tensor `name` of `shape` splits (None: replicated)."""
        if ".experts." in name or ".shared_expert." in name:
            return self._expert_split(name, shape)
        a = self.arch
        hd, heads, kv = a.head_dim, a.num_heads, a.num_kv_heads
        q_heads, kv_heads = self.mine(heads), kv_heads_of(a, self.rank, self.size)
        rows_of = {
            # Qwen3.5's q_proj interleaves [query | gate] per head: a head is 2 * head_dim rows.
            "self_attn.q_proj": Part(2 * hd if a.architecture in QWEN3_5_FAMILY else hd, heads, q_heads),
            "self_attn.k_proj": Part(hd, kv, kv_heads),
            "self_attn.v_proj": Part(hd, kv, kv_heads),
            "mlp.gate_proj": Part(1, a.intermediate_size, self.mine(a.intermediate_size)),
            "mlp.up_proj": Part(1, a.intermediate_size, self.mine(a.intermediate_size)),
            "feed_forward.w1": Part(1, a.intermediate_size, self.mine(a.intermediate_size)),
            "feed_forward.w3": Part(1, a.intermediate_size, self.mine(a.intermediate_size)),
        }
        cols_of = {
            "self_attn.o_proj": Part(hd, heads, q_heads),
            "self_attn.out_proj": Part(hd, heads, q_heads),
            "mlp.down_proj": Part(1, a.intermediate_size, self.mine(a.intermediate_size)),
            "feed_forward.w2": Part(1, a.intermediate_size, self.mine(a.intermediate_size)),
        }
        layer, _, leaf = name.rpartition(".")  # leaf: weight | bias | A_log | dt_bias
        module = ".".join(layer.split(".")[-2:])
        if module in rows_of:
            return Split(0, (rows_of[module],))
        if module in cols_of:
            return Split(1, (cols_of[module],)) if leaf == "weight" else None  # the bias: once, after the reduce
        return self._state_split(module, leaf, name)

    def _expert_split(self, name: str, shape: torch.Size) -> Split | None:
        """A routed or shared expert's projection, split along its own intermediate width
        (the shared expert's is not the routed experts'; both read from the shape)."""
        projection = name.rsplit(".", 2)[-2]
        dim = 0 if projection in EXPERT_ROWS else 1 if projection in EXPERT_COLS else None
        if dim is None:
            return None
        width = shape[dim]
        if width % self.size:
            raise ShardError(f"{name}: an expert's intermediate size {width} does not split over {self.size} ranks")
        return Split(dim, (Part(1, width, self.mine(width)),))

    def _state_split(self, module: str, leaf: str, name: str) -> Split | None:
        a = self.arch
        if a.architecture in QWEN3_5_FAMILY and ".linear_attn." in name:
            hk, hv, dk, dv = a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim
            per_value_head = Split(0, (Part(1, hv, self.mine(hv)),))
            if leaf in ("A_log", "dt_bias"):
                return per_value_head
            qkv = Split(0, (Part(dk, hk, self.mine(hk)), Part(dk, hk, self.mine(hk)), Part(dv, hv, self.mine(hv))))
            rep = hv // hk  # Qwen3-Next's fused projections: per key head [q | k | v... | z...] and [b... | a...]
            by_module = {"linear_attn.in_proj_qkvz": Split(0, (Part(2 * dk + 2 * rep * dv, hk, self.mine(hk)),)),
                         "linear_attn.in_proj_ba": Split(0, (Part(2 * rep, hk, self.mine(hk)),)),
                         "linear_attn.in_proj_qkv": qkv, "linear_attn.conv1d": qkv,
                         "linear_attn.in_proj_z": Split(0, (Part(dv, hv, self.mine(hv)),)),
                         "linear_attn.in_proj_b": per_value_head, "linear_attn.in_proj_a": per_value_head,
                         "linear_attn.out_proj": Split(1, (Part(dv, hv, self.mine(hv)),))}
            return by_module.get(module)  # norm: one weight per head dim, replicated
        if a.architecture in LFM2_FAMILY and ".conv." in name:
            channels = Part(1, a.hidden_size, self.mine(a.hidden_size))
            if module == "conv.in_proj":
                return Split(0, (channels, channels, channels))  # [B | C | x]
            if module == "conv.conv":
                return Split(0, (channels,))
            if module == "conv.out_proj" and leaf == "weight":
                return Split(1, (channels,))
        return None


def _take(t: torch.Tensor, split: Split) -> torch.Tensor:
    pieces, offset = [], 0
    for part in split.parts:
        start = offset + part.take.start * part.unit
        pieces.append(t.narrow(split.dim, start, len(part.take) * part.unit))
        offset += part.total * part.unit
    if offset != t.shape[split.dim]:
        raise ShardError(f"a tensor of shape {tuple(t.shape)} is not the {offset} the split expects along dim {split.dim}")
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=split.dim)


def _take_blocks(b: Q4Blocks, split: Split) -> Q4Blocks:
    """The same split on raw Q4 blocks: rows as they are; columns only on whole blocks."""
    if split.dim == 0:
        return Q4Blocks(b.kind, _take(b.data, split).contiguous())
    parts = []
    for part in split.parts:
        first, count = part.take.start * part.unit, len(part.take) * part.unit  # in weights
        if first % GROUP or count % GROUP:
            raise ShardError(f"a 4-bit weight's input columns split into {count} per rank, not whole "
                             f"{GROUP}-weight blocks; use model.quantization none or int8")
        parts.append(Part(block_bytes(b.kind), part.total * part.unit // GROUP,
                          range(first // GROUP, (first + count) // GROUP)))
    return Q4Blocks(b.kind, _take(b.data, Split(1, tuple(parts))).contiguous())


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
