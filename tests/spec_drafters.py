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
from kernel.speculative.tree import DraftTree

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
        draft = [t if (done + j) % WRONG_EVERY != WRONG_AT else (t + 1) % 300 + 5
                 for j, t in enumerate(answer[done : done + max_tokens])]
        type(self).proposed += len(draft)
        return draft


class TreeOracle(Oracle):
    """Token trees (speculative.topk > 1): the Oracle's chain as the main branch; where a
    main token is wrong, a side branch from its parent with the right token and the
    reference after it (its 4th token wrong, so side branches reject too); and a decoy
    sibling of the first token, never right, while topk and the rows allow."""

    side_proposed: ClassVar[int] = 0

    def propose_tree(self, req: Request, depth: int, topk: int, rows: int) -> DraftTree:
        main = self.propose(req, depth)
        if not main:
            return DraftTree(())
        answer, done = self.answers[tuple(req.prompt_ids)], len(req.output_ids)
        draft, parents = list(main), list(range(-1, len(main) - 1))
        branches = 0
        for d, token in enumerate(main):
            if branches == topk - 1 or len(draft) >= rows:
                break
            if token == answer[done + d]:
                continue
            branch = answer[done + d : done + depth][: rows - len(draft)]
            branch = [t if j != 3 else (t + 2) % 300 + 5 for j, t in enumerate(branch)]
            parents += [d - 1] + list(range(len(draft), len(draft) + len(branch) - 1))
            draft += branch
            branches += 1
        decoy = (main[0] + 11) % 300 + 5
        roots = {t for t, p in zip(draft, parents) if p == -1}
        if branches < topk - 1 and len(draft) < rows and decoy not in roots and decoy != answer[done]:
            draft.append(decoy)
            parents.append(-1)
        type(self).side_proposed += len(draft) - len(main)
        return DraftTree(tuple(draft), tuple(parents))


def motif_prompt(motif: list[int]) -> list[int]:
    """`motif` six times, each followed by another token, then once more: every n-gram of
    it was followed by several tokens (the n-gram drafter's side branches)."""
    return [t for i in range(6) for t in motif + [motif[0] + 1 + i]] + motif
