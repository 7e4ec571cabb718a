"""The one chunk planner: how many tokens of a request's uncomputed tail run this step.

NOTE: invariant 1 lives here. Every non-final chunk ends on the grid — an absolute page
boundary, and for hybrid models with the prefix cache on also the state checkpoint grid
(`grid` is then cache.state_track_interval, a multiple of page_size) — for new and
continuing requests alike and whatever the reason the chunk is cut short (token budget,
free pages). A final chunk covers the whole remaining tail. A planner result of 0 means
"wait", never a cut off the grid.
"""

from __future__ import annotations


def plan_chunk(
    start: int,
    total: int,
    page_size: int,
    token_budget: int,
    owned_pages: int,
    free_pages: int,
    grid: int | None = None,
) -> int:
    """Length of the chunk of tokens [start, total) to compute now; 0 means wait.

    start: tokens whose KV is already computed (a page multiple unless only decoding).
    total: tokens known so far (prompt + generated).
    token_budget: tokens this request may add to the step.
    owned_pages / free_pages: pages the request holds / the allocator can still give.
    grid: where non-final chunks may end (default: page_size; a multiple of it).
    """
    grid = grid or page_size
    remaining = total - start
    if remaining <= 0:
        return 0
    capacity = (owned_pages + free_pages) * page_size - start
    limit = min(token_budget, capacity)
    if remaining <= limit:
        return remaining
    end = (start + limit) // grid * grid
    return max(end - start, 0)
