"""A Llama model's decode step as one native call (gpu/kernels/cpu/decode_step.cpp).

`build` hands the C++ decoder the very tensors the torch path reads — embedding, RoPE
table, norms, each linear's quantized weight in its kernel format, the KV pool's layers —
and says why not where it cannot run the model; `CpuDecoder.step` runs one decode step
from the attention backend's own metadata (the KV slots and page table it prepared).

It runs what the torch path with the C++ kernels runs for a decode batch of at most
`max_rows` rows (every linear on its quantized kernel: gpu/quant/dispatch.py's rule), so
its logits are bit-identical to that path's (the NOTE in decode_step.cpp); in deterministic
mode its attention is that backend's chained form (`chained`). Not covered (the torch path
runs them): dense (unquantized) linears, QK-norm (Qwen3).
QKV bias (Qwen2) is added in the qkv matmul's epilogue, rounded as the torch path's add.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from cache.kv_pool import KVPool
from gpu.kernels import cpu
from gpu.quant.dispatch import LinearWeight, QuantizedWeight
from gpu.quant.linears import Int4Linear, Int8Linear

if TYPE_CHECKING:
    from gpu.models.llama import LlamaModel

KERNELS = "decode_step"
INT8, Q4 = 1, 2  # decode_step.cpp's weight kinds
_EMPTY = torch.empty(0)  # also a run's temperature and noise where every row is greedy


class _KernelWeight(NamedTuple):
    kind: int
    weight: torch.Tensor
    scales: torch.Tensor
    max_rows: int


class CpuDecoder:
    """One model's decode step over one KV pool; called from the device thread only."""

    def __init__(self, native: Any, max_rows: int) -> None:
        self.native = native
        self.max_rows = max_rows  # decode batches up to this many rows (the quantized kernels' limit)

    def step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_loc: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """float32 logits of the `logits_indices` rows; writes every row's K/V at `out_loc`."""
        return self.native.step(*_contiguous(input_ids, positions, out_loc, page_table, seq_lens, logits_indices))  # type: ignore[no-any-return]

    def step_argmax(self, *inputs: torch.Tensor) -> torch.Tensor:
        """`step` (the same six inputs), but only the argmax of each row's logits (int64 [R],
        as `argmax(dim=-1)` gives it: the first of ties, the first NaN), taken inside the step."""
        _, picks = self.native.step_argmax(*_contiguous(*inputs))
        return picks  # type: ignore[no-any-return]

    def steps_argmax(self, input_ids: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor,
                     steps: int, interrupts: torch.Tensor, stops: torch.Tensor,
                     temperature: torch.Tensor = _EMPTY, noise: torch.Tensor = _EMPTY) -> torch.Tensor:
        """`steps` decode steps back to back (a decode run), each row's pick the input of its
        next step -> the picks, int64 [B, done]. page_table reaches the last step's key; each
        step writes its K/V where that table places its position. Once `interrupts` (int64
        [2]: a counter, its value when the run was planned) moves, or a row picks one of its
        `stops` (int64 [B, S], -1 padded), the run ends after that step (done <= steps). A
        row's pick is its logits' argmax, or where its `temperature` (float32 [B]) is > 0 a
        Gumbel-max draw with `noise[s, b]` (float32 [steps, B, vocab]) at step s."""
        return self.native.steps_argmax(*_contiguous(input_ids, positions, page_table), steps,  # type: ignore[no-any-return]
                                        interrupts, stops.contiguous(), temperature.contiguous(), noise.contiguous())


def _contiguous(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.contiguous() for t in tensors)


def unsupported(model: LlamaModel, pool: KVPool) -> str | None:
    """Why this model and pool cannot take the native step (None: they can)."""
    arch = model.arch
    if model.device.type != "cpu" or not model.fused:
        return "needs the C++ CPU kernels on a CPU model (model.cpu_kernels)"
    pool_dtype = pool.k[0].dtype if pool.k else None
    same = model.dtype in (torch.float32, torch.bfloat16) and pool_dtype == model.dtype
    if not same and (model.dtype, pool_dtype) != (torch.float32, torch.float16):
        return f"computes float32 or bfloat16 over a pool of the same dtype (or float16 under float32), not {model.dtype}"
    if arch.qk_norm:
        return "QK-norm is not in the native step"
    if model.tp is not None:
        return "tensor parallelism is not in the native step (its all-reduces run between torch ops)"
    if any(lay.o_bias is not None or lay.gate_up_bias is not None or lay.down_bias is not None for lay in model.layers):
        return "o_proj and MLP biases are not in the native step"
    if arch.intermediate_size % 16 or arch.head_dim % 16 or arch.hidden_size % 32 or (arch.num_heads * arch.head_dim) % 32:
        return "needs hidden and heads * head_dim a multiple of 32, intermediate and head_dim of 16"
    linears = [model.lm_head] + [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    if any(_kernel_weight(w) is None for w in linears):
        return "needs every linear quantized in a C++ kernel format (model.quantization int4 / int8)"
    if not cpu.load(KERNELS):
        return "the decode_step kernel did not build"
    return None


def build(model: LlamaModel, pool: KVPool, chained: bool = False) -> CpuDecoder:
    """The native decoder of `model` over `pool` (check `unsupported` first); chained: its
    attention in deterministic mode's arithmetic (gpu/attention/deterministic_paged.py)."""
    arch = model.arch
    dims = [
        arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
        arch.intermediate_size, arch.vocab_size, pool.page_size,
    ]
    scale = arch.head_dim**-0.5  # the torch path's (gpu/attention/paged_decode.py), computed alike
    native = torch.classes.tierserve_cpu.LlamaDecoder(
        dims, float(arch.rms_norm_eps), scale, model.embed, model.rope_table, model.norm
    )
    rows = []
    for i, layer in enumerate(model.layers):
        ws = [_required(w) for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        rows += [w.max_rows for w in ws]
        bias = layer.qkv_bias if layer.qkv_bias is not None else _EMPTY
        native.add_layer(
            layer.input_norm, layer.post_norm, [w.kind for w in ws], [w.weight for w in ws],
            [w.scales for w in ws], bias, pool.k[i], pool.v[i],
        )
    head = _required(model.lm_head)
    native.set_head(head.kind, head.weight, head.scales)
    native.set_chained(chained)
    return CpuDecoder(native, min(rows + [head.max_rows]))


def _kernel_weight(weight: LinearWeight) -> _KernelWeight | None:
    if not isinstance(weight, QuantizedWeight):
        return None
    quant = weight.quant
    if isinstance(quant, Int4Linear) and quant.kernel:
        return _KernelWeight(Q4, quant.packed, _EMPTY, quant.max_rows)
    if isinstance(quant, Int8Linear) and quant.kernel_scales is not None:
        return _KernelWeight(INT8, quant.packed, quant.kernel_scales, quant.max_rows)
    return None


def _required(weight: LinearWeight) -> _KernelWeight:
    found = _kernel_weight(weight)
    if found is None:
        raise ValueError("a linear is not in a C++ kernel format (see unsupported())")
    return found
