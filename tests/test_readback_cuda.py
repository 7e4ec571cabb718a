"""On CUDA (skipped without it): a step's launch never synchronizes with the device, and
the device thread launches job N+1 while the GPU still runs job N, whose future resolves
only once that work completed (gpu/readback.py). Part of benchmarks/gpu_check.py.

`torch.cuda.set_sync_debug_mode("error")` makes every synchronizing call raise (a
blocking copy, `.item()`, `.tolist()` of a CUDA tensor, `nonzero`, a stream wait);
`torch.cuda._sleep(cycles)` keeps the GPU busy so that "before it completed" is visible.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gpu.device_thread import DeviceThread
from gpu.model_runner import StepOutput
from gpu.upload import to_device
from kernel import Engine
from kernel.components import Components, build_components
from kernel.config import load_config
from tests.conftest import TINY_OVERRIDES
from tests.test_launch_no_readback import launch, prime

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SPIN = 400_000_000  # GPU cycles: ~0.2 s on current GPUs
WAIT = 30.0


@contextlib.contextmanager
def syncs_raise() -> Iterator[None]:
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


BACKENDS = {"torch": {"model.attention": "torch"}, "deterministic": {"deterministic": True},
            "triton": {"model.attention": "triton"}}


@pytest.fixture(scope="module", params=["torch", "deterministic", "triton"])
def parts(request: pytest.FixtureRequest, tiny_chat_folder: str) -> Components:
    attention = BACKENDS[request.param]
    overrides = {**TINY_OVERRIDES, "model.path": tiny_chat_folder, "model.device": "cuda",
                 "scheduler.overlap": "on", "graphs.mode": "off", **attention}
    built = build_components(load_config(None, overrides), torch.device("cuda"))
    table = built.runner.attention.req_to_token
    for r in range(1, 6):
        table[r, :32] = torch.arange(32, device=table.device) + 32 * r
    torch.cuda.synchronize()
    return built


def test_a_decode_steps_launch_never_synchronizes(parts: Components) -> None:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        expected = launch(parts).finish()  # also the warm-up: first-call set-up may sync
        prime(parts)
        torch.cuda._sleep(SPIN)  # the launch below queues behind a busy GPU
        with syncs_raise():
            pending = launch(parts, primed=True)
    got = pending.finish()
    assert isinstance(got, StepOutput)
    assert [t.token_id for t in got.tokens] == [t.token_id for t in expected.tokens]
    logprobs = [[t.logprob for t in out.tokens] for out in (got, expected)]
    torch.testing.assert_close(torch.tensor(logprobs[0]), torch.tensor(logprobs[1]), equal_nan=True)


def test_uploads_never_synchronize_and_reused_pinned_blocks_stay_intact() -> None:
    """Many small uploads queued behind a spin: each copy keeps its own pinned block
    until the copy ran, so every tensor holds its own values."""
    stream, device = torch.cuda.Stream(), torch.device("cuda")
    with torch.cuda.stream(stream):
        to_device([0], torch.int64, device)  # the host allocator's first block outside the check
        torch.cuda._sleep(SPIN)
        with syncs_raise():
            outs = [to_device([i] * 257, torch.int64, device) for i in range(64)]
    stream.synchronize()
    assert all(out.eq(i).all().item() for i, out in enumerate(outs))


def test_request_table_writes_never_synchronize() -> None:
    """The loop thread writes a request's pages into the table (on the default stream)
    behind a spin without waiting for it, and the rows hold the slots afterwards."""
    from cache.req_table import ReqToTokenTable

    table = ReqToTokenTable(4, 64, torch.device("cuda"))
    table.write_pages(1, 0, [9], 4)  # the host allocator's first block outside the check
    torch.cuda._sleep(SPIN)
    with syncs_raise():
        for page in range(8):
            table.write_pages(2, page, [10 + page], 4)
    torch.cuda.synchronize()
    assert table.table[2, :32].tolist() == [(10 + i // 4) * 4 + i % 4 for i in range(32)]


async def test_the_device_thread_launches_the_next_job_while_the_gpu_runs() -> None:
    thread = DeviceThread(stream_factory=torch.cuda.Stream)
    try:
        flag = await thread.submit(lambda: torch.zeros(1, device="cuda"))

        def spin_then_flag() -> torch.Tensor:
            torch.cuda._sleep(SPIN)
            flag.fill_(1.0)
            host = torch.empty(1, pin_memory=True)
            host.copy_(flag, non_blocking=True)  # no event of its own: the future's guarantee
            return host

        second_ran = threading.Event()
        first = thread.submit(spin_then_flag)
        second = thread.submit(second_ran.set)
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, second_ran.wait, WAIT)
        assert not first.done(), "job 1 resolved before job 2 launched: the device thread waited"
        host: Any = await asyncio.wait_for(first, WAIT)
        assert host.item() == 1.0  # resolved after its device work completed
        await asyncio.wait_for(second, WAIT)
    finally:
        thread.shutdown()


def test_overlap_on_the_gpu_changes_no_output(tiny_chat_folder: str) -> None:
    """End to end through the readback thread: the tiny engine on CUDA, overlap on and
    off, deterministic, the same tokens and logprobs."""
    prompts = [[500 + 7 * i + j for j in range(5 + i)] for i in range(6)]
    params = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True, "return_logprob": True}
    outs = {}
    for overlap in ("off", "on"):
        engine = Engine(None, {**TINY_OVERRIDES, "model.path": tiny_chat_folder, "model.device": "cuda",
                               "deterministic": True, "scheduler.overlap": overlap, "graphs.mode": "off"})
        try:
            got = engine.generate(prompts, params)
            assert isinstance(got, list)
            outs[overlap] = [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in got]
        finally:
            engine.shutdown()
    assert outs["on"] == outs["off"]
