"""The radix tree's n-gram index (cache/radix_ngrams.py): what followed an n-gram in any
cached sequence — the latest inserted, across splits, never from an evicted node or
another namespace — and the n-gram drafter falling back to it, output still exact."""

from __future__ import annotations

from typing import Any

from cache.allocator import PageAllocator
from cache.radix_tree import RadixTree
from handlers.evict_lru import LRU
from kernel import Engine
from tests.conftest import TINY_OVERRIDES
from tests.test_speculative import PARAMS, same, tokens


def tree_with(*seqs: list[int], namespace: str | None = None) -> tuple[RadixTree, PageAllocator]:
    alloc = PageAllocator(256)
    tree = RadixTree(4, alloc.free, LRU())
    tree.index_ngrams(range(2, 4))
    for seq in seqs:
        tree.insert(seq, alloc.allocate(len(seq) // 4), namespace)
    return tree, alloc


def test_what_followed_an_ngram_anywhere() -> None:
    a = list(range(100, 124))
    b = list(range(300, 308)) + [110, 111] + list(range(600, 614))  # (110, 111) again, other continuation
    tree, _ = tree_with(a)
    assert tree.ngram_continuation([110, 111], None, 4) == [112, 113, 114, 115]
    assert tree.ngram_continuation([109, 110, 111], None, 30) == a[12:]  # only what is cached
    assert tree.ngram_continuation([111, 110], None, 4) == []
    assert tree.ngram_continuation([110, 111], "other", 4) == []  # namespaces never mix
    tree2, _ = tree_with(a, b)
    assert tree2.ngram_continuation([110, 111], None, 3) == [600, 601, 602]  # the latest insert wins
    assert tree2.ngram_continuation([105, 106], None, 2) == [107, 108]


def test_across_a_split_and_after_eviction() -> None:
    a = list(range(100, 124))
    tree, alloc = tree_with(a)
    c = a[:8] + list(range(700, 716))  # splits a's node after 2 pages
    tree.insert(c, alloc.allocate(len(c) // 4))
    assert tree.ngram_continuation([101, 102], None, 3) == [103, 104, 105]  # now in the upper node
    assert tree.ngram_continuation([113, 114], None, 2) == [115, 116]  # in the lower part, kept its node
    assert tree.ngram_continuation([105, 106, 107], None, 2) == [700, 701]  # indexed last by c
    tree.evict(1000)
    assert tree.num_nodes == 0
    assert tree.ngram_continuation([113, 114], None, 2) == []  # an evicted node is a miss


def test_ngram_drafter_falls_back_to_other_sequences() -> None:
    from handlers.drafter_ngram import NgramDrafter
    from tests.test_speculative import request

    a = list(range(100, 124))
    tree, _ = tree_with(a)
    drafter = NgramDrafter(ngram_min=2, ngram_max=3)
    drafter.anywhere = tree.ngram_continuation
    assert drafter.propose(request([7, 8, 9, 110, 111]), 3) == [112, 113, 114]  # nothing of its own: the tree's
    assert drafter.propose(request([110, 111, 5, 110, 111]), 3) == [5, 110, 111]  # its own comes first
    other = request([7, 8, 9, 110, 111])
    other.namespace = "x"
    assert drafter.propose(other, 3) == []  # another namespace sees nothing
    assert drafter.elsewhere_drafts == 1


def test_ngram_drafter_drafts_from_other_sequences(tiny_chat_folder: str, tiny_det_engine: Engine,
                                                    monkeypatch: Any) -> None:
    """In the engine, with the other lookups switched off: the second run of a prompt drafts
    what followed its last n-gram in the first run's cached sequence; the output is exact."""
    from handlers import drafter_ngram

    monkeypatch.setattr(drafter_ngram._Index, "starts", lambda self, tokens: [])
    engine = Engine(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES, "deterministic": True,
                           "cache.prefix": "radix", "speculative.method": "ngram"})
    try:
        drafter = engine.engine.scheduler.speculator.drafter  # type: ignore[union-attr]
        assert isinstance(drafter, drafter_ngram.NgramDrafter)
        drafter.cached = None  # not the same-prefix continuation either
        prompt, params = tokens(80, 23), {**PARAMS[1], "max_new_tokens": 20}
        ref = tiny_det_engine.generate(prompt, params)
        same(engine.generate(prompt, params), ref)  # type: ignore[arg-type]
        again = engine.generate(prompt, params)
        same(again, ref)  # type: ignore[arg-type]
        assert drafter.elsewhere_drafts > 0, "nothing drafted from the cached sequence"
        assert again["meta_info"]["spec_accepted_tokens"] > 0  # type: ignore[index,call-overload]
    finally:
        engine.shutdown()


def test_planted_namespace_dropped_red(monkeypatch: Any) -> None:
    """The index keyed without the namespace: another tenant's continuation is drafted."""
    from cache.radix_ngrams import NgramIndex

    add, lookup = NgramIndex.add, NgramIndex.lookup
    monkeypatch.setattr(NgramIndex, "add", lambda self, ns, *rest: add(self, None, *rest))
    monkeypatch.setattr(NgramIndex, "lookup", lambda self, ns, *rest: lookup(self, None, *rest))
    tree, _ = tree_with(list(range(100, 124)))
    assert tree.ngram_continuation([110, 111], "other", 4) != []  # the isolation assertion above goes red
