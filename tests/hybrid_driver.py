"""A small engine-less driver for hybrid models: a KV pool, request-table rows, an attention
backend and a StatePool, stepped by hand with chosen chunks (no scheduler, no threads).

Each step takes, per request, the tokens it brings; it lays them out the way the model
runner does (flattened, batch order), runs one forward and returns the float32
log-probabilities at each request's last token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cache.allocator import PageAllocator
from cache.kv_pool import KVPool
from cache.req_table import ReqToTokenTable
from cache.state_pool import StatePool
from gpu.attention.base import AttentionBackend
from gpu.attention.deterministic import DeterministicAttention
from gpu.attention.torch_backend import TorchAttention
from gpu.loader import load_checkpoint
from gpu.models.hybrid_step import HybridStep
from gpu.models.lfm2 import Lfm2Model
from gpu.models.qwen3_5 import Qwen3_5Model
from kernel.registry import lookup

HybridModel = Qwen3_5Model | Lfm2Model  # Qwen3-Next and Qwen3.5-MoE subclass Qwen3_5Model


def load_model(folder: str, deterministic: bool = False, dtype: torch.dtype = torch.float32) -> HybridModel:
    ckpt = load_checkpoint(folder, dtype)
    cls = lookup("model", ckpt.arch.architecture)
    assert issubclass(cls, (Qwen3_5Model, Lfm2Model)), cls
    return cls(ckpt.arch, ckpt.weights, dtype, torch.device("cpu"), deterministic=deterministic)  # type: ignore[no-any-return]


@dataclass
class Req:
    row: int
    slot: int
    length: int = 0  # tokens whose KV and state are computed
    pages: list[int] = field(default_factory=list)


class Driver:
    def __init__(
        self, model: HybridModel, page_size: int = 16, num_pages: int = 96, num_slots: int = 8
    ) -> None:
        arch = model.arch
        self.model = model
        self.page_size = page_size
        self.kv = KVPool(
            model.num_kv_layers,
            num_pages,
            page_size,
            arch.num_kv_heads,
            arch.head_dim,
            model.dtype,
            model.device,
        )
        self.table = ReqToTokenTable(8, 1024, model.device)
        self.pages = PageAllocator(num_pages)
        self.attn: AttentionBackend = (
            DeterministicAttention(self.kv, self.table.table)
            if model.deterministic
            else TorchAttention(self.kv, self.table.table)
        )
        self.states = StatePool(model.state_shapes(), num_slots, model.dtype, model.device)

    def new_request(self) -> Req:
        row, slot = self.table.allocate(), self.states.allocate()
        assert row is not None and slot is not None
        return Req(row, slot)

    def fork(self, req: Req) -> Req:
        """A second request holding the same prefix: its table row points at the same KV
        pages, its state is a copy in a new slot. Use when req.length is page-aligned."""
        assert req.length % self.page_size == 0
        other = self.new_request()
        self.table.write_pages(other.row, 0, req.pages, self.page_size)
        other.pages = list(req.pages)
        other.length = req.length
        self.states.copy(req.slot, other.slot)
        return other

    def resume(self, req: Req, length: int, slot: int) -> Req:
        """A second request holding req's first `length` tokens: its table row points at
        req's pages for them, its state is read from `slot` (e.g. one tracked at
        `length`). Use when length is page-aligned: the new request then writes its own
        pages only."""
        assert length % self.page_size == 0 and length <= req.length
        row = self.table.allocate()
        assert row is not None
        pages = req.pages[: length // self.page_size]
        self.table.write_pages(row, 0, pages, self.page_size)
        return Req(row, slot, length, list(pages))

    def step(
        self,
        work: list[tuple[Req, list[int]]],
        dst_slots: list[int] | None = None,
        track: list[list[tuple[int, int]]] | None = None,
    ) -> torch.Tensor:
        """One forward over `work` (request, new tokens) -> logprobs [R, vocab] at each
        request's last new token. dst_slots: where states go (default: each request's slot);
        track: per request, (end_len, slot) pairs of states inside the chunk to keep."""
        for req, toks in work:
            self._reserve(req, req.length + len(toks))
        prefix = [req.length for req, _ in work]
        extend = [len(toks) for _, toks in work]
        input_ids = torch.tensor([t for _, toks in work for t in toks], dtype=torch.int64)
        positions = torch.tensor([p + i for p, n in zip(prefix, extend) for i in range(n)], dtype=torch.int64)
        ends = torch.cumsum(torch.tensor(extend), 0) - 1
        rows = [req.row for req, _ in work]
        self.attn.prepare(rows, prefix, extend)
        src = [req.slot for req, _ in work]
        state = HybridStep.build(extend, prefix, src, dst_slots or src, self.model.device, track=track)
        with torch.inference_mode():
            logits = self.model.forward(input_ids, positions, self.attn, ends, state, self.states)
        for (req, toks), dst in zip(work, dst_slots or src):
            req.length += len(toks)
            req.slot = dst
        return torch.log_softmax(logits, dim=-1)

    def _reserve(self, req: Req, total: int) -> None:
        need = -(-total // self.page_size) - len(req.pages)
        if need > 0:
            new = self.pages.allocate(need)
            self.table.write_pages(req.row, len(req.pages), new, self.page_size)
            req.pages.extend(new)


def run_schedule(
    driver: Driver, prompts: list[list[int]], chunks: list[list[int]], num_decode: int,
    forced: list[list[int]] | None = None,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy generation, continuous-batching style: each step, every request brings its
    next prefill chunk (sizes from `chunks`) or, once its prompt is in, its last token:
    its own greedy one, or teacher-forced, the next of `forced` (e.g. a reference's).
    Returns per request the greedy ids and the logprobs [num_decode, vocab] of each
    generated position."""
    assert all(sum(c) == len(p) for c, p in zip(chunks, prompts))
    reqs = [driver.new_request() for _ in prompts]
    cursor = [0] * len(prompts)  # next prefill chunk of each request
    out_ids: list[list[int]] = [[] for _ in prompts]
    out_lps: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(len(o) < num_decode for o in out_ids):
        work: list[tuple[Req, list[int]]] = []
        who: list[int] = []
        for i, (req, prompt) in enumerate(zip(reqs, prompts)):
            if cursor[i] < len(chunks[i]):
                start = sum(chunks[i][: cursor[i]])
                work.append((req, prompt[start : start + chunks[i][cursor[i]]]))
                cursor[i] += 1
            elif len(out_ids[i]) < num_decode:
                work.append((req, [out_ids[i][-1] if forced is None else forced[i][len(out_ids[i]) - 1]]))
            else:
                continue
            who.append(i)
        logprobs = driver.step(work)
        for j, i in enumerate(who):
            if cursor[i] == len(chunks[i]):  # prompt complete: this position is generated
                out_ids[i].append(int(torch.argmax(logprobs[j])))
                out_lps[i].append(logprobs[j])
    return out_ids, [torch.stack(lps) for lps in out_lps]


def reference_generate(
    folder: str, prompts: list[list[int]], num_decode: int, model_class: Any = None
) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy generate, one prompt at a time (its own cache: chunked prefill,
    recurrent decode) -> per prompt the generated ids and logprobs [num_decode, vocab].
    `model_class`: the class to load (AutoModelForCausalLM by default)."""
    from transformers import AutoModelForCausalLM

    model = (model_class or AutoModelForCausalLM).from_pretrained(folder, dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=num_decode,
                min_new_tokens=num_decode,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            ids = out.sequences[0, len(prompt) :].tolist()
            logprobs = torch.stack([torch.log_softmax(step[0].float(), -1) for step in out.logits])
            results.append((ids, logprobs))
    return results


def teacher_forced_error(
    model: HybridModel, prompts: list[list[int]], chunks: list[list[int]], num_decode: int,
    reference: list[tuple[list[int], torch.Tensor]],
) -> tuple[float, int, list[list[int]]]:
    """`run_schedule` teacher-forced on the reference's tokens: the max |Δ logprob| over every
    position and token, the top-1 flips where the reference's top-2 margin exceeds 1e-2,
    and our greedy ids."""
    forced = [ids for ids, _ in reference]
    ids, logprobs = run_schedule(Driver(model, page_size=16), prompts, chunks, num_decode, forced)
    worst, flips = 0.0, 0
    for ours_ids, ours_lp, (ref_ids, ref_lp) in zip(ids, logprobs, reference):
        worst = max(worst, float((ours_lp - ref_lp).abs().max()))
        top2 = ref_lp.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-2
        flips += int((torch.tensor(ours_ids) != torch.tensor(ref_ids))[clear].sum())
    return worst, flips, ids
