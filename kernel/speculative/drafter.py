"""The drafter contract (registry kind `drafter`): propose tokens to verify after a
request's last token. A drafter reads tokens only; it never touches pages, slots or the
device, so a wrong draft costs a rejected row and nothing else (invariant 9)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from kernel.request import Request
from kernel.speculative.tree import DraftTree


class Drafter(ABC):
    """Built once per engine from the `speculative` config section's values."""

    # Whether its drafts come from device work (a draft model): `propose` then returns
    # placeholders that the step loop fills in before the verify step is built.
    deferred = False
    # Whether it reads `anywhere` (the prefix cache then indexes every n-gram it inserts).
    reads_ngram_index = False

    def __init__(self, **options: Any) -> None:
        self.options = options
        # What the prefix cache holds right after a token sequence of a namespace (up to n
        # tokens): set by the Speculator; a drafter may use it.
        self.cached: Callable[[Sequence[int], str | None, int], list[int]] | None = None
        # What followed an n-gram (tokens) in any cached sequence of a namespace (up to n
        # tokens): set by the Speculator where the cache indexes n-grams.
        self.anywhere: Callable[[Sequence[int], str | None, int], list[int]] | None = None

    @abstractmethod
    def propose(self, req: Request, max_tokens: int) -> list[int]:
        """Up to `max_tokens` guesses of the tokens after `req.prompt_ids + req.output_ids`
        (fewer, or none, where it has no guess). May update the drafter's own index of
        the request; changes nothing else."""

    def propose_tree(self, req: Request, depth: int, topk: int, rows: int) -> DraftTree:
        """A token tree (speculative.topk > 1): at most `depth` deep, `rows` tokens, and
        `topk` children a node, siblings distinct, main chain first (kernel/speculative/tree.py).
        By default the chain `propose` gives."""
        return DraftTree.chain(self.propose(req, depth)[:depth])

    def forget(self, req: Request) -> None:
        """`req` finished or was retracted (its KV is gone): drop what the drafter keeps
        for it."""
