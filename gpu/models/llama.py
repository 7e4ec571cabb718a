"""Llama-family decoder (Llama/SmolLM2, Qwen2 with QKV bias, Qwen3 with QK-norm) over a
paged KV cache. Plain tensors, no nn.Module: the weights are read once at load, fused
(qkv, gate_up) to cut the number of matmuls per layer, and never trained.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from gpu.attention.base import AttentionBackend
from gpu.batch_invariant import linear_tiled, mean_of_squares, pointwise
from gpu.model_config import ModelArchConfig
from gpu.models import llama_glue as glue
from gpu.models.hybrid_common import Weights, swiglu
from gpu.parallel.group import TensorParallel, reduce_then_bias
from gpu.quant import few_rows
from gpu.quant.dispatch import LinearWeight, QuantSpec, build_linear, make_linear
from kernel.registry import register

_NO_MLP = torch.empty(0)


class _Layer(NamedTuple):
    input_norm: torch.Tensor
    qkv: LinearWeight
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: LinearWeight
    post_norm: torch.Tensor
    gate_up: LinearWeight
    down: LinearWeight
    # Row-parallel biases (Llama's attention_bias / mlp_bias): added once, after the
    # all-reduce under tensor parallelism (`_reduce`).
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


@register("model", "llama", "qwen2", "qwen3")
class LlamaModel:
    quantizable = True  # accepts `quantization` (model.quantization int8 / int4)
    accepts_cpu_kernels = True  # accepts `cpu_kernels` (model.cpu_kernels)
    accepts_tp = True  # accepts `tp`: this rank's part of a tensor-parallel group (gpu/parallel/)

    def __init__(
        self,
        arch: ModelArchConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        deterministic: bool = False,
        quantization: QuantSpec | None = None,
        cpu_kernels: bool = False,
        tp: TensorParallel | None = None,
    ) -> None:
        # With `tp`, arch's head and channel counts and the weights are this rank's shard
        # (gpu/parallel/shard.py); vocab_size stays the whole vocabulary.
        self.arch = arch
        self.tp = tp
        self.cpu_kernels = cpu_kernels  # may use gpu/kernels/cpu/
        # The fused C++ glue (norms, residual adds, RoPE, SiLU*up) where it can run; in
        # deterministic mode too: each row's (head's, element's) arithmetic is its own.
        self.fused = glue.available(cpu_kernels, dtype, device)
        # Deterministic mode: every matmul is batch-invariant (see gpu/batch_invariant.py).
        # Float32 weights (an unquantized model, a MoE model's experts): few-row steps through
        # the C++ kernel that reads each weight once (gpu/quant/few_rows.py).
        few = not deterministic and few_rows.available(cpu_kernels, dtype, device)
        self.linear = make_linear(linear_tiled if deterministic else F.linear, deterministic,
                                  few_rows.linear if few else None)
        self.dtype = dtype
        self.device = device
        w = Weights(weights, dtype, device, quantization)
        self.embed = w.get("model.embed_tokens.weight")
        self.norm = w.get("model.norm.weight")
        tied = arch.tie_word_embeddings or "lm_head.weight" not in w
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        self.lm_head = build_linear(quantization, [head], self.embed if tied else w.get(head))
        self.layers: list[_Layer] = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            bias = None
            if arch.attention_bias:
                bias = w.cat([p + f"self_attn.{n}_proj.bias" for n in "qkv"])
            self.layers.append(
                _Layer(
                    input_norm=w.get(p + "input_layernorm.weight"),
                    qkv=w.linear([p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
                    qkv_bias=bias,
                    q_norm=w.maybe(p + "self_attn.q_norm.weight") if arch.qk_norm else None,
                    k_norm=w.maybe(p + "self_attn.k_norm.weight") if arch.qk_norm else None,
                    o=w.linear([p + "self_attn.o_proj.weight"]),
                    post_norm=w.get(p + "post_attention_layernorm.weight"),
                    # A MoE model's sparse layers have no dense MLP (gpu/models/llama_moe.py).
                    gate_up=_NO_MLP if i in arch.sparse_layers else w.linear(
                        [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                    down=_NO_MLP if i in arch.sparse_layers else w.linear([p + "mlp.down_proj.weight"]),
                    o_bias=w.maybe(p + "self_attn.o_proj.bias"),
                    gate_up_bias=w.cat([p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"])
                    if p + "mlp.gate_proj.bias" in w else None,
                    down_bias=w.maybe(p + "mlp.down_proj.bias"),
                )
            )
        # cos | sin of every position, cast to the compute dtype once here (the reference casts
        # after the gather: the same values), so a step gathers its rows in one op.
        self.rope_table = torch.cat(_rope_table(arch, device), dim=-1).to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states for all tokens; float32 logits only for `logits_indices` rows."""
        return self.logits(self.hidden(input_ids, positions, attn).index_select(0, logits_indices))

    def hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """The last layer's hidden states of every token (before the final norm)."""
        # In the compute dtype, as the reference does: q, k stay bf16 in bf16.
        rope = self.rope_table[positions]
        cos, sin = rope[:, : self.arch.head_dim // 2], rope[:, self.arch.head_dim // 2 :]
        h = self.embed[input_ids] if self.tp is None else self.tp.embed(self.embed, input_ids)
        if self.fused:
            return self._fused_layers(h, cos, sin, attn)
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer.input_norm)
            h = h + self._attention(i, layer, x, cos, sin, attn)
            x = self._rms_norm(h, layer.post_norm)
            h = h + self._mlp(i, layer, x)
        return h

    def _fused_layers(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """The layers with the C++ glue: each residual add fused with the norm after it,
        across layer boundaries too (the last layer's add is a plain one: `hidden` returns
        the states before the final norm)."""
        eps = self.arch.rms_norm_eps
        x = glue.rms_norm(h, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            h, x = glue.add_rms_norm(h, self._attention(i, layer, x, cos, sin, attn), layer.post_norm, eps)
            mlp = self._mlp(i, layer, x)
            if i + 1 == len(self.layers):
                return h + mlp
            h, x = glue.add_rms_norm(h, mlp, self.layers[i + 1].input_norm, eps)
        return h

    def _mlp(self, i: int, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """Layer i's MLP on its normed input x (SwiGLU; a MoE model's sparse layers override)."""
        if layer.gate_up_bias is not None:
            gate, up = self.linear(x, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            return self._reduce(self.linear(pointwise(F.silu, gate) * up, layer.down), layer.down_bias)
        if self.fused:
            return self._reduce(self.linear(glue.silu_mul(self.linear(x, layer.gate_up)), layer.down), layer.down_bias)
        return self._reduce(swiglu(self.linear, x, layer.gate_up, layer.down), layer.down_bias)

    def _reduce(self, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A row-parallel linear's output on every rank (gpu/parallel/group.py)."""
        return reduce_then_bias(self.tp, partial, bias)

    def _attention(
        self,
        i: int,
        layer: _Layer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """Layer i's attention block on its normed input x: o_proj(attention(RoPE(qkv)))."""
        arch = self.arch
        qkv = self.linear(x, layer.qkv, layer.qkv_bias)
        if self.fused and layer.q_norm is None:
            q, k, v = glue.rope(qkv, cos, sin, arch.num_heads, arch.num_kv_heads)
        else:
            q, k, v = self._split_rope(layer, qkv, cos, sin)
        o = attn.forward(i, q, k, v)
        return self._reduce(self.linear(o.reshape(-1, arch.num_heads * arch.head_dim), layer.o), layer.o_bias)

    def _split_rope(
        self, layer: _Layer, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (QK-normed where the model has it, then rotated) and v, in torch ops."""
        arch = self.arch
        n_q = arch.num_heads * arch.head_dim
        n_kv = arch.num_kv_heads * arch.head_dim
        q = qkv[:, :n_q].view(-1, arch.num_heads, arch.head_dim)
        k = qkv[:, n_q : n_q + n_kv].view(-1, arch.num_kv_heads, arch.head_dim)
        v = qkv[:, n_q + n_kv :].view(-1, arch.num_kv_heads, arch.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = self._rms_norm(q, layer.q_norm)
            k = self._rms_norm(k, layer.k_norm)
        return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v.contiguous()

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 logits of some rows of `hidden`: the final norm, then the lm_head (both
        row-wise, so a row's logits do not depend on which other rows are with it)."""
        if self.fused:
            logits = self.linear(glue.rms_norm(rows, self.norm, self.arch.rms_norm_eps), self.lm_head).float()
        else:
            logits = self.linear(self._rms_norm(rows, self.norm), self.lm_head).float()
        return logits if self.tp is None else self.tp.gather_vocab(logits)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(mean_of_squares(xf) + self.arch.rms_norm_eps)
        return weight * xf.to(x.dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face layout): x [T, heads, D], cos/sin [T, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _rope_table(arch: ModelArchConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    inv_freq = _scale_inv_freq(inv_freq, arch.rope_scaling)
    pos = torch.arange(arch.max_position_embeddings, dtype=torch.float64)
    freqs = torch.outer(pos, inv_freq).float()
    return freqs.cos().to(device), freqs.sin().to(device)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default" or scaling is None:
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise NotImplementedError(f"rope scaling {kind!r} is not supported (supported: linear, llama3)")
