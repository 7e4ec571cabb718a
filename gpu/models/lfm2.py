"""LFM2 decoder (`Lfm2ForCausalLM`): gated short-conv layers and GQA attention layers with
QK-norm, per the config's layer types, over a paged KV cache (attention layers) and a
StatePool (the conv layers' windows).

Plain tensors, like gpu/models/llama.py; the math follows transformers' `modeling_lfm2`:
a conv layer projects to (B, C, x), convolves B * x causally (depthwise, no activation)
and outputs out_proj(C * conv); the final norm is called `embedding_norm`; the MLP is
SwiGLU (w1 gate, w3 up, w2 down) with the auto-adjusted ff dim from the loader.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from cache.state_pool import LayerStateShape, StatePool
from gpu.attention.base import AttentionBackend
from gpu.batch_invariant import linear_tiled
from gpu.kernels.short_conv import short_conv_varlen
from gpu.model_config import ModelArchConfig
from gpu.models.hybrid_common import Weights, apply_rope, rms_norm, rope_cos_sin, swiglu
from gpu.models.hybrid_step import HybridStep
from kernel.registry import register

FULL = "full_attention"
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


class _Block(NamedTuple):
    kind_index: int  # among the layers of its own kind (KV layer or state layer)
    mixer: _Attention | _ShortConv
    operator_norm: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@register("model", "lfm2")
class Lfm2Model:
    def __init__(
        self,
        arch: ModelArchConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        deterministic: bool = False,
    ) -> None:
        if arch.layer_types is None or len(arch.layer_types) != arch.num_layers:
            raise ValueError("lfm2 needs one layer_types entry per layer")
        if arch.rope_scaling is not None:
            raise NotImplementedError(f"lfm2: rope scaling {arch.rope_scaling!r} is not supported")
        self.arch = arch
        self.dtype = dtype
        self.device = device
        self.deterministic = deterministic
        # Deterministic mode: batch-invariant matmuls; the conv is batch-invariant as is.
        self.linear = linear_tiled if deterministic else F.linear
        w = Weights(weights, dtype, device)
        self.embed = w.get("model.embed_tokens.weight")
        self.norm = w.get("model.embedding_norm.weight")
        tied = arch.tie_word_embeddings or "lm_head.weight" not in w
        self.lm_head = self.embed if tied else w.get("lm_head.weight")
        self.blocks: list[_Block] = []
        counts = {FULL: 0, CONV: 0}
        for i, kind in enumerate(arch.layer_types):
            if kind not in counts:
                raise ValueError(f"lfm2: unknown layer type {kind!r} at layer {i}")
            p = f"model.layers.{i}."
            mixer = self._attention_weights(w, p) if kind == FULL else self._conv_weights(w, p)
            self.blocks.append(
                _Block(
                    kind_index=counts[kind],
                    mixer=mixer,
                    operator_norm=w.get(p + "operator_norm.weight"),
                    ffn_norm=w.get(p + "ffn_norm.weight"),
                    gate_up=w.cat([p + "feed_forward.w1.weight", p + "feed_forward.w3.weight"]),
                    down=w.get(p + "feed_forward.w2.weight"),
                )
            )
            counts[kind] += 1
        self.num_kv_layers = counts[FULL]
        self.num_state_layers = counts[CONV]

    @staticmethod
    def _attention_weights(w: Weights, p: str) -> _Attention:
        return _Attention(
            qkv=w.cat([p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
            q_norm=w.get(p + "self_attn.q_layernorm.weight"),
            k_norm=w.get(p + "self_attn.k_layernorm.weight"),
            out=w.get(p + "self_attn.out_proj.weight"),
        )

    def _conv_weights(self, w: Weights, p: str) -> _ShortConv:
        c = p + "conv."
        # Biases exist only with conv_bias; a checkpoint that has them must use them.
        return _ShortConv(
            in_proj=w.get(c + "in_proj.weight"),
            in_bias=w.maybe(c + "in_proj.bias"),
            conv=w.get(c + "conv.weight").reshape(self.arch.hidden_size, -1),
            conv_bias=w.maybe(c + "conv.bias"),
            out=w.get(c + "out_proj.weight"),
            out_bias=w.maybe(c + "out_proj.bias"),
        )

    def state_shapes(self) -> list[LayerStateShape]:
        """What a StatePool for this model holds, one entry per conv layer (no recurrent state)."""
        return [
            LayerStateShape(self.arch.hidden_size, self.arch.conv_kernel - 1, None)
        ] * self.num_state_layers

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

        Reads each request's conv windows from `state.src_slots` and writes the windows
        after its last token of the step to `state.dst_slots`, every conv layer.
        """
        arch = self.arch
        eps = arch.rms_norm_eps
        cos, sin = rope_cos_sin(positions, arch.head_dim, arch.rope_theta, self.dtype)
        h = self.embed[input_ids]
        for block in self.blocks:
            x = rms_norm(h, block.operator_norm, eps)
            if isinstance(block.mixer, _Attention):
                h = h + self._attention(block.kind_index, block.mixer, x, cos, sin, attn)
            else:
                h = h + self._short_conv(block.kind_index, block.mixer, x, state, pool)
            x = rms_norm(h, block.ffn_norm, eps)
            h = h + swiglu(self.linear, x, block.gate_up, block.down)
        last = rms_norm(h.index_select(0, logits_indices), self.norm, eps)
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
        n_q, n_kv = arch.num_heads * hd, arch.num_kv_heads * hd
        qkv = self.linear(x, layer.qkv)
        q = qkv[:, :n_q].view(tokens, arch.num_heads, hd)
        k = qkv[:, n_q : n_q + n_kv].view(tokens, arch.num_kv_heads, hd)
        v = qkv[:, n_q + n_kv :].view(tokens, arch.num_kv_heads, hd)
        q = apply_rope(rms_norm(q, layer.q_norm, arch.rms_norm_eps), cos, sin)
        k = apply_rope(rms_norm(k, layer.k_norm, arch.rms_norm_eps), cos, sin)
        o = attn.forward(kv_layer, q.contiguous(), k.contiguous(), v.contiguous())
        return self.linear(o.reshape(tokens, n_q), layer.out)

    def _short_conv(
        self, state_layer: int, layer: _ShortConv, x: torch.Tensor, step: HybridStep, pool: StatePool
    ) -> torch.Tensor:
        b, c, xs = self.linear(x, layer.in_proj, layer.in_bias).chunk(3, dim=-1)
        conv_pool = pool.conv[state_layer]
        y, windows = short_conv_varlen(
            b * xs, step.load(conv_pool), step.extend_lens, layer.conv, layer.conv_bias
        )
        step.store(conv_pool, windows)
        return self.linear(c * y, layer.out, layer.out_bias)
