"""A step's launch (`ModelRunner.run`) reads nothing back from the device: every host read
of a tensor (`tolist`, `item`, `bool`, ..., `nonzero`, boolean-mask indexing, unsized
`repeat_interleave`, uploads from host lists: tests/host_reads.py) is made to raise while
it runs, and the step still launches; only its `finish()` reads the sampled tokens back,
and what it gives is the StepOutput of the step run without the trap.

On CUDA each of those reads would wait for the device (tests/test_readback_cuda.py
checks the real thing under `torch.cuda.set_sync_debug_mode("error")`); here the trap
shows where they are, with the tiny random Llama on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import gpu.sampling as sampling_mod
from gpu.forward_batch import ForwardBatch, PrefillChunk, SamplingRow, placeholder
from gpu.model_runner import PendingStep, StepOutput
from kernel.components import Components, build_components
from kernel.config import load_config
from tests.conftest import TINY_OVERRIDES
from tests.host_reads import HostRead, trap_host_reads

CPU = torch.device("cpu")
ATTENTION = {
    "deterministic": {"deterministic": True},
    "torch": {"model.attention": "torch", "model.cpu_kernels": "off"},
    "torch-kernels": {"model.attention": "torch"},  # the C++ paged decode where it builds
}


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        trap_host_reads(mp, "a step's launch")
        yield


def row(**kw: Any) -> SamplingRow:
    base: dict[str, Any] = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
                            "presence_penalty": 0.0, "repetition_penalty": 1.0, "top_logprobs_num": 0,
                            "seed": 3, "step": 2, "logprobs": False}
    return SamplingRow(**{**base, **kw})


ALLOWED = (5, 7, 11)  # the only tokens the constrained row may sample


class FewTokens:
    """A grammar matcher stand-in (gpu.grammar_mask.TokenMasker) allowing ALLOWED."""

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row, 0] = sum(1 << t for t in ALLOWED)


def decode_step() -> ForwardBatch:
    """Decodes of different lengths (one reading the previous step's token through a
    placeholder), two prefill chunks, and sampling rows that take every sampler branch
    (a grammar mask too)."""
    chunks = [PrefillChunk((11,), 1, 5), PrefillChunk((placeholder(2),), 2, 9), PrefillChunk((13,), 3, 17),
              PrefillChunk(tuple(range(20, 27)), 4, 0), PrefillChunk(tuple(range(30, 36)), 5, 4)]
    rows = [
        row(grammar=FewTokens()),  # greedy, no logprobs, constrained
        row(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, logprobs=True),
        row(temperature=1.1, top_logprobs_num=3, logit_bias=((7, 5.0), (9, -2.0))),
        row(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
            prompt_ids=(20, 21, 22), output_ids=(7, 7, 9), logprobs=True),
        row(temperature=0.7, seed=9, step=0),
    ]
    return ForwardBatch.build(chunks, list(enumerate(rows)))


@pytest.fixture(scope="module", params=list(ATTENTION))
def parts(request: pytest.FixtureRequest, tiny_chat_folder: str) -> Components:
    overrides = {**TINY_OVERRIDES, "model.path": tiny_chat_folder, "scheduler.overlap": "on",
                 **ATTENTION[request.param]}
    built = build_components(load_config(None, overrides), CPU)
    table = built.runner.attention.req_to_token
    for r in range(1, 6):  # each row its own KV slots
        table[r, :32] = torch.arange(32) + 32 * r
    return built


def prime(parts: Components) -> None:
    """Set what "the previous step" sampled for row 2 (the placeholder's token): each
    launch below starts from the same inputs."""
    next_tokens = parts.runner.inputs.next_tokens
    assert next_tokens is not None
    next_tokens.tokens[2] = 42


def launch(parts: Components, primed: bool = False) -> PendingStep:
    if not primed:
        prime(parts)
    pending = parts.runner.run(decode_step())
    assert isinstance(pending, PendingStep)
    return pending


def test_a_decode_steps_launch_reads_nothing_back(parts: Components) -> None:
    expected = launch(parts).finish()
    with no_host_reads():
        pending = launch(parts)
        with pytest.raises(HostRead, match="during a step's launch"):
            pending.finish()  # the reads are all here
    got = pending.finish()
    assert isinstance(got, StepOutput) and len(got.tokens) == 5 and got.tokens[0].token_id in ALLOWED
    assert [t.token_id for t in got.tokens] == [t.token_id for t in expected.tokens]
    assert repr(got) == repr(expected)  # logprobs (NaN where not asked) and top logprobs too


# What a launch may not do, each planted on the sampled tokens: (the construct, HostRead's message).
READS: dict[str, tuple[Any, str]] = {
    "tolist": (lambda t: t.tolist(), "Tensor.tolist"),
    "item": (lambda t: t[0].item(), "Tensor.item"),
    "int": (lambda t: int(t[0]), "Tensor.__int__"),
    "nonzero": (lambda t: t.nonzero(), "Tensor.nonzero"),
    "torch.nonzero": (lambda t: torch.nonzero(t), "torch.nonzero"),
    "argwhere": (lambda t: torch.argwhere(t), "torch.argwhere"),
    "unique": (lambda t: t.unique(), "Tensor.unique"),
    "masked_select": (lambda t: t.masked_select(t > 0), "Tensor.masked_select"),
    "where-one-arg": (lambda t: torch.where(t > 0), "torch.where with one argument"),
    "mask-get": (lambda t: t[t > 0], "boolean-mask indexing"),
    "mask-set": (lambda t: t.clone().__setitem__(t > 0, 0), "boolean-mask indexing"),
    "list-index": (lambda t: t[[0, 1]], "indexing with a host list"),
    "repeat_interleave": (lambda t: torch.ones_like(t).repeat_interleave(torch.ones_like(t)),
                          "Tensor.repeat_interleave by a tensor without output_size"),
    "torch.repeat_interleave": (lambda t: torch.repeat_interleave(torch.ones_like(t)),
                                "torch.repeat_interleave by a tensor without output_size"),
    "tensor-upload": (lambda t: torch.tensor([1, 2], device=t.device), "torch.tensor onto a device"),
    "as_tensor-upload": (lambda t: torch.as_tensor([1, 2], device=t.device), "torch.as_tensor onto a device"),
}


@pytest.mark.parametrize("construct", list(READS))
def test_red_when_the_launch_reads_a_tensor_back(
    parts: Components, monkeypatch: pytest.MonkeyPatch, construct: str
) -> None:
    """The trap above can fail: each host read planted into the sampler's launch trips it."""
    real = sampling_mod.argmax_rows
    plant, message = READS[construct]

    def reads_back(scores: torch.Tensor, native: bool = False) -> torch.Tensor:
        out = real(scores, native)
        plant(out)
        return out

    monkeypatch.setattr(sampling_mod, "argmax_rows", reads_back)
    with no_host_reads(), pytest.raises(HostRead, match=f"^{message}.* during a step's launch$"):
        launch(parts)


def test_the_trap_lets_device_only_ops_through() -> None:
    """What the launch path does on the device passes: the sized and by-int repeats,
    three-argument where, integer-tensor indexing, constructors without a device."""
    t = torch.arange(4)
    with pytest.MonkeyPatch.context() as mp:
        trap_host_reads(mp, "a step's launch")
        assert t.repeat_interleave(t, output_size=6).shape == (6,) and t.repeat_interleave(2).shape == (8,)
        assert torch.repeat_interleave(t, t, output_size=6).shape == (6,)
        assert torch.where(t > 1, t, 0).shape == (4,) and t[t[:2]].shape == (2,) and t[1:, None].shape == (3, 1)
        assert torch.tensor([1, 2]).shape == (2,) and torch.as_tensor(t, device=t.device) is t
