"""Runs one step on the device: tensors from a ForwardBatch, forward, sampling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from cache.kv_pool import KVPool
from cache.state_pool import StatePool
from gpu.attention.base import AttentionBackend
from gpu.forward_batch import ForwardBatch, SampledToken
from gpu.graphs.cpu_step import CpuStepRunner
from gpu.models.hybrid_step import HybridStep
from gpu.prompt_logprobs import PromptLogprobs, prompt_logprobs
from gpu.readback import Pending
from gpu.sampling import (
    DeviceSample,
    SamplingBatch,
    native_argmax_ready,
    picked_sample,
    run_draws,
    sample_on_device,
)
from gpu.step_inputs import StepInputs

if TYPE_CHECKING:
    from gpu.graphs.runner import Graph, GraphRunner


class StepFatal(RuntimeError):
    """A step failure after which no later step can be trusted (a tensor-parallel rank lost
    or out of step): the step loop halts the engine instead of failing only the step's
    requests."""


class StepOutput(NamedTuple):
    """What one step gives back: a token per sampling row, and one result per prompt
    logprob span of the batch (same order)."""

    tokens: list[SampledToken]
    prompt_logprobs: list[PromptLogprobs]


class PendingStep(Pending):
    """A launched step: `finish()` reads its sampled tokens back -> its StepOutput (the
    device thread calls it once the step's device work completed: gpu/readback.py)."""

    def __init__(self, sampled: DeviceSample | None, prompt: list[PromptLogprobs]) -> None:
        self.sampled = sampled  # None: the batch samples nothing
        self.prompt = prompt  # prompt logprobs, already on the host (the eager path)

    def finish(self) -> StepOutput:
        if self.sampled is None:
            return StepOutput([], self.prompt)
        res = self.sampled.finish()
        tokens = [SampledToken(t, lp, top) for t, lp, top in zip(res.token_ids, res.logprobs, res.top_logprobs)]
        return StepOutput(tokens, self.prompt)


class ModelRunner:
    """Owned by the device thread: every call here happens on that thread."""

    def __init__(
        self, model: Any, pool: KVPool, attention: AttentionBackend, states: StatePool | None = None,
        cpu_kernels: bool = False,
    ) -> None:
        self.model = model
        self.pool = pool
        self.attention = attention
        self.states = states  # hybrid models only
        self.device = model.device
        self.vocab_size = model.arch.vocab_size
        self.native_argmax = native_argmax_ready(cpu_kernels, self.device)  # greedy picks in C++
        # Static-shape execution (graphs.mode cuda / emulate) or native CPU decode steps
        # (graphs.mode cpu), attached by the builder.
        self.graphs: GraphRunner | CpuStepRunner | None = None
        # How index tensors reach the device; the builder swaps in one with the per-row
        # next-token tensor (overlap scheduling).
        self.inputs = StepInputs(self.device)

    @torch.inference_mode()
    def close(self) -> None:
        """Release what the runner started beyond this process (tensor-parallel workers)."""

    def run(self, batch: ForwardBatch) -> PendingStep:
        """Launch the step; no host<->device synchronization unless the batch asks for
        prompt logprobs (that rare eager path reads them back here)."""
        if batch.prompt_logprobs:
            return self.run_with_prompt_logprobs(batch)
        return PendingStep(self.run_sampling(batch), [])

    def run_sampling(self, batch: ForwardBatch) -> DeviceSample | None:
        graph = self.graphs.bucket_for(batch) if self.graphs is not None else None
        if batch.steps > 1 and (graph is None or not isinstance(self.graphs, CpuStepRunner)):
            # NOTE: the scheduler plans runs only where the native step takes the batch.
            raise ValueError(f"a decode run of {len(batch.rows)} rows needs the native CPU decode step")
        if graph is None:
            logits = self.forward(batch)
        else:
            assert self.graphs is not None
            if self.states is not None:
                self.check_states(batch)
                self.run_state_copies(batch.state_copies)
            if batch.sampling and isinstance(self.graphs, CpuStepRunner):
                return self.native_sampling(self.graphs, graph, batch)
            logits = self.graphs.replay(graph, batch)
        if not batch.sampling:
            return None
        return self.sample(logits, batch)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The eager forward at the batch's own shape -> logits of its sampling rows."""
        input_ids, positions, logits_indices = self.prepare(batch)
        self.attention.prepare(batch.rows, batch.prefix_lens, batch.extend_lens)
        if self.states is None:
            logits = self.model.forward(input_ids, positions, self.attention, logits_indices)
        else:
            logits = self.model.forward(
                input_ids, positions, self.attention, logits_indices, self.hybrid_step(batch), self.states
            )
        return logits  # type: ignore[no-any-return]

    def run_with_prompt_logprobs(self, batch: ForwardBatch) -> PendingStep:
        """Eager: every token's hidden state, then logits of the sampling rows and, in
        slices, of the prompt positions the spans ask for."""
        input_ids, positions, logits_indices = self.prepare(batch)
        self.attention.prepare(batch.rows, batch.prefix_lens, batch.extend_lens)
        if self.states is None:
            hidden = self.model.hidden(input_ids, positions, self.attention)
        else:
            hidden = self.model.hidden(input_ids, positions, self.attention, self.hybrid_step(batch), self.states)
        prompt = prompt_logprobs(self.model.logits, hidden, batch.prompt_logprobs, batch.extend_lens)
        if not batch.sampling:
            return PendingStep(None, prompt)
        logits = self.model.logits(hidden.index_select(0, logits_indices))
        return PendingStep(self.sample(logits, batch), prompt)

    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None:
        """Queued state copies on their own, when the engine goes idle (so a cached state is
        complete without a next step); a tensor-parallel runner runs them on every rank."""
        self.run_state_copies(copies)

    def run_state_copies(self, copies: Sequence[tuple[int, int]]) -> None:
        """Run state copies (src, dst) in order, here: a step's before its forward (every
        rank runs its own step's), or the idle ones (`copy_states`)."""
        assert self.states is not None
        for src, dst in copies:
            self.states.copy(src, dst)

    def move_kv(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy each (src, dst) slot's K and V in every layer: a token tree's accepted side
        nodes to the request's own slots (kernel/speculative/tree.py). Sources and
        destinations are distinct slots, so the order does not matter."""
        src = torch.tensor([m[0] for m in moves], dtype=torch.int64).to(self.pool.k[0].device)
        dst = torch.tensor([m[1] for m in moves], dtype=torch.int64).to(self.pool.k[0].device)
        for k, v in zip(self.pool.k, self.pool.v):
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def hybrid_step(self, batch: ForwardBatch) -> HybridStep:
        """Copy the states the batch asks for, then say where each request reads and writes."""
        assert self.states is not None
        self.check_states(batch)
        self.run_state_copies(batch.state_copies)
        return HybridStep.build(
            batch.extend_lens,
            batch.prefix_lens,
            batch.state_src,
            batch.state_dst,
            self.device,
            track=batch.state_track,
        )

    @staticmethod
    def check_states(batch: ForwardBatch) -> None:
        if len(batch.state_src) != len(batch.rows) or len(batch.state_dst) != len(batch.rows):
            # NOTE: invariant 6 - missing metadata is an error, never zero-filled.
            raise ValueError("a hybrid model's batch lacks state slots for some request")
        if batch.state_track and len(batch.state_track) != len(batch.rows):
            raise ValueError("a hybrid model's batch has tracked states for only some requests")

    def prepare(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.inputs.build(batch)

    def sample(self, logits: torch.Tensor, batch: ForwardBatch) -> DeviceSample | None:
        """The batch's sampling rows' tokens (None: this runner does not sample — a
        tensor-parallel worker rank, kernel/parallel/worker.py)."""
        return self.record_next(batch, sample_on_device(logits, self.sampling_batch(batch)))

    def native_sampling(self, steps: CpuStepRunner, graph: Graph, batch: ForwardBatch) -> DeviceSample:
        """A decode batch on the native CPU step (graphs.mode cpu), sampled: a plain-greedy
        batch's tokens are picked by the step itself (its head's threads take each row's
        argmax while the logits are in their caches), any other's from the logits."""
        sb = self.sampling_batch(batch)
        if batch.steps > 1:  # a decode run: every row's `steps` tokens at once
            if not sb.picks_only:
                raise ValueError("a decode run is for plain-greedy rows and rows drawn by temperature alone")
            draws = run_draws(batch.sampling, batch.steps, self.vocab_size, self.device)
            return picked_sample(steps.replay_run(graph, batch, *draws), sb)
        if sb.plain_greedy:
            return self.record_next(batch, picked_sample(steps.replay_argmax(graph, batch), sb))
        return self.record_next(batch, sample_on_device(steps.replay(graph, batch), sb))

    def sampling_batch(self, batch: ForwardBatch) -> SamplingBatch:
        rows = batch.sampling
        return SamplingBatch.build(
            params=rows,
            seeds=[r.seed for r in rows],
            steps=[r.step for r in rows],
            prompt_ids=[r.prompt_ids for r in rows],
            output_ids=[r.output_ids for r in rows],
            vocab_size=self.vocab_size,
            device=self.device,
            maskers=[r.grammar for r in rows] if any(r.grammar is not None for r in rows) else (),
            want_logprobs=[r.logprobs for r in rows],
            native_argmax=self.native_argmax,
        )

    def record_next(self, batch: ForwardBatch, sampled: DeviceSample) -> DeviceSample:
        next_tokens = self.inputs.next_tokens
        if next_tokens is not None:
            # Overlap scheduling: the next step may already be queued with placeholders.
            next_tokens.record([batch.rows[i] for i in batch.sample_rows], sampled.tokens)
        return sampled
