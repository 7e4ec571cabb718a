"""A step's flat index tensors (gpu/step_inputs.py host_inputs) against a plain-Python
reference: positions prefix_len.. of each chunk, and the flat index each sampling row
samples at — for decode-only batches (the one-token fast path) and mixed ones."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from gpu import step_inputs
from gpu.forward_batch import ForwardBatch, PrefillChunk

ROW: Any = None  # host_inputs never reads a sampling row's settings


def reference(batch: ForwardBatch) -> tuple[list[int], list[int], list[int]]:
    positions: list[int] = []
    ends: list[int] = []
    for prefix, extend in zip(batch.prefix_lens, batch.extend_lens):
        positions += range(prefix, prefix + extend)
        ends.append(len(positions) - 1)
    back = batch.sample_back or (0,) * len(batch.sample_rows)
    return list(batch.input_ids), positions, [ends[r] - b for r, b in zip(batch.sample_rows, back)]


def random_batch(rng: random.Random, max_extend: int) -> ForwardBatch:
    n = rng.randint(1, 9)
    chunks = [PrefillChunk(tuple(rng.randrange(1000) for _ in range(rng.randint(1, max_extend))), row + 1,
                           rng.randrange(300)) for row in range(n)]
    sampling = sorted(rng.sample(range(n), rng.randint(0, n)))
    back = tuple(rng.randrange(len(chunks[i].token_ids)) for i in sampling) if max_extend > 1 else ()
    return ForwardBatch.build(chunks, [(i, ROW) for i in sampling], sample_back=back)


@pytest.mark.parametrize("max_extend", [1, 5])
def test_host_inputs_match_the_reference(max_extend: int) -> None:
    rng = random.Random(max_extend)
    for _ in range(200):
        batch = random_batch(rng, max_extend)
        ids, positions, last = step_inputs.host_inputs(batch)
        assert (ids.tolist(), positions.tolist(), last.tolist()) == reference(batch)
        assert ids.dtype == positions.dtype == last.dtype == torch.int64


def test_the_reference_catches_a_wrong_decode_position() -> None:
    """Planted: positions one past the prefix (the KV slot of the next token) differ from
    the reference on every decode batch, so the test above would go red."""
    batch = ForwardBatch.build([PrefillChunk((7,), 1, 12), PrefillChunk((8,), 2, 0)], [(0, ROW), (1, ROW)])
    _, positions, _ = step_inputs.host_inputs(batch)
    assert (positions + 1).tolist() != reference(batch)[1]
    assert positions.tolist() == [12, 0]
