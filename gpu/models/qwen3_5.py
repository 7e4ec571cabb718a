"""Qwen3.5 text decoder (`Qwen3_5ForCausalLM`): Gated DeltaNet linear-attention layers and
gated full-attention layers, per the config's `layer_types`, over a paged KV cache (the
attention layers) and a StatePool (conv windows and recurrent states of the others).

Plain tensors, no nn.Module, like gpu/models/llama.py; the decoder loop is
gpu/models/hybrid_base.py's. The math follows transformers'
`modeling_qwen3_5` (torch fallback paths): zero-centred RMSNorms `x * (1 + w)`, an
output gate on attention, partial RoPE, and for the linear layers a causal conv over
q/k/v with SiLU, L2-normed q/k, decay g = -exp(A_log) * softplus(a + dt_bias),
beta = sigmoid(b), the gated delta rule, and a gated RMSNorm with z.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from cache.state_pool import LayerStateShape, StatePool
from gpu.attention.base import AttentionBackend
from gpu.batch_invariant import pointwise, sum_last
from gpu.kernels.gated_delta import DeltaInputs, gated_delta_static, gated_delta_varlen
from gpu.models.hybrid_base import BlockNames, HybridDecoder
from gpu.models.hybrid_common import Weights, gated_rms_norm, rms_norm_zero_centred, softplus
from gpu.models.hybrid_step import HybridStep
from kernel.registry import register

LINEAR = "linear_attention"


class _Attention(NamedTuple):
    qkv: torch.Tensor  # [q with gate per head | k | v] rows
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: torch.Tensor


class _DeltaNet(NamedTuple):
    in_proj: torch.Tensor  # [qkv | z | b | a] rows
    conv: torch.Tensor  # [conv_dim, kernel]
    neg_a: torch.Tensor  # -exp(A_log), float32 [Hv]
    dt_bias: torch.Tensor  # float32 [Hv]
    norm: torch.Tensor  # gated RMSNorm weight [v_dim]
    out: torch.Tensor


@register("model", "qwen3_5_text")
class Qwen3_5Model(HybridDecoder[_Attention, _DeltaNet]):
    """Deterministic mode adds, to the batch-invariant matmuls, the recurrent form of the
    delta rule in prefill, so a state is the same whether reached by prefill or decode.
    `native_recurrence` (set by kernel/model_build.py where the C++ kernel runs: CPU,
    `model.cpu_kernels` auto): every step's delta rule, prefill and decode, in any mode,
    through the C++ recurrent form (gpu/kernels/gated_delta.py `native_varlen`)."""

    name = "qwen3_5_text"
    native_recurrence = False
    state_kind = LINEAR
    final_norm = "model.norm.weight"
    block_names = BlockNames(
        mixer_norm="input_layernorm.weight",
        mlp_norm="post_attention_layernorm.weight",
        gate="mlp.gate_proj.weight",
        up="mlp.up_proj.weight",
        down="mlp.down_proj.weight",
    )
    attention_type = _Attention

    def _rotary_dim(self) -> int:
        return int(self.arch.head_dim * self.arch.partial_rotary_factor)

    def _init_sizes(self) -> None:
        arch = self.arch
        self.key_dim = arch.linear_num_key_heads * arch.linear_key_head_dim
        self.value_dim = arch.linear_num_value_heads * arch.linear_value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm_zero_centred(x, weight, self.arch.rms_norm_eps)

    def _attention_weights(self, w: Weights, p: str) -> _Attention:
        names = [p + f"self_attn.{n}_proj" for n in "qkv"]
        bias = w.cat([n + ".bias" for n in names]) if self.arch.attention_bias else None
        return _Attention(
            qkv=w.cat([n + ".weight" for n in names]),
            qkv_bias=bias,
            q_norm=w.get(p + "self_attn.q_norm.weight"),
            k_norm=w.get(p + "self_attn.k_norm.weight"),
            o=w.get(p + "self_attn.o_proj.weight"),
        )

    def _state_weights(self, w: Weights, p: str) -> _DeltaNet:
        q = p + "linear_attn."
        return _DeltaNet(
            in_proj=self._in_proj(w, q),
            conv=w.get(q + "conv1d.weight").reshape(self.conv_dim, -1),
            neg_a=-w.get(q + "A_log", torch.float32).exp(),
            dt_bias=w.get(q + "dt_bias", torch.float32),
            norm=w.get(q + "norm.weight"),
            out=w.get(q + "out_proj.weight"),
        )

    def _in_proj(self, w: Weights, q: str) -> torch.Tensor:
        """A linear layer's input projection, rows [q | k | v (conv input) | z | b | a]."""
        return w.cat([q + f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")])

    def state_shapes(self) -> list[LayerStateShape]:
        """What a StatePool for this model holds, one entry per linear-attention layer."""
        arch = self.arch
        heads_dims = (arch.linear_num_value_heads, arch.linear_key_head_dim, arch.linear_value_head_dim)
        return [LayerStateShape(self.conv_dim, arch.conv_kernel - 1, heads_dims)] * self.num_state_layers

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
        tokens, hd = x.shape[0], arch.head_dim
        n_qg = 2 * arch.num_heads * hd
        qkv = self.linear(x, layer.qkv, layer.qkv_bias)
        # q_proj interleaves per head: [query (head_dim) | gate (head_dim)].
        qg = qkv[:, :n_qg].view(tokens, arch.num_heads, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(tokens, -1)
        o = self._attend(kv_layer, q, qkv[:, n_qg:], layer.q_norm, layer.k_norm, cos, sin, attn)
        return self._reduce(self.linear(o.reshape(tokens, -1) * pointwise(torch.sigmoid, gate), layer.o), None)

    def _state_mixer(
        self, state_layer: int, layer: _DeltaNet, x: torch.Tensor, step: HybridStep, pool: StatePool
    ) -> torch.Tensor:
        """Gated DeltaNet: conv window and recurrent state carried in `pool`."""
        arch = self.arch
        tokens = x.shape[0]
        heads_k, heads_v = arch.linear_num_key_heads, arch.linear_num_value_heads
        dk, dv = arch.linear_key_head_dim, arch.linear_value_head_dim
        proj = self.linear(x, layer.in_proj)
        mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, heads_v, heads_v], dim=-1)
        mixed = pointwise(F.silu, self._carried_conv(state_layer, mixed, layer.conv, None, step, pool))
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        # Each key head serves heads_v // heads_k consecutive value heads.
        rep = heads_v // heads_k
        q = _l2norm(q.reshape(tokens, heads_k, dk).float()).repeat_interleave(rep, dim=1) * dk**-0.5
        k = _l2norm(k.reshape(tokens, heads_k, dk).float()).repeat_interleave(rep, dim=1)
        beta = pointwise(torch.sigmoid, b).float()
        g = layer.neg_a * softplus(a.float() + layer.dt_bias)
        rec_pool = pool.recurrent_of(state_layer)
        inputs = DeltaInputs(q, k, v.reshape(tokens, heads_v, dv).float(), g, beta)
        if step.static_lens is not None:  # a verify bucket: the state after every token
            out, states, tracked = gated_delta_static(inputs, step.load(rec_pool), step.static_lens,
                                                      step.static_steps, native=self.native_recurrence)
        else:
            out, states, tracked = gated_delta_varlen(
                inputs,
                step.load(rec_pool),
                step.extend_lens,
                step.prefix_lens,
                recurrent=self.deterministic,
                track=step.track_points,
                native=self.native_recurrence,
            )
        step.store(rec_pool, states)
        step.store_tracked(rec_pool, tracked)
        out = gated_rms_norm(out.to(x.dtype), z.reshape(tokens, heads_v, dv), layer.norm, arch.rms_norm_eps)
        return self._reduce(self.linear(out.reshape(tokens, self.value_dim), layer.out), None)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| per head, as the reference (and FLA) do: eps inside the root."""
    return x * (1.0 / torch.sqrt(sum_last(x, square=True) + eps))
