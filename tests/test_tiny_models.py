"""Llama, Qwen2 (QKV bias) and Qwen3 (QK-norm, head_dim != hidden/heads) from Hugging Face
folders match transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernel import Engine
from tests.conftest import FLOAT32
from tests.tiny_models import VOCAB, build_tiny


def reference_greedy(folder: Path, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    seq = list(ids)
    logprobs = []
    with torch.inference_mode():
        for _ in range(n):
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1].float(), -1)
            tok = int(torch.argmax(logp))
            seq.append(tok)
            logprobs.append(logp[tok].item())
    return seq[len(ids) :], logprobs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_checkpoint_matches_transformers(arch: str, tmp_path: Path) -> None:
    folder = build_tiny(arch, tmp_path / arch)
    if arch == "qwen3":  # the checkpoint exercises an explicit head_dim
        config = json.loads((folder / "config.json").read_text())
        assert config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]
    prompts = [[(i * 37 + j) % VOCAB for j in range(n)] for i, n in enumerate((3, 17, 40))]
    engine = Engine(
        None,
        {
            **FLOAT32,
            "model.path": str(folder),
            "cache.num_pages": 64,
            "cache.page_size": 4,
            "scheduler.chunked_prefill_size": 16,  # 17- and 40-token prompts are chunked
            "scheduler.max_num_batched_tokens": 32,
            "debug.check_invariants": True,
        },
    )
    try:
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "return_logprob": True}
        outs = engine.generate(prompts, params)
    finally:
        engine.shutdown()
    for ids, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = reference_greedy(folder, ids, 8)
        assert out["output_ids"] == ref_tokens
        ours = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < 1e-4
