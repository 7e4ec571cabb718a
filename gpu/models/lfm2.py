"""LFM2 decoder (`Lfm2ForCausalLM`): gated short-conv layers and GQA attention layers with
QK-norm, per the config's layer types, over a paged KV cache (attention layers) and a
StatePool (the conv layers' windows).

Plain tensors, like gpu/models/llama.py; the decoder loop is gpu/models/hybrid_base.py's.
The math follows transformers' `modeling_lfm2`: a conv layer projects to (B, C, x),
convolves B * x causally (depthwise, no activation) and outputs out_proj(C * conv); the
final norm is called `embedding_norm`; the MLP is SwiGLU (w1 gate, w3 up, w2 down) with
the auto-adjusted ff dim from the loader. Deterministic mode needs only the batch-invariant
matmuls: the conv is batch-invariant as is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cache.state_pool import LayerStateShape, StatePool
from gpu.attention.base import AttentionBackend
from gpu.models.hybrid_base import BlockNames, HybridDecoder
from gpu.models.hybrid_common import Weights, rms_norm
from gpu.models.hybrid_step import HybridStep
from kernel.registry import register

CONV = "conv"


class _Attention(NamedTuple):
    qkv: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    out: torch.Tensor


class _ShortConv(NamedTuple):
    in_proj: torch.Tensor  # [B | C | x] rows
    in_bias: torch.Tensor | None
    conv: torch.Tensor  # [hidden, kernel]
    conv_bias: torch.Tensor | None
    out: torch.Tensor
    out_bias: torch.Tensor | None


@register("model", "lfm2")
class Lfm2Model(HybridDecoder[_Attention, _ShortConv]):
    name = "lfm2"
    state_kind = CONV
    final_norm = "model.embedding_norm.weight"
    block_names = BlockNames(
        mixer_norm="operator_norm.weight",
        mlp_norm="ffn_norm.weight",
        gate="feed_forward.w1.weight",
        up="feed_forward.w3.weight",
        down="feed_forward.w2.weight",
    )
    attention_type = _Attention

    def _init_sizes(self) -> None:
        # The short conv's channels: hidden_size, or this rank's share of them (tensor parallelism).
        self.conv_channels = self.arch.hidden_size // (self.tp.size if self.tp is not None else 1)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.arch.rms_norm_eps)

    def _attention_weights(self, w: Weights, p: str) -> _Attention:
        return _Attention(
            qkv=w.cat([p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
            q_norm=w.get(p + "self_attn.q_layernorm.weight"),
            k_norm=w.get(p + "self_attn.k_layernorm.weight"),
            out=w.get(p + "self_attn.out_proj.weight"),
        )

    def _state_weights(self, w: Weights, p: str) -> _ShortConv:
        c = p + "conv."
        # Biases exist only with conv_bias; a checkpoint that has them must use them.
        return _ShortConv(
            in_proj=w.get(c + "in_proj.weight"),
            in_bias=w.maybe(c + "in_proj.bias"),
            conv=w.get(c + "conv.weight").reshape(self.conv_channels, -1),
            conv_bias=w.maybe(c + "conv.bias"),
            out=w.get(c + "out_proj.weight"),
            out_bias=w.maybe(c + "out_proj.bias"),
        )

    def state_shapes(self) -> list[LayerStateShape]:
        """What a StatePool for this model holds, one entry per conv layer (no recurrent state)."""
        return [
            LayerStateShape(self.conv_channels, self.arch.conv_kernel - 1, None)
        ] * self.num_state_layers

    def _attention(
        self,
        kv_layer: int,
        layer: _Attention,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        arch = self.arch
        tokens, n_q = x.shape[0], arch.num_heads * arch.head_dim
        qkv = self.linear(x, layer.qkv)
        q = qkv[:, :n_q].view(tokens, arch.num_heads, arch.head_dim)
        o = self._attend(kv_layer, q, qkv[:, n_q:], layer.q_norm, layer.k_norm, cos, sin, attn)
        return self._reduce(self.linear(o.reshape(tokens, n_q), layer.out), None)

    def _state_mixer(
        self, state_layer: int, layer: _ShortConv, x: torch.Tensor, step: HybridStep, pool: StatePool
    ) -> torch.Tensor:
        """The gated short conv: out_proj(C * conv(B * x)), the conv window carried in `pool`."""
        b, c, xs = self.linear(x, layer.in_proj, layer.in_bias).chunk(3, dim=-1)
        y = self._carried_conv(state_layer, b * xs, layer.conv, layer.conv_bias, step, pool)
        return self._reduce(self.linear(c * y, layer.out), layer.out_bias)
