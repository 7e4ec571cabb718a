"""`graphs.mode: cpu`: decode steps as one native call each, the CPU counterpart of graph replay.

A CUDA graph removes the launch cost of a decode step's few hundred kernels; on CPU the
same cost is a Python dispatch and an OpenMP fork/join per op. Here a decode batch that
fits a bucket runs the model's native decode step (gpu/models/llama_cpu_step.py over
gpu/kernels/cpu/decode_step.cpp): one call, one parallel region. It needs no static
shapes (the call takes any row count), so a bucket is only the admission rule: decode-only
batches of at most the largest decode bucket that the model's quantized kernels run
(their row limit); anything else runs the eager torch path.

The step reads the attention backend's own metadata for the batch (`TorchAttention.prepare_decodes`,
which its `prepare` runs for every decode-only step over the C++ kernel, then
`paged_decodes`), so slots and page tables come from the code every other such step uses.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import structlog
import torch

from gpu.attention.base import AttentionBackend
from gpu.attention.deterministic_paged import PagedDeterministicAttention
from gpu.attention.paged_decode import PagedDecode
from gpu.attention.torch_backend import TorchAttention
from gpu.forward_batch import ForwardBatch
from gpu.graphs.runner import Bucket, Graph
from gpu.models import llama_cpu_step
from gpu.models.llama import LlamaModel
from gpu.step_inputs import StepInputs

log = structlog.get_logger("tierserve")

# The backends whose decode metadata the native step reads (`prepare_decodes`, `paged_decodes`);
# deterministic mode's runs one arithmetic for every token (the chained form), which the step
# then runs too, so the step is exact there as well.
PAGED_BACKENDS = (TorchAttention, PagedDeterministicAttention)
EMPTY = torch.empty(0)  # a run's temperature and noise where every row is greedy


def unsupported(model: Any, attention: AttentionBackend) -> str | None:
    """Why `graphs.mode: cpu` cannot run this model and backend (None: it can)."""
    if not isinstance(attention, PAGED_BACKENDS) or not attention.uses_paged_kernel:
        return "needs an attention backend over the C++ paged decode kernel (torch, or deterministic_paged)"
    if not isinstance(model, LlamaModel):
        return f"has no native decode step for {type(model).__name__}"
    if model.arch.sparse_layers:
        return "has no native decode step for mixture-of-experts layers"
    return llama_cpu_step.unsupported(model, attention.pool)


class CpuStepRunner:
    """Owned by the device thread, beside the ModelRunner (which asks `bucket_for`)."""

    def __init__(self, model: Any, attention: AttentionBackend, decode_buckets: Sequence[int]) -> None:
        assert isinstance(attention, PAGED_BACKENDS), "check unsupported() first"
        self.attention = attention
        chained = isinstance(attention, PagedDeterministicAttention)  # its prefill's arithmetic, for decodes too
        self.decoder = llama_cpu_step.build(model, attention.pool, chained)
        fitting = [b for b in sorted(decode_buckets) if b <= self.decoder.max_rows]
        self.max_rows = fitting[-1] if fitting else 0
        # One handle per row count (what GraphRunner.bucket_for hands out, with nothing captured).
        self._graphs = [Graph(Bucket("decode", n, n), {}) for n in range(1, self.max_rows + 1)]
        self.device: torch.device = model.device
        self.replays: Counter[Bucket] = Counter()  # per decode batch size: how many steps ran natively
        # [0]: bumped by the loop thread when a request arrives; [1]: its value when the loop
        # planned the run now queued or under way. A run reads both between its steps
        # (`replay_run`) and ends once they differ. NOTE: the one value the device reads while
        # the loop may write it: plain int64s, read atomically; a bump read late costs a step.
        self.interrupts = torch.zeros(2, dtype=torch.int64)
        # How placeholder ids resolve: the model runner's, shared by the builder (overlap scheduling).
        self.inputs = StepInputs(self.device)
        log.info("cpu_step_ready", max_rows=self.max_rows, kernel_rows=self.decoder.max_rows)

    @property
    def decode_rows(self) -> int:
        """The most decode rows a step may have and still run natively."""
        return self.max_rows

    def bucket_for(self, batch: ForwardBatch) -> Graph | None:
        """Where the batch runs natively: decodes only, within the row limit (at its own
        size: the call pads nothing), else None (run it eagerly)."""
        rows = len(batch.rows)
        if 0 < rows <= self.max_rows and all(n == 1 for n in batch.extend_lens):
            return self._graphs[rows - 1]
        return None

    def replay(self, graph: Graph, batch: ForwardBatch) -> torch.Tensor:
        """Logits of the batch's sampling rows from one native decode step."""
        return self.decoder.step(*self.step_inputs(graph, batch))

    def replay_argmax(self, graph: Graph, batch: ForwardBatch) -> torch.Tensor:
        """The argmax of each sampling row's logits (int64 [R]) from one native decode step."""
        return self.decoder.step_argmax(*self.step_inputs(graph, batch))

    def replay_run(self, graph: Graph, batch: ForwardBatch, temperature: torch.Tensor = EMPTY,
                   noise: torch.Tensor = EMPTY) -> torch.Tensor:
        """A decode run (batch.steps > 1, every row sampled, plain greedy or drawn by its
        temperature alone: `temperature` [B] and `noise` [steps, B, V] from gpu.sampling.run_draws,
        empty where every row is greedy): up to `steps` native decode steps back to back, each
        row's token the input of its next -> the tokens, int64 [B, done]; done < steps where
        `interrupt_runs` cut it short or a row picked one of its `batch.run_stops`."""
        if batch.sample_rows != tuple(range(len(batch.rows))):
            raise ValueError("a decode run samples every row of its batch")
        input_ids, positions, _, paged, _ = self._decode_inputs(graph, batch, reach=batch.steps - 1)
        width = max((len(s) for s in batch.run_stops), default=0)
        stops = torch.tensor([(*s, *(-1,) * (width - len(s))) for s in batch.run_stops] or [()] * len(batch.rows),
                             dtype=torch.int64).reshape(len(batch.rows), width)
        return self.decoder.steps_argmax(input_ids, positions, paged.page_table, batch.steps, self.interrupts, stops,
                                         temperature, noise)

    def interrupt_runs(self) -> None:
        """From the loop thread: a request arrived, so the run planned last ends after its
        current step (the next plan admits the request instead of making it wait for the run),
        or after its first if it has not started yet."""
        self.interrupts[0] += 1

    def plan_run(self) -> None:
        """From the loop thread, planning a run: only arrivals from now on cut it short."""
        self.interrupts[1] = self.interrupts[0]

    def step_inputs(self, graph: Graph, batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """The native step's arguments for the batch (counted as a replay of its bucket)."""
        input_ids, positions, out_loc, paged, last = self._decode_inputs(graph, batch)
        return input_ids, positions, out_loc, paged.page_table, paged.seq_lens, last

    def _decode_inputs(self, graph: Graph, batch: ForwardBatch, reach: int = 0) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor, PagedDecode, torch.Tensor]:
        """ids, positions, KV slots, paged metadata and sampling rows of the batch's decodes;
        reach: the page tables cover that many positions past each row's (its KV slot and
        key count then are for that position). Counted as replays of the bucket."""
        # NOTE: one host tensor for all four index lists, the attention metadata in one
        # native call: a batch-1 step's Python is paid with cold caches (the step streamed
        # every weight through them), where each small op costs ~3x its warm time.
        n = len(batch.rows)
        flat = torch.tensor((*batch.input_ids, *batch.prefix_lens, *batch.rows, *batch.sample_rows), dtype=torch.int64)
        input_ids, positions, rows, last = flat.split((n, n, n, len(batch.sample_rows)))
        input_ids = self.inputs.resolve(input_ids, batch)
        self.attention.prepare_decodes(rows, positions + reach if reach else positions)
        decodes = self.attention.paged_decodes()
        if decodes is None:  # NOTE: bucket_for admitted only decode batches; the backend must agree
            raise RuntimeError("the attention backend prepared no paged decode metadata for a decode batch")
        out_loc, paged = decodes
        self.replays[graph.bucket] += 1 + reach
        return input_ids, positions, out_loc, paged, last
