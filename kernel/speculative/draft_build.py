"""The draft model of `speculative.method: draft`, built beside the target: any checkpoint
tierserve loads (its own dtype and quantization; dense or hybrid), checked at start-up to share the
target's vocabulary, with a KV pool of the target's page count over the target's
request-token table (kernel/speculative/draft_model.py says why)."""

from __future__ import annotations

import dataclasses

import torch

from cache.kv_pool import KVPool
from cache.req_table import ReqToTokenTable
from cache.state_pool import StatePool
from gpu.graphs import cpu_step
from gpu.graphs.cpu_step import CpuStepRunner
from gpu.graphs.runner import GraphBuckets, GraphRunner
from gpu.model_runner import ModelRunner
from kernel import registry
from kernel.config import Config, ConfigError
from kernel.model_build import BuiltModel, build_model
from kernel.speculative.draft_model import DraftModel, state_slots


def build_draft(config: Config, device: torch.device, target: BuiltModel, context: int, num_pages: int,
                table: ReqToTokenTable, attention_name: str, buckets: GraphBuckets,
                graph_mode: str | None = None) -> DraftModel:
    """`graph_mode`: the target's graph runner's (cuda / emulate), if it has one: the
    draft's steps then replay the buckets of a graph runner of its own (on a static-shape
    attention backend; a hybrid draft's prefill buckets emulated only, as the target's);
    else, on a CPU where the draft has a native decode step, they run natively."""
    spec = config.speculative
    assert spec.draft_model is not None
    section = dataclasses.replace(config.model, path=spec.draft_model, dtype=spec.draft_dtype,
                                  quantization=spec.draft_quantization)
    # The draft's numerics never reach an output: no batch-invariant kernels for it. Under
    # tensor parallelism it is whole, on rank 0 only: it drafts there, with no collectives.
    single = dataclasses.replace(config.parallel, tp_size=1)
    draft = build_model(dataclasses.replace(config, model=section, deterministic=False, parallel=single), device)
    check_vocabulary(target, draft)
    if draft.arch.max_position_embeddings < context:
        raise ConfigError(
            f"speculative.draft_model: it reaches {draft.arch.max_position_embeddings} positions, the target "
            f"serves {context}; set model.context_length to at most that"
        )
    arch = draft.arch
    kv_layers = getattr(draft.model, "num_kv_layers", arch.num_layers)  # hybrids: attention layers only
    pool = KVPool(kv_layers, num_pages, config.cache.page_size, arch.num_kv_heads, arch.head_dim, draft.dtype,
                  device)
    if graph_mode is not None and not getattr(draft.model, "static_shapes", True):
        graph_mode = None  # a MoE draft whose experts read routing on the host: its steps run eagerly
    name = attention_name
    if attention_name.startswith("deterministic"):  # the draft's numerics never reach an output
        name = "deterministic" if graph_mode is not None else "torch"  # static-shape metadata for the graphs
    attention = registry.lookup("attention", name)(pool, table.table, cpu_kernels=draft.cpu_kernels)
    # A hybrid draft: two state slots per table row (kernel/speculative/draft_model.py), the
    # request rows' only — a token tree's scratch rows run the target, never the draft.
    states = (StatePool(draft.model.state_shapes(), state_slots(table.num_rows), draft.dtype, device)
              if hasattr(draft.model, "state_shapes") else None)
    runner = ModelRunner(draft.model, pool, attention, states, cpu_kernels=draft.cpu_kernels)
    if graph_mode is not None:
        # NOTE: invariants 5 and 6 for the draft's steps too: its buffers registered, padding
        # rows inert, capture batches built like live ones (gpu/graphs/runner.py).
        graphs = GraphRunner(draft.model, attention, states, graph_mode, decode_buckets=buckets.decode,
                             prefill_tokens=buckets.prefill_tokens, prefill_max_requests=buckets.prefill_max_requests)
        graphs.capture()
        runner.graphs = graphs
    elif device.type == "cpu" and cpu_step.unsupported(draft.model, attention) is None:
        runner.graphs = CpuStepRunner(draft.model, attention, buckets.decode)  # its decode steps, natively
    return DraftModel(runner)


def check_vocabulary(target: BuiltModel, draft: BuiltModel) -> None:
    """A draft proposes token ids: they must mean the target's tokens."""
    if draft.arch.vocab_size != target.arch.vocab_size:
        raise ConfigError(
            f"speculative.draft_model: its vocabulary has {draft.arch.vocab_size} tokens and the target's "
            f"{target.arch.vocab_size}; a draft model must use the target's tokenizer"
        )
    if target.tokenizer is not None and draft.tokenizer is not None and (
            target.tokenizer.backend.get_vocab() != draft.tokenizer.backend.get_vocab()):
        raise ConfigError("speculative.draft_model: its tokenizer differs from the target's (same size, other "
                          "tokens); a draft model must use the target's tokenizer")
