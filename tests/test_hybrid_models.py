"""Qwen3.5 (Gated DeltaNet) and LFM2 (short conv) tiny checkpoints against transformers, driven
engine-less (KV pool, request rows, torch attention, StatePool): chunked prefill on and off
the 64-token and page grids, batched with decodes, teacher-forced on transformers' tokens
(measured max |Δ logprob| 1.5e-5 LFM2, 5.5e-5 Qwen3.5 on an AMD EPYC AVX2, 2.0e-5 and 4.9e-5 on
an Intel Xeon AVX-512/BF16/AMX; bound 1e-3); slot
copies and resumes; deterministic mode's prefill == decode bit for bit."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cache.state_pool import StatePool
from gpu.batch_invariant import linear_tiled
from gpu.loader.hf import build_arch_config, load_hf_folder
from gpu.models.qwen3_5 import Qwen3_5Model
from kernel.registry import lookup
from tests.hybrid_driver import (
    Driver,
    HybridModel,
    Req,
    load_model,
    reference_generate,
    run_schedule,
    teacher_forced_error,
)
from tests.tiny_hybrid import VOCAB, build_tiny_lfm2, build_tiny_qwen3_5

FAMILIES = {"qwen3_5_text": build_tiny_qwen3_5, "lfm2": build_tiny_lfm2}
NUM_DECODE = 32
PROMPTS = [[(7 * j + 3 * i + 1) % VOCAB for j in range(n)] for i, n in enumerate((150, 37, 70))]
# Chunk boundaries at 40 (off the page and 64 grids), 64 (on both), 114, 16 (page only).
SCHEDULES = {"split": [[40, 24, 50, 36], [37], [16, 54]], "whole": [[150], [37], [70]]}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    name = request.param
    folder = FAMILIES[name](tmp_path_factory.mktemp(name))
    return name, str(folder)


@pytest.fixture(scope="module")
def reference(family: tuple[str, str]) -> list[tuple[list[int], torch.Tensor]]:
    return reference_generate(family[1], PROMPTS, NUM_DECODE)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_teacher_forced_matches_transformers(
    family: tuple[str, str], reference: list[tuple[list[int], torch.Tensor]], schedule: str
) -> None:
    """transformers' greedy tokens fed back (teacher-forced), so every position is compared
    in the same context: every logprob of the vocabulary within 1e-3 (float32 on both
    sides; measured ~1e-6 on an AMD EPYC AVX2), and the same top-1 wherever transformers'
    top-2 margin exceeds 1e-2. Free-running agreement is printed, not asserted."""
    model = load_model(family[1])
    worst, flips, _ = teacher_forced_error(model, PROMPTS, SCHEDULES[schedule], NUM_DECODE, reference)
    free = run_schedule(Driver(model, page_size=16), PROMPTS, SCHEDULES[schedule], NUM_DECODE)[0]
    agree = sum(a == b for ours, (ref, _) in zip(free, reference) for a, b in zip(ours, ref))
    print(f"{family[0]} {schedule}: teacher-forced max |dlogprob| vs transformers over {NUM_DECODE} steps "
          f"= {worst:.2e}; free-running: {agree} of {NUM_DECODE * len(PROMPTS)} tokens alike")
    assert worst < 1e-3 and flips == 0, (worst, flips)


def test_arch_config_and_state_shapes(family: tuple[str, str]) -> None:
    name, folder = family
    arch = load_hf_folder(folder, torch.float32).arch
    assert arch.architecture == name and lookup("model", name) is type(load_model(folder))
    model = load_model(folder)
    assert model.num_kv_layers == 1 and arch.num_attention_layers == 1
    shapes = model.state_shapes()
    if isinstance(model, Qwen3_5Model):
        assert arch.layer_types == (
            "linear_attention",
            "full_attention",
            "linear_attention",
            "linear_attention",
        )
        assert arch.partial_rotary_factor == 0.5 and model.rotary_dim == 8
        assert [tuple(s) for s in shapes] == [(2 * 2 * 16 + 4 * 8, 3, (4, 16, 8))] * 3
    else:
        assert arch.layer_types == ("conv", "conv", "full_attention", "conv")
        assert arch.intermediate_size == 128  # int(2 * 160 / 3) = 106, rounded up to a multiple of 32
        assert (arch.conv_kernel, arch.conv_bias, arch.rms_norm_eps) == (3, True, 1e-5)
        assert [tuple(s) for s in shapes] == [(64, 2, None)] * 3


def test_lfm2_legacy_config_keys() -> None:
    config = {
        "architectures": ["Lfm2ForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 3,
        "intermediate_size": 1,
        "block_ff_dim": 12288,  # wins over intermediate_size, as in transformers
        "tie_embedding": True,
        "full_attn_idxs": [1],
    }
    arch = build_arch_config(config)
    assert arch.layer_types == ("conv", "full_attention", "conv")
    assert arch.intermediate_size == 8192 and arch.tie_word_embeddings  # 2/3 * 12288, a multiple of 256


def _prefill(driver: Driver, prompt: list[int]) -> tuple[Req, torch.Tensor]:
    req = driver.new_request()
    return req, driver.step([(req, prompt)])[0]


def _all_state(pool: StatePool, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for t in pool.conv + [r for r in pool.recurrent if r is not None]]


def test_resume_from_copied_slot(family: tuple[str, str]) -> None:
    """A state copied into another slot resumes exactly like the original; resuming into a
    different dst slot leaves the source slot valid for its prefix length."""
    model = load_model(family[1])
    driver = Driver(model, page_size=16)
    prompt, cont, cont2 = PROMPTS[0][:64], PROMPTS[1][:20], PROMPTS[2][:9]
    a, _ = _prefill(driver, prompt)
    b = driver.fork(a)
    src = b.slot
    before = _all_state(driver.states, src)
    dst = driver.states.allocate()
    assert dst is not None
    continued = driver.step([(a, cont)])
    resumed = driver.step([(b, cont)], dst_slots=[dst])
    assert torch.equal(continued, resumed)
    assert all(torch.equal(x, y) for x, y in zip(before, _all_state(driver.states, src)))
    assert all(
        torch.equal(x, y) for x, y in zip(_all_state(driver.states, a.slot), _all_state(driver.states, dst))
    )
    # Resume from the untouched source slot again, with another continuation: a cold run agrees.
    b.length, b.slot = 64, src
    again = driver.step([(b, cont2)])
    _, cold = _prefill(Driver(model, page_size=16), prompt + cont2)
    assert (again[0] - cold).abs().max() < 1e-4


def test_fresh_start_ignores_src_slot(family: tuple[str, str]) -> None:
    model = load_model(family[1])
    _, clean = _prefill(Driver(model), PROMPTS[1])
    driver = Driver(model)
    req = driver.new_request()
    for t in driver.states.conv + [r for r in driver.states.recurrent if r is not None]:
        t[req.slot].normal_()  # a stale state from an earlier request
    assert torch.equal(driver.step([(req, PROMPTS[1])])[0], clean)


def _prefill_then_decode(
    model: HybridModel, prompt: list[int], chunks: list[int], as_decode: int, steps: int
) -> list[torch.Tensor]:
    """Prompt in prefill `chunks`, then its last `as_decode` tokens one per step, then `steps`
    greedy decodes, each step batched with an unrelated request. -> logprobs after the
    prompt and after each decode."""
    driver = Driver(model, page_size=16)
    req, other = driver.new_request(), driver.new_request()
    other_toks = itertools.cycle(PROMPTS[2])
    feeds = [prompt[sum(chunks[:i]) : sum(chunks[: i + 1])] for i in range(len(chunks))]
    feeds += [[t] for t in prompt[len(prompt) - as_decode :]]
    out: list[torch.Tensor] = []
    for i, feed in enumerate(feeds + [[]] * steps):
        if not feed:
            feed = [int(torch.argmax(out[-1]))]
        side = [next(other_toks) for _ in range(1 + 3 * (i % 2))]  # a decode or a short chunk
        lp = driver.step([(other, side), (req, feed)] if i % 2 else [(req, feed), (other, side)])
        row = lp[1] if i % 2 else lp[0]
        if i >= len(feeds) - 1:
            out.append(row)
    return out


def _three_ways(model: HybridModel) -> list[list[torch.Tensor]]:
    """One prompt reached as one prefill, as a chunked prefill ending in 16 decode-fed
    tokens, and as two chunks plus 30 decode-fed tokens."""
    prompt = PROMPTS[0][:100]
    return [
        _prefill_then_decode(model, prompt, [100], 0, 6),
        _prefill_then_decode(model, prompt, [40, 24, 20], 16, 6),
        _prefill_then_decode(model, prompt, [64, 6], 30, 6),
    ]


def assert_bitwise_same(runs: list[list[torch.Tensor]]) -> None:
    assert all(len(r) == 7 for r in runs)
    for k, other in enumerate(runs[1:], 1):
        for step, (x, y) in enumerate(zip(runs[0], other)):
            if not torch.equal(x, y):
                raise AssertionError(f"way {k} differs bit-wise from one prefill at step {step}")


def spy_delta_rule(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The `recurrent` flag of every Gated DeltaNet call (which form of the rule ran)."""
    from gpu.models import qwen3_5

    forms: list[bool] = []
    rule = qwen3_5.gated_delta_varlen

    def spy(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        forms.append(kwargs["recurrent"])
        return rule(*args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(qwen3_5, "gated_delta_varlen", spy)
    return forms


def test_deterministic_state_is_the_same_from_prefill_or_decode(
    family: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE: invariant 7. In deterministic mode a position's logprobs are bit-identical
    whether its prefix was one prefill, a chunked prefill, or partly fed as decode steps,
    in batches of different composition. The default mode runs other kernels (plain
    linears; for Gated DeltaNet the chunked delta rule in prefill), checked by what ran,
    and agrees to rounding."""
    forms = spy_delta_rule(monkeypatch)
    strict_model = load_model(family[1], deterministic=True)
    strict = _three_ways(strict_model)
    strict_forms, forms[:] = set(forms), []
    loose_model = load_model(family[1], deterministic=False)
    loose = _three_ways(loose_model)
    assert_bitwise_same(strict)
    assert strict_model.linear is linear_tiled and loose_model.linear is F.linear
    if family[0] == "qwen3_5_text":
        assert strict_forms == {True} and set(forms) == {False}, (strict_forms, forms)
    assert max(float((x - y).abs().max()) for x, y in zip(strict[0], loose[0])) < 1e-3


def test_deterministic_guard_catches_chunked_delta_rule(
    family: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard above, shown red with the bug planted: deterministic mode (tiled linears,
    deterministic attention) but the chunked delta rule in prefill."""
    if family[0] != "qwen3_5_text":
        pytest.skip("LFM2 has no delta rule")
    from gpu.models import qwen3_5

    chunked = qwen3_5.gated_delta_varlen

    def planted(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return chunked(*args, **{**kwargs, "recurrent": False})

    monkeypatch.setattr(qwen3_5, "gated_delta_varlen", planted)
    with pytest.raises(AssertionError, match="differs bit-wise from one prefill"):
        assert_bitwise_same(_three_ways(load_model(family[1], deterministic=True)))


# States tracked inside a prefill chunk (checkpoints): a request resumed from one behaves
# like one resumed from a run that stopped there.
TRACK_CASES = {
    # name: (prefill chunks of a 150-token prompt, tracked lengths inside its last chunk)
    "grid64": ([150], [64, 128]),
    "grid50": ([30, 120], [50, 100]),  # off the 64 grid, chunk starting off it too
}


def _resumed(driver: Driver, req: Req, cont: list[int], steps: int) -> list[torch.Tensor]:
    """logprobs after `cont` (one prefill chunk), then after `steps` greedy decodes."""
    out = [driver.step([(req, cont)])[0]]
    for _ in range(steps):
        out.append(driver.step([(req, [int(torch.argmax(out[-1]))])])[0])
    return out


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("case", sorted(TRACK_CASES))
def test_tracked_state_resumes_like_a_stopped_run(
    family: tuple[str, str], case: str, deterministic: bool
) -> None:
    """NOTE: invariant 2. Deterministic mode: the tracked slot holds the stopped run's
    state bit for bit (every layer) and the resumed logprobs are identical; default mode
    (chunk lengths change the plain linears' rounding) agrees to rounding."""
    model = load_model(family[1], deterministic=deterministic)
    chunks, ends = TRACK_CASES[case]
    prompt, cont = PROMPTS[0], PROMPTS[1][:20]
    driver = Driver(model, page_size=2, num_pages=256)
    req = driver.new_request()
    slots = [driver.states.allocate() for _ in ends]
    assert all(s is not None for s in slots)
    done = 0
    for i, n in enumerate(chunks):
        last = i == len(chunks) - 1
        track = [[(e, s) for e, s in zip(ends, slots) if last]]
        driver.step([(req, prompt[done : done + n])], track=track)
        done += n
    for end, slot in zip(ends, slots):
        assert slot is not None
        stopped_driver = Driver(model, page_size=2, num_pages=256)
        stopped = stopped_driver.new_request()
        done = 0
        for n in chunks:  # the same chunks, the one holding `end` cut there
            n = min(n, end - done)
            stopped_driver.step([(stopped, prompt[done : done + n])])
            done += n
        tracked_state = _all_state(driver.states, slot)
        stopped_state = _all_state(stopped_driver.states, stopped.slot)
        ours = _resumed(driver, driver.resume(req, end, slot), cont, 2)
        theirs = _resumed(stopped_driver, stopped, cont, 2)
        if deterministic:
            assert all(torch.equal(x, y) for x, y in zip(tracked_state, stopped_state)), end
            assert all(torch.equal(x, y) for x, y in zip(ours, theirs)), end
        else:
            assert max(float((x - y).abs().max()) for x, y in zip(tracked_state, stopped_state)) < 1e-4
            assert max(float((x - y).abs().max()) for x, y in zip(ours, theirs)) < 1e-4
    # The request's own state (dst slot) is the untracked run's.
    plain = Driver(model, page_size=2, num_pages=256)
    other = plain.new_request()
    done = 0
    for n in chunks:
        plain.step([(other, prompt[done : done + n])])
        done += n
    assert all(
        torch.equal(x, y)
        for x, y in zip(_all_state(plain.states, other.slot), _all_state(driver.states, req.slot))
    )
