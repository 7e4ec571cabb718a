"""Token trees (`speculative.topk` > 1): several candidates per drafted position, verified in
one step.

A draft is a tree of nodes after the request's input token. Nodes are listed main chain
first (node i's parent is i - 1 for i < `main`), then side nodes, each after its parent;
siblings differ in token. Every node is one decode row of the verify step (dense models):
main-chain nodes on the request's own table row and pages, as a chain draft; each side
branch (a chain of side nodes) on a scratch table row of its own: the request's pages
before the page holding the input token, then pages of its own (free pages only, held by
the request until the step lands) into which the computed part of that page is copied
before the step and where the input token and the main-chain tokens before the branch
run again (`plan_scratch` says why). So each row attends to exactly the tokens its path
would have had: the decode step that position would have had without speculation.

A hybrid model's verify step is a chunk through its recurrent state rather than decode
rows: the main chain is the request's chunk, and each side branch a chunk of its own on its
scratch row, of the same tokens as its extra rows then its side nodes, which starts from
the request's state (read only) and writes the state after each side node to a slot of its
own (`VerifyTree.states`); the request resumes from the state after its last accepted node,
wherever on the tree that lies (HybridState.land_verify).

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
    the KV slot it writes; the side branches' extra decode rows (node: -1 the input token,
    table row, position; not sampled) and the KV copies (src, dst slot) to make before the
    step."""

    parents: tuple[int, ...]
    rows: tuple[int, ...]
    slots: tuple[int, ...]
    extra: tuple[tuple[int, int, int], ...] = ()
    copies: tuple[tuple[int, int], ...] = ()
    # Hybrid models: the state slot after each side node, in node order (HybridState.plan_side).
    states: tuple[int, ...] = ()

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


def branches(parents: Sequence[int]) -> list[list[int]]:
    """The side branches: chains of side nodes, each hanging off a main node or the input
    token; a side node with several side children starts a new branch at each but the
    first. Each branch is listed parent first."""
    main = main_length(parents)
    first_child: dict[int, int] = {}
    out: list[list[int]] = []
    for i in range(main, len(parents)):
        p = parents[i]
        if p >= main and first_child.setdefault(p, i) == i:
            next(b for b in out if b[-1] == p).append(i)  # continues its parent's branch
        else:
            out.append([i])
    return out


def plan_scratch(
    req: Request, tree: DraftTree, allocator: PageAllocator, table: ReqToTokenTable, page_size: int,
    max_rows: int, max_side: int = 1 << 30,
) -> tuple[tuple[int, ...], VerifyTree | None]:
    """Give `tree`'s side branches scratch rows and pages (free ones only) and write those
    rows; the request's own pages must already cover its main chain and the tree's depth.
    Branches that do not fit (`max_rows` extra decode rows, `max_side` side nodes, free
    pages, scratch rows) are
    dropped with their nodes, as are branches off other branches. Returns the tokens kept
    and the planned tree (None: only the main chain is left). The scratch stays with `req`
    until `free_scratch`.

    NOTE: attention kernels read KV by page (a position's slot is its page's slot plus its
    offset), so a branch's row maps every position from the page holding the input token
    on to its own pages: the part of that page computed before is copied there before the
    step (`copies`), and the input token and the main-chain tokens before the fork run
    again on the branch's row (`extra` rows: the same inputs, so the same KV)."""
    assert req.row is not None and not req.spec_scratch_rows, "a tree's scratch is freed when its step lands"
    parents = tree.parent_list()
    main = main_length(parents)
    depth = depths(parents)
    start = req.total_len - 1  # the input token's position
    first = start // page_size * page_size  # where a branch's own pages begin
    slots = [slot_of(req, start + depth[i], page_size) for i in range(main)] + [0] * (len(parents) - main)
    rows = [req.row] * len(parents)
    kept: list[int] = list(range(main))
    extra: list[tuple[int, int, int]] = []
    copies: list[tuple[int, int]] = []
    for branch in branches(parents):
        fork = depth[branch[0]] - 1  # main-chain tokens on its path
        last = start + depth[branch[-1]]
        pages = (last - first) // page_size + 1
        # A branch off another branch would need that one's tokens on its row too: dropped.
        if (parents[branch[0]] >= main or fork + 1 > max_rows - len(extra) or not table.num_scratch_free
                or len(kept) - main + len(branch) > max_side or not allocator.can_allocate(pages)):
            continue
        own = allocator.allocate(pages)
        row = table.allocate_scratch()
        req.spec_scratch_pages += own
        req.spec_scratch_rows.append(row)
        table.copy_row(req.row, row, first)
        table.write_pages(row, first // page_size, own, page_size)

        def scratch(position: int) -> int:
            return own[(position - first) // page_size] * page_size + position % page_size  # noqa: B023

        copies += [(slot_of(req, q, page_size), scratch(q)) for q in range(first, start)]
        extra += [(n, row, start + 1 + n) for n in range(-1, fork)]  # the input token, then main nodes
        for n in branch:
            slots[n], rows[n] = scratch(start + depth[n]), row
            kept.append(n)
    if len(kept) == main:
        return tree.tokens[:main], None
    kept.sort()
    index = {old: new for new, old in enumerate(kept)}
    return tuple(tree.tokens[i] for i in kept), VerifyTree(
        tuple(index[parents[i]] if parents[i] >= 0 else -1 for i in kept),
        tuple(rows[i] for i in kept), tuple(slots[i] for i in kept), tuple(extra), tuple(copies))


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


def side_states(tree: VerifyTree | None, start: int, rows: Sequence[int]) -> list[tuple[int, int]]:
    """A hybrid tree's verify step (input token at `start`) landed with the drafts of
    `rows` (walk's rows past row 0) accepted: (length, state slot) after each side node
    among them, in order."""
    if tree is None or not tree.states:
        return []
    depth = depths(tree.parents)
    return [(start + depth[r - 1] + 1, tree.states[r - 1 - tree.main]) for r in rows if r - 1 >= tree.main]
