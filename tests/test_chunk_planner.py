"""Property tests of the one chunk planner (invariant 1)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache.allocator import pages_for
from kernel.scheduling.chunk_planner import plan_chunk

page_sizes = st.sampled_from([1, 2, 4, 8, 16, 32, 64])


@settings(max_examples=400, deadline=None)
@given(
    prompt=st.integers(1, 5000),
    page_size=page_sizes,
    budget=st.integers(1, 2048),
    free_pages=st.integers(0, 400),
)
def test_single_chunk_is_final_or_aligned(prompt: int, page_size: int, budget: int, free_pages: int) -> None:
    n = plan_chunk(0, prompt, page_size, budget, owned_pages=0, free_pages=free_pages)
    assert 0 <= n <= prompt
    assert n <= budget
    assert pages_for(n, page_size) <= free_pages
    if 0 < n < prompt:
        assert n % page_size == 0


# Each example drives a request to completion (up to 2,000 chunks at page size 1).
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    prompt=st.integers(1, 800),
    page_size=page_sizes,
    data=st.data(),
)
def test_chunks_add_up_and_always_progress(prompt: int, page_size: int, data: st.DataObject) -> None:
    """Drive one request to completion with random budgets and free-page counts."""
    start, owned, steps, stalls = 0, 0, 0, 0
    while start < prompt:
        budget = data.draw(st.integers(1, 1024) | st.integers(1, 4 * page_size), label="budget")
        free = data.draw(st.integers(0, 64), label="free")
        if stalls >= 3:  # the scheduler frees pages eventually; model that
            budget, free = max(budget, page_size), max(free, 1)
        n = plan_chunk(start, prompt, page_size, budget, owned, free)
        assert n >= 0 and start + n <= prompt
        end = start + n
        if n and end < prompt:
            assert end % page_size == 0, "non-final chunk ends off the page grid"
        if n:
            need = pages_for(end, page_size) - owned
            assert need <= free, "planned more pages than are free"
            owned += max(need, 0)
        # Progress: with at least one page of budget and one free page, a chunk is planned.
        if budget >= page_size and free >= 1:
            assert n > 0
        stalls = 0 if n else stalls + 1
        start = end
        steps += 1
        assert steps < 10_000
    assert start == prompt


@given(start_pages=st.integers(0, 50), page_size=page_sizes, extra=st.integers(1, 3000))
def test_continuing_request_cut_on_absolute_boundary(start_pages: int, page_size: int, extra: int) -> None:
    start = start_pages * page_size
    total = start + extra
    n = plan_chunk(start, total, page_size, token_budget=page_size * 3 + 1, owned_pages=start_pages, free_pages=2)
    if 0 < n < extra:
        assert (start + n) % page_size == 0


def test_wait_rather_than_unaligned_cut() -> None:
    # Budget smaller than a page and the prompt does not fit: wait (0), never cut at 5.
    assert plan_chunk(0, 100, 16, token_budget=5, owned_pages=0, free_pages=10) == 0
    # No free page and nothing owned: wait.
    assert plan_chunk(0, 100, 16, token_budget=512, owned_pages=0, free_pages=0) == 0
    # Short of pages: an aligned cut at what the free pages hold.
    assert plan_chunk(0, 100, 16, token_budget=512, owned_pages=0, free_pages=3) == 48
    # Final chunk fits: whole tail even if unaligned.
    assert plan_chunk(32, 45, 16, token_budget=512, owned_pages=2, free_pages=1) == 13
