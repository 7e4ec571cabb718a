"""How many tokens each decoding request drafts this step, and what verification taught.

The adaptive rule (`speculative` config): a request whose drafts were accepted below
`min_acceptance` over its last `window` verify steps drafts nothing for its next
`cooldown` decode steps (then tries again); its draft length doubles after a verify
step that accepted everything and halves after one that accepted less than half (up
to `num_draft_tokens`; a rejected row costs a CPU step about as much as an accepted
one saves); and in a step with more than `max_batch`
decoding requests nobody drafts (the rows would cost more than they save). Counters are
per method, in tokens: drafted, accepted, and verify steps (mean accepted length per
verify step = accepted / verify steps + 1, the bonus token).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cache.prefix_cache import PrefixCache
from gpu.sampling import is_greedy
from kernel import registry
from kernel.config import SpeculativeConfig
from kernel.request import Request
from kernel.speculative.drafter import Drafter
from kernel.speculative.tree import DraftTree, legal_tree

UNBOUNDED = 1 << 30  # quiet_steps of a request that never drafts


@dataclass
class _Track:
    """One request's recent verify outcomes: (drafted, accepted) per step, and how many
    decode steps it still sits out."""

    recent: deque[tuple[int, int]] = field(default_factory=deque)
    resting: int = 0
    length: int = 0  # how many tokens it drafts next (0: not set yet)


@dataclass
class SpecCounters:
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    paused_requests: int = 0  # times the adaptive rule sent a request resting
    skipped_batches: int = 0  # steps where max_batch switched drafting off
    side_drafted_tokens: int = 0  # token trees: drafted and accepted off the main chain
    side_accepted_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter | None = None,
                 row_limit: int | None = None, cache: PrefixCache | None = None) -> None:
        self.config = config
        self.row_limit = row_limit  # decode rows a step may have (graph buckets); None: any
        self.method = config.method
        self.drafter = drafter or registry.lookup("drafter", config.method)(
            ngram_min=config.ngram_min, ngram_max=config.ngram_max
        )
        if cache is not None and cache.reuses:
            self.drafter.cached = cache.continuation
            if self.drafter.reads_ngram_index:  # the index costs every insert: only for a drafter that reads it
                cache.index_ngrams(range(config.ngram_min, config.ngram_max + 1))
                self.drafter.anywhere = cache.ngram_continuation
        self.counters = SpecCounters()
        self._tracks: dict[str, _Track] = {}
        self.batch_on = True  # the max_batch rule's verdict for the step being planned
        self.rows_left = 0  # draft rows the step being planned may still add (row_limit)

    def begin_step(self, decoding: int) -> None:
        """Planning a step with `decoding` requests that may decode."""
        self.batch_on = decoding <= self.config.max_batch
        if not self.batch_on:
            self.counters.skipped_batches += 1
        self.rows_left = self.row_limit - decoding if self.row_limit is not None else 1 << 30

    def draft(self, req: Request, depth: int, rows: int) -> DraftTree:
        """What `req` verifies this step: a chain (or, with topk > 1, a tree) at most
        `depth` tokens deep (its pages and length left) and of at most `rows` tokens (the
        step's budget); nothing where it opted out, rests, or the batch is too large."""
        rows = min(rows, self.rows_left)
        if min(depth, rows) <= 0 or not self.batch_on or not req.params.speculative:
            return DraftTree(())
        track = self._tracks.setdefault(req.rid, _Track())
        length = min(depth, rows, track.length or self._first_length())
        if track.resting:
            track.resting -= 1
            return DraftTree(())
        if req.grammar is not None and self.drafter.deferred:
            return DraftTree(())  # a draft model's tokens come too late to be cut to the grammar
        if self.config.topk > 1:
            tree = self.drafter.propose_tree(req, length, self.config.topk, rows)
        else:
            tree = DraftTree.chain(self.drafter.propose(req, length)[:length])
        if req.grammar is not None:  # structured output: only what its grammar allows can be accepted
            tree = legal_tree(tree, req.grammar.legal_prefix)
        self.rows_left -= len(tree.tokens)
        return tree

    def quiet_steps(self, req: Request) -> int:
        """Decode steps, from the one being planned, in which `req` drafts nothing whatever
        its tokens, so a decode run may take them (kernel/scheduling/decode_runs.py). Asked
        after this step's `draft` gave it nothing: the steps it still rests, else this one
        alone (what it drafts next depends on the token this step picks)."""
        if not self.batch_on or not req.params.speculative:
            return UNBOUNDED
        track = self._tracks.get(req.rid)
        return 1 + (track.resting if track is not None else 0)

    def rest(self, req: Request, steps: int) -> None:
        """A decode run took `steps` more of `req`'s quiet steps (`quiet_steps`)."""
        track = self._tracks.get(req.rid)
        if track is not None:
            track.resting = max(0, track.resting - steps)

    def rejects(self, req: Request) -> bool:
        """Whether `req`'s drafts are verified by the rejection rule (speculative.acceptance
        rejection, a request that samples at random; gpu/rejection.py)."""
        return self.config.acceptance == "rejection" and not is_greedy(req.params)

    def _first_length(self) -> int:
        return max(1, min(4, self.config.num_draft_tokens))

    def record(self, req: Request, drafted: int, accepted: int, depth: int | None = None,
               side: tuple[int, int] = (0, 0)) -> None:
        """A verify step of `req` landed: `accepted` of its `drafted` tokens were kept, of a
        tree `depth` deep (a chain's depth is its length), `side` = (drafted, accepted) of
        them off the tree's main chain. The draft length follows depth."""
        c = self.counters
        c.drafted_tokens += drafted
        c.accepted_tokens += accepted
        c.side_drafted_tokens += side[0]
        c.side_accepted_tokens += side[1]
        c.verify_steps += 1
        req.spec_drafted += drafted
        req.spec_accepted += accepted
        req.spec_steps += 1
        track = self._tracks.setdefault(req.rid, _Track())
        length = track.length or self._first_length()
        depth = drafted if depth is None else depth
        if accepted == depth:
            track.length = min(2 * length, self.config.num_draft_tokens)
        elif 2 * accepted < depth:
            track.length = max(1, length // 2)
        track.recent.append((drafted, accepted))
        if len(track.recent) > self.config.window:
            track.recent.popleft()
        if len(track.recent) == self.config.window:
            total = sum(d for d, _ in track.recent)
            if sum(a for _, a in track.recent) < self.config.min_acceptance * total:
                track.resting = self.config.cooldown
                track.recent.clear()
                c.paused_requests += 1

    def forget(self, req: Request) -> None:
        self._tracks.pop(req.rid, None)
        self.drafter.forget(req)

    def stats(self) -> dict[str, object]:
        c = self.counters
        return {
            "method": self.method,
            **c.as_dict(),
            "mean_accepted_length": (c.accepted_tokens / c.verify_steps + 1) if c.verify_steps else None,
            "resting_requests": sum(1 for t in self._tracks.values() if t.resting),
            "batch_on": self.batch_on,
        }
