"""The device contract: what crosses from the event loop to the device thread and back.

Everything here is built from plain values (ints, floats, tuples) that the loop copies
when it builds a step, so the device thread never reads a list the loop may change
while the step runs: planning step N+1 while step N is in flight is safe by
construction. Only `SampledToken`s come back.

NOTE: invariant 6. Warm-up, capture and live batches are all made by
`ForwardBatch.build` (capture batches of `PrefillChunk.padding` requests); the device
side never fills in a missing field with zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from gpu.grammar_mask import TokenMasker
from gpu.prompt_logprobs import PromptLogprobSpan


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """How one row samples its next token: settings copied from the request's parameters,
    the draw's (seed, step), and — only when a penalty needs it — a snapshot of the
    tokens so far."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    top_logprobs_num: int
    seed: int
    step: int  # index of the token being sampled (tokens generated so far)
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, added to the logits
    # Structured outputs: the request's grammar matcher, read (never advanced) by the
    # device thread to fill the row's allowed-token mask. NOTE: not a snapshot; safe
    # because the loop advances it only after this step's tokens come back.
    grammar: TokenMasker | None = None
    # Whether the sampled token's logprob is reported (top logprobs imply it); when no row
    # of a step asks, sampling skips the log_softmax and the logprob comes back NaN.
    logprobs: bool = True
    # Speculative acceptance by rejection sampling (gpu/rejection.py): the drafted token this
    # row's draw tests (-1: none), and the distribution [V] the drafter drew it from (None: a
    # guess, a point mass). NOTE: not a plain value, but the draft job made it on the device
    # thread and nothing writes it after.
    draft_token: int = -1
    draft_q: torch.Tensor | None = None

    @property
    def needs_history(self) -> bool:
        """Whether the penalties read prompt/output tokens."""
        return self.repetition_penalty != 1.0 or bool(self.frequency_penalty or self.presence_penalty)


def placeholder(table_row: int) -> int:
    """The input id that stands for "the token the previous step samples for this
    request-table row" (overlap scheduling): the device reads it from its per-row tensor
    (gpu/step_inputs.py) when the step runs, so the host never waits for it."""
    return -1 - table_row


class SampledToken(NamedTuple):
    """What the device thread returns per sampling row."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


class PrefillChunk(NamedTuple):
    """One request's tokens in a step: `token_ids` go at positions prefix_len.. of its
    request-table row. Hybrid models also read the recurrent state from `state_src`
    (ignored when prefix_len is 0: a fresh zero state) and write the state after the
    chunk's last token to `state_dst`; dense models leave both 0. `state_track`:
    (end_len, slot) pairs, end_len an absolute token count strictly inside the chunk
    (prefix_len < end_len < prefix_len + len(token_ids)), increasing: the state after
    end_len tokens is written to slot too (checkpoints inside a prefill chunk)."""

    token_ids: tuple[int, ...]
    table_row: int
    prefix_len: int
    state_src: int = 0
    state_dst: int = 0
    state_track: tuple[tuple[int, int], ...] = ()

    @classmethod
    def padding(cls, num_tokens: int) -> PrefillChunk:
        """The padding request of static-shape execution (graph capture and warm-up):
        token 0 at positions 0.., request-table row 0 and state slot 0, all reserved, so
        it reads and writes only the reserved page 0 and state slot 0."""
        return cls((0,) * num_tokens, 0, 0)

    @property
    def is_padding(self) -> bool:
        return self.table_row == 0 and self.prefix_len == 0 and not (self.state_src or self.state_dst)


def _placeholders(chunk: PrefillChunk) -> int:
    """NOTE: a negative input id is only ever the chunk's own row's placeholder."""
    own = placeholder(chunk.table_row)
    bad = [t for t in chunk.token_ids if t < 0 and t != own]
    if bad:
        raise ValueError(f"input id {bad[0]} in row {chunk.table_row}: not its own placeholder")
    return chunk.token_ids.count(own)


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: tuple[int, ...]  # all chunks' tokens, flattened in request order
    rows: tuple[int, ...]  # request-table row of each request
    prefix_lens: tuple[int, ...]  # tokens already in the KV cache per request
    extend_lens: tuple[int, ...]  # tokens this step computes per request
    sample_rows: tuple[int, ...]  # indices (into rows) of the requests that sample
    sampling: tuple[SamplingRow, ...]  # one per sampling request, same order
    state_src: tuple[int, ...] = ()  # hybrid models: per request, see PrefillChunk
    state_dst: tuple[int, ...] = ()
    state_track: tuple[tuple[tuple[int, int], ...], ...] = ()  # per request, see PrefillChunk
    # (src, dst) state-slot copies to make before the forward, in order (a cached state
    # taken from a live one; the copy runs on the device thread, so ordered with steps).
    state_copies: tuple[tuple[int, int], ...] = ()
    # Prompt positions whose logprobs are asked for (gpu/prompt_logprobs.py); a batch
    # with any runs eagerly.
    prompt_logprobs: tuple[PromptLogprobSpan, ...] = ()
    placeholders: int = 0  # input ids that are `placeholder(row)`s, resolved on the device
    # Per sampling row, how many tokens before its chunk's last one it samples after (a
    # hybrid model's verify step samples every position of one chunk); () : all 0. A
    # batch with any runs eagerly.
    sample_back: tuple[int, ...] = ()
    # A decode run (scheduler.decode_steps): this many greedy decode steps back to back,
    # each row's token the input of its next; every row samples, and `steps` tokens a row
    # come back (kernel/scheduling/decode_runs.py). 1: a plain step.
    steps: int = 1
    # A run's rows' stop tokens (per row: the ids that end its request); the run ends after
    # a step where a row picks one, so the request's end is reported without delay.
    run_stops: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def build(
        cls, chunks: list[PrefillChunk], sampling: list[tuple[int, SamplingRow]],
        state_copies: tuple[tuple[int, int], ...] = (),
        prompt_logprobs: tuple[PromptLogprobSpan, ...] = (),
        sample_back: tuple[int, ...] = (),
        steps: int = 1,
        run_stops: tuple[tuple[int, ...], ...] = (),
    ) -> ForwardBatch:
        """chunks in batch order; sampling: (chunk index, how that chunk's request samples);
        sample_back: per sampling row, tokens before its chunk's last one (or ())."""
        for chunk in chunks:
            if chunk.table_row == 0 and chunk.is_padding and not chunk.state_track and chunk.token_ids:
                continue  # a padding request (capture / warm-up batches)
            if chunk.table_row <= 0 or not chunk.token_ids or chunk.prefix_len < 0:
                raise ValueError(
                    f"malformed chunk: row {chunk.table_row}, {len(chunk.token_ids)} ids, "
                    f"prefix {chunk.prefix_len}"
                )
        placeholders = sum(_placeholders(c) for c in chunks if c.token_ids and min(c.token_ids) < 0)
        for index, _ in sampling:
            if not 0 <= index < len(chunks):
                raise ValueError(f"sampling row for chunk {index} of {len(chunks)}")
        if sample_back and (len(sample_back) != len(sampling) or any(
                not 0 <= back < len(chunks[i].token_ids) for (i, _), back in zip(sampling, sample_back))):
            raise ValueError("sample_back: one offset per sampling row, inside its chunk")
        if steps < 1 or steps > 1 and (
                prompt_logprobs or any(sample_back) or placeholders or any(len(c.token_ids) != 1 for c in chunks)
                or [i for i, _ in sampling] != list(range(len(chunks)))):
            raise ValueError(f"a decode run of {steps} steps: one token a chunk, every chunk sampled, nothing else")
        if run_stops and (steps == 1 or len(run_stops) != len(chunks)):
            raise ValueError("run_stops: a decode run's, one tuple of stop ids per chunk")
        for span in prompt_logprobs:
            if not 0 <= span.chunk < len(chunks):
                raise ValueError(f"prompt logprobs for chunk {span.chunk} of {len(chunks)}")
        return cls(
            input_ids=tuple(t for c in chunks for t in c.token_ids),
            rows=tuple(c.table_row for c in chunks),
            prefix_lens=tuple(c.prefix_len for c in chunks),
            extend_lens=tuple(len(c.token_ids) for c in chunks),
            sample_rows=tuple(i for i, _ in sampling),
            sampling=tuple(s for _, s in sampling),
            state_src=tuple(c.state_src for c in chunks),
            state_dst=tuple(c.state_dst for c in chunks),
            state_track=tuple(tuple((int(e), int(s)) for e, s in c.state_track) for c in chunks),
            state_copies=state_copies,
            prompt_logprobs=tuple(prompt_logprobs),
            placeholders=placeholders,
            sample_back=tuple(sample_back) if any(sample_back) else (),
            steps=steps,
            run_stops=run_stops,
        )
