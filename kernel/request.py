"""Request lifecycle state, owned by the event loop."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kernel.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cache.radix_node import TreeNode
    from kernel.structured.grammar import RequestGrammar

_arrival = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request.

    `kv_len` tokens of `prompt_ids + output_ids` have KV in the cache; the rest is the
    tail the scheduler still has to run. A decode step is simply a tail of length 1.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    priority: int = 0
    namespace: str | None = None  # requests in different namespaces never share cached KV
    # An audit replay (kernel/audit.py): a cold run of a served request. It matches and
    # caches nothing, probes no storage, is admitted after every live request, retracted
    # before any, and counted in no served-traffic counter or lifecycle event.
    audit: bool = False
    # Drawn for the audit when it arrived (or an audit replay): its chosen tokens' logprobs
    # are computed and kept for the bitwise comparison even where the client did not ask.
    audit_logprobs: bool = False
    arrival: int = field(default_factory=lambda: next(_arrival))
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Prompt logprobs of the scored tokens so far (kernel/scheduling/prompt_logprobs.py): logprob,
    # rank and top (id, logprob) pairs per token, from the first scored token on.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    status: Status = Status.WAITING
    row: int | None = None
    pages: list[int] = field(default_factory=list)
    shared_pages: int = 0  # leading pages owned by the prefix cache (see kernel/scheduling/prefix_reuse.py)
    cache_handle: TreeNode | None = None  # the cache's (locked) handle covering those pages
    kv_len: int = 0
    # Hybrid models (kernel/states/hybrid_state.py): the live state slot this request writes,
    # a second slot some strategies keep, a cached slot lent for reading the next
    # chunk's starting state, the last checkpointed length, and the slots the step in
    # flight writes (at its end, and at grid points inside a prefill chunk).
    state_slot: int | None = None
    track_slot: int | None = None
    resume_slot: int | None = None
    checkpoint_len: int = 0
    step_dst: int | None = None
    step_track: list[tuple[int, int]] = field(default_factory=list)  # checkpoints inside the chunk
    # A verify step in flight (speculative decoding): (length, slot) of the state after
    # each position of its chunk, the last one its end (kernel/states/hybrid_state.py).
    verify_states: list[tuple[int, int]] = field(default_factory=list)
    # and a token tree's: the slot of the state after each side node (its branch's chunk).
    verify_side: list[int] = field(default_factory=list)
    # Host tier (kernel/tiers/host_tier.py): the load-back this request waits for, and its hit
    # tokens by tier (device + host + storage == cached_tokens).
    loading: object | None = None
    host_wait: bool = False  # its host prefix cannot be loaded yet: wait for admission
    storage_fetch: object | None = None  # a storage fetch of its prefix it waits for (before admission)
    storage_probes: int = 0  # storage checks of its prefix so far (kernel/tiers/storage_tier.py)
    storage_matched: int = 0  # pages the tree held for it at the last check (or after its fetch)
    storage_deadline: float = 0.0  # when its wait for storage ends, all checks together
    storage_span: tuple[int, int] | None = None  # tokens its fetch brought into the host tier
    cached_by_tier: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    cached_tokens: int = 0
    inflight: int = 0  # steps in flight that carry it (up to two with overlap scheduling)
    # Overlap scheduling (kernel/scheduling/overlap.py): kv_len and output_ids already count the step
    # in flight, whose token is the placeholder (a negative id) at the end of output_ids.
    ahead: bool = False
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    num_retractions: int = 0
    # Speculative decoding (kernel/speculative/): tokens drafted and accepted, verify steps.
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_steps: int = 0
    # A token tree's scratch (kernel/speculative/tree.py) while its verify step runs: pages
    # holding its side nodes' KV and the table rows they run on.
    spec_scratch_pages: list[int] = field(default_factory=list)
    spec_scratch_rows: list[int] = field(default_factory=list)
    # Structured outputs (kernel/structured/grammar.py): its matcher, advanced with each output token.
    grammar: RequestGrammar | None = None

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole list."""
        n_prompt = len(self.prompt_ids)
        if end <= n_prompt:
            return self.prompt_ids[start:end]
        if start >= n_prompt:
            return self.output_ids[start - n_prompt : end - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - n_prompt]

    @property
    def num_generated(self) -> int:
        """Output tokens known on the host (a look-ahead placeholder is not one yet)."""
        return len(self.output_ids) - (1 if self.output_ids and self.output_ids[-1] < 0 else 0)

    def cut_output(self, keep: int) -> None:
        """Keep the first `keep` output tokens (a stop string ended the request inside a
        verify step's tokens); KV is then valid for the tokens kept at most."""
        del self.output_ids[keep:], self.output_logprobs[keep:], self.output_top_logprobs[keep:]
        self.kv_len = min(self.kv_len, self.total_len)

    def settle(self) -> None:
        """The step it went ahead of has landed or failed: drop the placeholder."""
        if self.ahead:
            self.ahead = False
            if self.output_ids and self.output_ids[-1] < 0:
                self.output_ids.pop()

    def finish(self, reason: str, matched: str | int | None = None) -> None:
        if self.status is not Status.FINISHED:
            self.status = Status.FINISHED
            self.finish_reason = reason
            self.matched_stop = matched
