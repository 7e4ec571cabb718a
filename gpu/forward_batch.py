"""What crosses from the event loop to the device thread: plain lists, no tensors.

NOTE: invariant 6. Warm-up and live batches are both made by `ForwardBatch.build`;
the device side never fills in a missing field with zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernel.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    seed: int
    step: int  # index of the token being sampled (tokens generated so far)
    prompt_ids: list[int]
    output_ids: list[int]


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: list[int]  # all chunks' tokens, flattened in request order
    rows: list[int]  # request-table row of each request
    prefix_lens: list[int]  # tokens already in the KV cache per request
    extend_lens: list[int]  # tokens this step computes per request
    sample_rows: list[int]  # indices (into rows) of the requests that sample
    sampling: list[SamplingRow]  # one per sampling request, same order

    @classmethod
    def build(
        cls,
        chunks: list[tuple[list[int], int, int, int]],
        sampling: list[tuple[int, SamplingRow]],
    ) -> ForwardBatch:
        """chunks: (token ids, row, prefix_len, extend_len); sampling: (chunk index, row)."""
        for ids, row, _, extend in chunks:
            if len(ids) != extend or row <= 0 or extend <= 0:
                raise ValueError(f"malformed chunk: row {row}, {len(ids)} ids, extend {extend}")
        return cls(
            input_ids=[t for ids, _, _, _ in chunks for t in ids],
            rows=[c[1] for c in chunks],
            prefix_lens=[c[2] for c in chunks],
            extend_lens=[c[3] for c in chunks],
            sample_rows=[i for i, _ in sampling],
            sampling=[s for _, s in sampling],
        )

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)
