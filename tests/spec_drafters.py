"""Drafters for the speculative-decoding tests, loaded by dotted path
(`speculative.method: tests.spec_drafters:Oracle`).

`Oracle` knows each prompt's reference output (a non-speculative run) and drafts it, with
every draft for an output index i where i % WRONG_EVERY == WRONG_AT made wrong: verify
steps then accept runs of drafts and reject others at known places, so the tests reach
every path of the verification (full acceptance, a rejection, a stop inside a run).
"""

from __future__ import annotations

from typing import Any, ClassVar

from kernel.request import Request
from kernel.speculative.drafter import Drafter

WRONG_EVERY = 7
WRONG_AT = 3


class Oracle(Drafter):
    answers: ClassVar[dict[tuple[int, ...], list[int]]] = {}
    proposed: ClassVar[int] = 0

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)

    def propose(self, req: Request, max_tokens: int) -> list[int]:
        answer = self.answers.get(tuple(req.prompt_ids))
        if answer is None:
            return []
        done = len(req.output_ids)
        if answer[:done] != req.output_ids:
            return []  # off the reference: nothing to guess from
        draft = [t if (done + j) % WRONG_EVERY != WRONG_AT else (t + 1) % 1000 + 5
                 for j, t in enumerate(answer[done : done + max_tokens])]
        type(self).proposed += len(draft)
        return draft
