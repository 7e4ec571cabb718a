"""Token trees (`speculative.topk` > 1): several candidates per drafted position, verified in
one step.

A draft is a tree of nodes after the request's input token. Nodes are listed main chain
first (node i's parent is i - 1 for i < `main`), then side nodes, each after its parent;
siblings differ in token. Every node is one decode row of the verify step (dense models):
main-chain nodes on the request's own table row and pages, as a chain draft; each side
node on a scratch table row of its own whose slots are the request's up to where its path
leaves the main chain, then its path's scratch slots (free pages only, held by the request
until the step lands). So each row attends to exactly the tokens its path would have had:
the decode step that position would have had without speculation.

Acceptance walks from the input token: the token sampled after a node is appended, and
the walk moves to the child drafted with that token, if any (`walk`). Where the accepted
path runs through side nodes, their KV is copied to the request's own slots at the same
positions before anything reads them (`kv_moves`, run by the step loop before the step is
applied), so the request's pages hold its accepted path like after plain decoding.
NOTE: invariant 9: scratch slots never reach the tree or a tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from cache.allocator import PageAllocator
from cache.req_table import ReqToTokenTable
from kernel.request import Request


class DraftTree(NamedTuple):
    """What a drafter proposes: tokens, and per token its parent (-1: the input token).
    `parents` empty: a chain."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...] = ()

    @staticmethod
    def chain(tokens: Sequence[int]) -> DraftTree:
        return DraftTree(tuple(tokens))

    def parent_list(self) -> tuple[int, ...]:
        return self.parents or tuple(range(-1, len(self.tokens) - 1))


class VerifyTree(NamedTuple):
    """A planned token tree: per node its parent, the table row its decode row runs on and
    the KV slot it writes."""

    parents: tuple[int, ...]
    rows: tuple[int, ...]
    slots: tuple[int, ...]

    @property
    def main(self) -> int:
        return main_length(self.parents)


def main_length(parents: Sequence[int]) -> int:
    """How many leading nodes form the main chain."""
    n = 0
    while n < len(parents) and parents[n] == n - 1:
        n += 1
    return n


def depths(parents: Sequence[int]) -> list[int]:
    """Per node: its depth (a child of the input token has depth 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def path(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the input token's child down to `node`, in order."""
    nodes = []
    while node >= 0:
        nodes.append(node)
        node = parents[node]
    return nodes[::-1]


def walk(tokens: Sequence[int], parents: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The rows of a verify step whose sampled tokens are appended, in order: row 0 (after
    the input token), then row 1 + c for each node c drafted with the token sampled
    before it. `sampled[r]` is the token sampled at row r (row 1 + i runs node i). The
    caller stops early where a request finishes."""
    children: dict[int, dict[int, int]] = {}
    for i, (token, p) in enumerate(zip(tokens, parents)):
        children.setdefault(p, {}).setdefault(token, i)
    rows, node = [0], -1
    while (child := children.get(node, {}).get(sampled[rows[-1]])) is not None:
        node = child
        rows.append(1 + child)
    return rows


def legal_tree(tree: DraftTree, legal_prefix: Callable[[Sequence[int]], int]) -> DraftTree:
    """Only nodes whose whole path a grammar allows (`legal_prefix(tokens) -> int`)."""
    parents = tree.parent_list()
    keep: dict[int, int] = {}  # old index -> new index
    tokens: list[int] = []
    new_parents: list[int] = []
    for i, p in enumerate(parents):
        if p >= 0 and p not in keep:
            continue
        path_tokens = [tree.tokens[j] for j in path(parents, i)]
        if legal_prefix(path_tokens) < len(path_tokens):
            continue
        keep[i] = len(tokens)
        tokens.append(tree.tokens[i])
        new_parents.append(keep[p] if p >= 0 else -1)
    return DraftTree(tuple(tokens), tuple(new_parents) if tree.parents else ())


def slot_of(req: Request, position: int, page_size: int) -> int:
    return req.pages[position // page_size] * page_size + position % page_size


def plan_scratch(
    req: Request, tree: DraftTree, allocator: PageAllocator, table: ReqToTokenTable, page_size: int
) -> tuple[tuple[int, ...], VerifyTree | None]:
    """Give `tree`'s side nodes scratch rows and slots (free pages only) and write those
    rows; the request's own pages must already cover its main chain and the tree's depth.
    Returns the tokens kept and the planned tree (None: a chain, or no room for side
    nodes, which are then dropped). The scratch stays with `req` until `free_scratch`."""
    assert req.row is not None and not req.spec_scratch_rows, "a tree's scratch is freed when its step lands"
    parents = tree.parent_list()
    main = main_length(parents)
    side = len(parents) - main
    pages = -(-side // page_size)
    if not side or table.num_scratch_free < side or not allocator.can_allocate(pages):
        return tree.tokens[:main], None
    req.spec_scratch_pages = allocator.allocate(pages)
    req.spec_scratch_rows = [table.allocate_scratch() for _ in range(side)]
    start = req.total_len - 1  # the input token's position
    depth = depths(parents)
    slots = [slot_of(req, start + depth[i], page_size) for i in range(main)]
    rows = [req.row] * main
    for s in range(side):
        slots.append(req.spec_scratch_pages[s // page_size] * page_size + s % page_size)
        rows.append(req.spec_scratch_rows[s])
    for i in range(main, len(parents)):
        nodes = path(parents, i)
        fork = next(k for k, n in enumerate(nodes) if n >= main)  # path nodes before it are main
        table.copy_row(req.row, rows[i], start + 1 + fork)
        table.write_slots(rows[i], start + 1 + fork, [slots[n] for n in nodes[fork:]])
    return tree.tokens, VerifyTree(parents, tuple(rows), tuple(slots))


def free_scratch(req: Request, allocator: PageAllocator, table: ReqToTokenTable) -> None:
    if req.spec_scratch_pages:
        allocator.free(req.spec_scratch_pages)
        req.spec_scratch_pages = []
    for row in req.spec_scratch_rows:
        table.free_scratch(row)
    req.spec_scratch_rows = []


def kv_moves(req: Request, start: int, tokens: Sequence[int], tree: VerifyTree, sampled: Sequence[int],
             page_size: int) -> list[tuple[int, int]]:
    """(scratch slot, own slot) of each side node on the path `walk` accepts (a superset of
    what the request keeps where it finishes inside the path: those positions lie past its
    KV and are never read)."""
    depth = depths(tree.parents)
    rows = walk(tokens, tree.parents, sampled)
    main = tree.main
    return [(tree.slots[r - 1], slot_of(req, start + depth[r - 1], page_size)) for r in rows[1:] if r - 1 >= main]
