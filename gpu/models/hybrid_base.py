"""The decoder that the hybrid models (Qwen3.5, LFM2) share: checks on the config, the
weights every block has, and the forward loop; each model supplies its norm, its weight
names and its two mixers (attention layers over the paged KV cache, state layers over the
StatePool) through the hooks below.

Per block: norm -> attention or state mixer -> residual, norm -> SwiGLU -> residual; then
the final norm and lm_head on the `logits_indices` rows only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Generic, NamedTuple, TypeVar, cast

import torch
import torch.nn.functional as F

from cache.state_pool import LayerStateShape, StatePool
from gpu.attention.base import AttentionBackend
from gpu.batch_invariant import linear_tiled
from gpu.kernels.short_conv import short_conv_static, short_conv_varlen, short_conv_windows_at
from gpu.model_config import ModelArchConfig
from gpu.models.hybrid_common import Weights, apply_rope, rope_cos_sin, swiglu
from gpu.models.hybrid_step import HybridStep
from gpu.parallel.group import TensorParallel, reduce_then_bias

FULL = "full_attention"

A = TypeVar("A")  # a model's attention-layer weights
S = TypeVar("S")  # a model's state-layer weights


class HybridBlock(NamedTuple, Generic[A, S]):
    kind_index: int  # among the layers of its own kind (KV layer or state layer)
    mixer: A | S
    mixer_norm: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor | None  # None in a MoE model's sparse layers (its `_mlp` runs them)
    down: torch.Tensor | None


class BlockNames(NamedTuple):
    """Checkpoint names, after `model.layers.{i}.`, of a block's two norms and its MLP."""

    mixer_norm: str
    mlp_norm: str
    gate: str
    up: str
    down: str


class HybridDecoder(ABC, Generic[A, S]):
    """A decoder of full-attention layers and state layers, per the config's `layer_types`."""

    name: ClassVar[str]  # the registered architecture, for messages
    state_kind: ClassVar[str]  # the `layer_types` entry of the state layers
    final_norm: ClassVar[str]  # checkpoint name of the final norm's weight
    block_names: ClassVar[BlockNames]
    attention_type: type[A]  # the class of the attention layers' weights
    accepts_tp = True  # accepts `tp`: this rank's part of a tensor-parallel group (gpu/parallel/)

    def __init__(
        self,
        arch: ModelArchConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        deterministic: bool = False,
        tp: TensorParallel | None = None,
    ) -> None:
        # With `tp`, arch's head and channel counts and the weights are this rank's shard
        # (gpu/parallel/shard.py); vocab_size and hidden_size stay whole.
        self.tp = tp
        if arch.layer_types is None or len(arch.layer_types) != arch.num_layers:
            raise ValueError(f"{self.name} needs one layer_types entry per layer")
        if arch.rope_scaling is not None:
            raise NotImplementedError(f"{self.name}: rope scaling {arch.rope_scaling!r} is not supported")
        self.arch = arch
        self.dtype = dtype
        self.device = device
        self.deterministic = deterministic
        # Deterministic mode: batch-invariant matmuls; what else it changes is the model's
        # (see its state mixer).
        self.linear = linear_tiled if deterministic else F.linear
        self.rotary_dim = self._rotary_dim()
        self._init_sizes()
        w = Weights(weights, dtype, device)
        self.embed = w.get("model.embed_tokens.weight")
        self.norm = w.get(self.final_norm)
        tied = arch.tie_word_embeddings or "lm_head.weight" not in w
        self.lm_head = self.embed if tied else w.get("lm_head.weight")
        self.blocks: list[HybridBlock[A, S]] = []
        names = self.block_names
        counts = {FULL: 0, self.state_kind: 0}
        for i, kind in enumerate(arch.layer_types):
            if kind not in counts:
                raise ValueError(f"{self.name}: unknown layer type {kind!r} at layer {i}")
            p = f"model.layers.{i}."
            mixer: A | S = self._attention_weights(w, p) if kind == FULL else self._state_weights(w, p)
            dense = i not in arch.sparse_layers
            self.blocks.append(
                HybridBlock(
                    kind_index=counts[kind],
                    mixer=mixer,
                    mixer_norm=w.get(p + names.mixer_norm),
                    mlp_norm=w.get(p + names.mlp_norm),
                    gate_up=w.cat([p + names.gate, p + names.up]) if dense else None,
                    down=w.get(p + names.down) if dense else None,
                )
            )
            counts[kind] += 1
        self.num_kv_layers = counts[FULL]
        self.num_state_layers = counts[self.state_kind]

    # Hooks: what each model supplies.

    def _rotary_dim(self) -> int:
        """How many dims of each head RoPE rotates (all by default)."""
        return self.arch.head_dim

    def _init_sizes(self) -> None:
        """Sizes the weight hooks and mixers need, set before any weight is read."""

    @abstractmethod
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm (blocks, final norm and QK-norm)."""

    @abstractmethod
    def _attention_weights(self, w: Weights, p: str) -> A: ...

    @abstractmethod
    def _state_weights(self, w: Weights, p: str) -> S: ...

    @abstractmethod
    def _attention(
        self,
        kv_layer: int,
        layer: A,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """An attention layer's mixer output for the normed hidden states x."""

    @abstractmethod
    def _state_mixer(
        self, state_layer: int, layer: S, x: torch.Tensor, step: HybridStep, pool: StatePool
    ) -> torch.Tensor:
        """A state layer's mixer output for x; reads and writes its states in `pool`."""

    @abstractmethod
    def state_shapes(self) -> list[LayerStateShape]:
        """What a StatePool for this model holds, one entry per state layer."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        logits_indices: torch.Tensor,
        state: HybridStep,
        pool: StatePool,
    ) -> torch.Tensor:
        """Hidden states for all tokens; float32 logits only for `logits_indices` rows.

        Reads each request's state from `state.src_slots` and writes the state after its
        last token of the step to `state.dst_slots`, and the state after each tracked
        length to its slot (`state.track`), every state layer.
        """
        return self.logits(self.hidden(input_ids, positions, attn, state, pool).index_select(0, logits_indices))

    def hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
        state: HybridStep, pool: StatePool,
    ) -> torch.Tensor:
        """The last layer's hidden states of every token (before the final norm); reads
        and writes states as `forward` does."""
        cos, sin = rope_cos_sin(positions, self.rotary_dim, self.arch.rope_theta, self.dtype)
        h = self.embed[input_ids] if self.tp is None else self.tp.embed(self.embed, input_ids)
        for i, block in enumerate(self.blocks):
            x = self._norm(h, block.mixer_norm)
            if isinstance(block.mixer, self.attention_type):
                h = h + self._attention(block.kind_index, block.mixer, x, cos, sin, attn)
            else:
                h = h + self._state_mixer(block.kind_index, cast(S, block.mixer), x, state, pool)
            x = self._norm(h, block.mlp_norm)
            h = h + self._mlp(i, block, x)
        return h

    def _mlp(self, i: int, block: HybridBlock[A, S], x: torch.Tensor) -> torch.Tensor:
        """Layer i's MLP on its normed input x (SwiGLU; a MoE model's sparse layers override)."""
        assert block.gate_up is not None and block.down is not None, f"layer {i} has no dense MLP"
        return self._reduce(swiglu(self.linear, x, block.gate_up, block.down), None)

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 logits of some rows of `hidden`: the final norm, then the lm_head (row-wise)."""
        logits = self.linear(self._norm(rows, self.norm), self.lm_head).float()
        return logits if self.tp is None else self.tp.gather_vocab(logits)

    def _reduce(self, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A row-parallel linear's output on every rank (gpu/parallel/group.py)."""
        return reduce_then_bias(self.tp, partial, bias)

    # Pieces both models' mixers use.

    def _attend(
        self,
        kv_layer: int,
        q: torch.Tensor,
        kv: torch.Tensor,
        q_norm: torch.Tensor,
        k_norm: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """QK-norm, RoPE and the KV-cache attention: q [T, heads, head_dim] and the k | v
        columns of the projection kv [T, 2 * kv_heads * head_dim] -> [T, heads, head_dim]."""
        arch = self.arch
        tokens, hd = kv.shape[0], arch.head_dim
        n_kv = arch.num_kv_heads * hd
        k = kv[:, :n_kv].view(tokens, arch.num_kv_heads, hd)
        v = kv[:, n_kv:].view(tokens, arch.num_kv_heads, hd)
        q = apply_rope(self._norm(q, q_norm), cos, sin)
        k = apply_rope(self._norm(k, k_norm), cos, sin)
        return attn.forward(kv_layer, q.contiguous(), k.contiguous(), v.contiguous())

    @staticmethod
    def _carried_conv(
        state_layer: int,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        step: HybridStep,
        pool: StatePool,
    ) -> torch.Tensor:
        """The causal depthwise conv over x [T, channels], each request resuming from its
        window in the pool and leaving the window after its last token there (and the
        windows at its tracked lengths in their slots)."""
        conv_pool = pool.conv[state_layer]
        start = step.load(conv_pool)
        if step.static_lens is not None:  # a verify bucket: the window after every token
            y, windows, after = short_conv_static(x, start, step.static_lens, weight, bias)
            step.store(conv_pool, windows)
            step.store_tracked(conv_pool, after)
            return y
        y, windows = short_conv_varlen(x, start, step.extend_lens, weight, bias)
        step.store(conv_pool, windows)
        if step.writes_tracked:
            step.store_tracked(conv_pool, short_conv_windows_at(x, start, step.extend_lens, step.track_points))
        return y
