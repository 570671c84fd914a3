"""BlockPool: free list plus ref counts; a page is free exactly when nobody holds it."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from banyan.errors import InvalidParameterError
from banyan.kv_cache import BlockPool, KVCacheIntegrityError


def make_pool(num_pages: int = 8) -> BlockPool:
    return BlockPool(num_pages)


def test_allocate_hands_out_distinct_pages_with_one_reference():
    pool = make_pool(8)
    pages = pool.allocate(3)
    assert pages == [0, 1, 2]
    assert pool.num_free == 5
    assert all(pool.ref_count(p) == 1 for p in pages)
    pool.check_integrity()


def test_allocate_when_short_returns_none_and_takes_nothing():
    pool = make_pool(4)
    pool.allocate(3)
    assert pool.allocate(2) is None
    assert pool.num_free == 1
    assert pool.allocate(0) == []


def test_last_decref_frees_the_page():
    pool = make_pool(4)
    (page,) = pool.allocate(1)
    pool.incref([page])
    assert pool.decref([page]) == []
    assert pool.decref([page]) == [page]
    assert pool.num_free == 4
    pool.check_integrity()


def test_freed_pages_are_reused_before_the_untouched_ones():
    pool = make_pool(4)
    assert pool.allocate(2) == [0, 1]
    pool.decref([0, 1])
    assert pool.allocate(3) == [0, 1, 2]  # warm in the caches, and already backed on a lazily allocated pool


def test_misuse_raises_typed_errors_and_changes_nothing():
    pool = make_pool(4)
    pages = pool.allocate(2)
    with pytest.raises(KVCacheIntegrityError):
        pool.incref([3])  # free page
    with pytest.raises(KVCacheIntegrityError):
        pool.decref([pages[0], pages[0]])  # below zero
    with pytest.raises(KVCacheIntegrityError):
        pool.decref([7])  # out of range
    with pytest.raises(InvalidParameterError):
        pool.allocate(-1)
    with pytest.raises(InvalidParameterError):
        BlockPool(0)
    assert [pool.ref_count(p) for p in pages] == [1, 1]
    pool.check_integrity()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "incref", "decref"]), st.integers(0, 5)), max_size=40))
def test_random_operations_keep_counts_consistent(ops):
    pool = make_pool(8)
    held: list[int] = []  # one entry per reference
    for op, n in ops:
        if op == "alloc":
            pages = pool.allocate(n)
            assert (pages is None) == (n > pool.num_free + (len(pages) if pages else 0))
            held += pages or []
        elif op == "incref" and held:
            page = held[n % len(held)]
            pool.incref([page])
            held.append(page)
        elif op == "decref" and held:
            page = held.pop(n % len(held))
            freed = pool.decref([page])
            assert freed == ([] if page in held else [page])
        pool.check_integrity()
        assert pool.num_free == 8 - len(set(held))
        assert all(pool.ref_count(p) == held.count(p) for p in range(8))
