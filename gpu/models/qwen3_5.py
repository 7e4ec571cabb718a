"""Qwen3.5 text decoder (`Qwen3_5ForCausalLM`): Gated DeltaNet linear-attention layers and
gated full-attention layers, per the config's `layer_types`, over a paged KV cache (the
attention layers) and a StatePool (conv windows and recurrent states of the others).

Plain tensors, no nn.Module, like gpu/models/llama.py. The math follows transformers'
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
from gpu.batch_invariant import linear_tiled
from gpu.kernels.gated_delta import gated_delta_varlen
from gpu.kernels.short_conv import short_conv_varlen
from gpu.model_config import ModelArchConfig
from gpu.models.hybrid_common import (
    Weights,
    apply_rope,
    gated_rms_norm,
    rms_norm_zero_centred,
    rope_cos_sin,
    softplus,
    swiglu,
)
from gpu.models.hybrid_step import HybridStep
from kernel.registry import register

FULL = "full_attention"
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


class _Block(NamedTuple):
    kind_index: int  # among the layers of its own kind (KV layer or state layer)
    mixer: _Attention | _DeltaNet
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@register("model", "qwen3_5_text")
class Qwen3_5Model:
    def __init__(
        self,
        arch: ModelArchConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        deterministic: bool = False,
    ) -> None:
        if arch.layer_types is None or len(arch.layer_types) != arch.num_layers:
            raise ValueError("qwen3_5_text needs one layer_types entry per layer")
        if arch.rope_scaling is not None:
            raise NotImplementedError(f"qwen3_5_text: rope scaling {arch.rope_scaling!r} is not supported")
        self.arch = arch
        self.dtype = dtype
        self.device = device
        self.deterministic = deterministic
        # Deterministic mode: batch-invariant matmuls and the recurrent form of the delta
        # rule in prefill, so a state is the same whether reached by prefill or decode.
        self.linear = linear_tiled if deterministic else F.linear
        self.rotary_dim = int(arch.head_dim * arch.partial_rotary_factor)
        self.key_dim = arch.linear_num_key_heads * arch.linear_key_head_dim
        self.value_dim = arch.linear_num_value_heads * arch.linear_value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        w = Weights(weights, dtype, device)
        self.embed = w.get("model.embed_tokens.weight")
        self.norm = w.get("model.norm.weight")
        tied = arch.tie_word_embeddings or "lm_head.weight" not in w
        self.lm_head = self.embed if tied else w.get("lm_head.weight")
        self.blocks: list[_Block] = []
        counts = {FULL: 0, LINEAR: 0}
        for i, kind in enumerate(arch.layer_types):
            if kind not in counts:
                raise ValueError(f"qwen3_5_text: unknown layer type {kind!r} at layer {i}")
            p = f"model.layers.{i}."
            mixer = self._attention_weights(w, p) if kind == FULL else self._delta_weights(w, p)
            self.blocks.append(
                _Block(
                    kind_index=counts[kind],
                    mixer=mixer,
                    input_norm=w.get(p + "input_layernorm.weight"),
                    post_norm=w.get(p + "post_attention_layernorm.weight"),
                    gate_up=w.cat([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                    down=w.get(p + "mlp.down_proj.weight"),
                )
            )
            counts[kind] += 1
        self.num_kv_layers = counts[FULL]
        self.num_state_layers = counts[LINEAR]

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

    def _delta_weights(self, w: Weights, p: str) -> _DeltaNet:
        q = p + "linear_attn."
        return _DeltaNet(
            in_proj=w.cat([q + f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")]),
            conv=w.get(q + "conv1d.weight").reshape(self.conv_dim, -1),
            neg_a=-w.get(q + "A_log", torch.float32).exp(),
            dt_bias=w.get(q + "dt_bias", torch.float32),
            norm=w.get(q + "norm.weight"),
            out=w.get(q + "out_proj.weight"),
        )

    def state_shapes(self) -> list[LayerStateShape]:
        """What a StatePool for this model holds, one entry per linear-attention layer."""
        arch = self.arch
        heads_dims = (arch.linear_num_value_heads, arch.linear_key_head_dim, arch.linear_value_head_dim)
        return [LayerStateShape(self.conv_dim, arch.conv_kernel - 1, heads_dims)] * self.num_state_layers

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
        last token of the step to `state.dst_slots`, every linear layer.
        """
        eps = self.arch.rms_norm_eps
        cos, sin = rope_cos_sin(positions, self.rotary_dim, self.arch.rope_theta, self.dtype)
        h = self.embed[input_ids]
        for block in self.blocks:
            x = rms_norm_zero_centred(h, block.input_norm, eps)
            if isinstance(block.mixer, _Attention):
                h = h + self._attention(block.kind_index, block.mixer, x, cos, sin, attn)
            else:
                h = h + self._delta_net(block.kind_index, block.mixer, x, state, pool)
            x = rms_norm_zero_centred(h, block.post_norm, eps)
            h = h + swiglu(self.linear, x, block.gate_up, block.down)
        last = rms_norm_zero_centred(h.index_select(0, logits_indices), self.norm, eps)
        return self.linear(last, self.lm_head).float()

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
        n_qg, n_kv = 2 * arch.num_heads * hd, arch.num_kv_heads * hd
        qkv = self.linear(x, layer.qkv, layer.qkv_bias)
        # q_proj interleaves per head: [query (head_dim) | gate (head_dim)].
        qg = qkv[:, :n_qg].view(tokens, arch.num_heads, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(tokens, -1)
        k = qkv[:, n_qg : n_qg + n_kv].view(tokens, arch.num_kv_heads, hd)
        v = qkv[:, n_qg + n_kv :].view(tokens, arch.num_kv_heads, hd)
        q = apply_rope(rms_norm_zero_centred(q, layer.q_norm, arch.rms_norm_eps), cos, sin)
        k = apply_rope(rms_norm_zero_centred(k, layer.k_norm, arch.rms_norm_eps), cos, sin)
        o = attn.forward(kv_layer, q.contiguous(), k.contiguous(), v.contiguous())
        return self.linear(o.reshape(tokens, -1) * torch.sigmoid(gate), layer.o)

    def _delta_net(
        self, state_layer: int, layer: _DeltaNet, x: torch.Tensor, step: HybridStep, pool: StatePool
    ) -> torch.Tensor:
        arch = self.arch
        tokens = x.shape[0]
        heads_k, heads_v = arch.linear_num_key_heads, arch.linear_num_value_heads
        dk, dv = arch.linear_key_head_dim, arch.linear_value_head_dim
        proj = self.linear(x, layer.in_proj)
        mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, heads_v, heads_v], dim=-1)
        conv_pool = pool.conv[state_layer]
        mixed, windows = short_conv_varlen(mixed, step.load(conv_pool), step.extend_lens, layer.conv)
        step.store(conv_pool, windows)
        mixed = F.silu(mixed)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        # Each key head serves heads_v // heads_k consecutive value heads.
        rep = heads_v // heads_k
        q = _l2norm(q.reshape(tokens, heads_k, dk).float()).repeat_interleave(rep, dim=1) * dk**-0.5
        k = _l2norm(k.reshape(tokens, heads_k, dk).float()).repeat_interleave(rep, dim=1)
        beta = torch.sigmoid(b).float()
        g = layer.neg_a * softplus(a.float() + layer.dt_bias)
        rec_pool = pool.recurrent_of(state_layer)
        out, states = gated_delta_varlen(
            q,
            k,
            v.reshape(tokens, heads_v, dv).float(),
            g,
            beta,
            step.load(rec_pool),
            step.extend_lens,
            step.prefix_lens,
            recurrent=self.deterministic,
        )
        step.store(rec_pool, states)
        out = gated_rms_norm(out.to(x.dtype), z.reshape(tokens, heads_v, dv), layer.norm, arch.rms_norm_eps)
        return self.linear(out.reshape(tokens, self.value_dim), layer.out)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| per head, as the reference (and FLA) do: eps inside the root."""
    return x * (1.0 / torch.sqrt((x * x).sum(-1, keepdim=True) + eps))
