"""RadixTree: page-aligned prefixes -> page ids, namespaces, locks up the chain, LRU eviction."""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from banyan.errors import InvalidParameterError
from banyan.kv_cache import KVCacheIntegrityError, RadixTree


def make_tree(page_size: int = 2) -> RadixTree:
    return RadixTree(page_size)


def test_match_returns_the_longest_whole_page_prefix():
    tree = make_tree(2)
    assert tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]) == 0
    assert tree.match([1, 2, 3, 4, 5, 6, 7]).pages == [10, 11, 12]
    assert tree.match([1, 2, 3, 4, 5]).pages == [10, 11]  # partial last page never matches
    assert tree.match([1, 2, 3, 9]).pages == [10]
    assert tree.match([2, 2]).pages == []
    assert tree.match([2, 2]).node is None


def test_insert_splits_on_a_partial_match_and_reports_present_pages():
    tree = make_tree(2)
    tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    assert tree.insert([1, 2, 3, 4, 9, 9], [20, 21, 22]) == 2  # keeps 20, 21 for itself
    assert tree.match([1, 2, 3, 4, 9, 9]).pages == [10, 11, 22]
    assert tree.match([1, 2, 3, 4, 5, 6]).pages == [10, 11, 12]
    assert tree.num_cached_pages == 4
    assert tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]) == 3  # idempotent
    tree.check_integrity({})


def test_namespaces_never_share_matches():
    tree = make_tree(2)
    tree.insert([1, 2, 3, 4], [1, 2], namespace="a")
    assert tree.match([1, 2, 3, 4], namespace="b").pages == []
    assert tree.match([1, 2, 3, 4]).pages == []
    assert tree.insert([1, 2, 3, 4], [5, 6], namespace="b") == 0
    assert tree.match([1, 2, 3, 4], namespace="b").pages == [5, 6]


def test_match_does_not_touch_lru_order():
    tree = make_tree(2)
    tree.insert([1, 1], [1])
    tree.insert([2, 2], [2])
    for _ in range(3):
        tree.match([1, 1])
    assert tree.evict(1) == [1]


def test_eviction_is_lru_and_lock_refreshes_access_time():
    tree = make_tree(2)
    for page, token in enumerate([1, 2, 3]):
        tree.insert([token, token], [page])
    node = tree.match([1, 1]).node
    tree.lock(node)
    tree.unlock(node)  # page 0 is now the most recently used
    assert tree.evict(3) == [1, 2, 0]
    assert tree.num_cached_pages == 0


def test_locked_pages_are_never_evicted_and_locks_cover_ancestors():
    tree = make_tree(2)
    tree.insert([1, 1, 2, 2, 3, 3], [0, 1, 2])
    tree.insert([1, 1, 4, 4], [9, 5])
    tree.lock(tree.match([1, 1, 2, 2, 3, 3]).node)
    assert tree.num_evictable_pages == 1
    assert tree.evict(10) == [5]
    assert tree.num_cached_pages == 3
    tree.insert([6, 6], [7])
    with pytest.raises(KVCacheIntegrityError):
        tree.unlock(tree.match([6, 6]).node)  # never locked


def test_evict_takes_a_leafs_last_pages_first():
    tree = make_tree(2)
    tree.insert([1, 1, 2, 2, 3, 3], [0, 1, 2])
    assert tree.evict(2) == [1, 2]
    assert tree.match([1, 1, 2, 2, 3, 3]).pages == [0]


def test_split_keeps_locks_on_both_halves():
    tree = make_tree(2)
    tree.insert([1, 1, 2, 2], [0, 1])
    node = tree.match([1, 1, 2, 2]).node
    tree.lock(node)
    tree.insert([1, 1, 7, 7], [5, 6])  # splits the locked node
    tree.check_integrity({node: 1})
    assert tree.evict(5) == [6]
    tree.unlock(node)
    tree.check_integrity({})
    assert sorted(tree.evict(5)) == [0, 1]


def test_node_for_prefix_detects_stale_prefixes():
    tree = make_tree(2)
    tree.insert([1, 1, 2, 2], [0, 1])
    assert tree.node_for_prefix([0, 1]) is tree.match([1, 1, 2, 2]).node
    assert tree.node_for_prefix([0]) is not None
    assert tree.node_for_prefix([1]) is None  # not a root path
    tree.evict(2)
    assert tree.node_for_prefix([0, 1]) is None


def test_bad_arguments_raise_typed_errors():
    with pytest.raises(InvalidParameterError):
        RadixTree(0)
    with pytest.raises(InvalidParameterError):
        make_tree(2).insert([1, 2, 3], [0, 1])
    tree = make_tree(2)
    tree.insert([1, 1], [0])
    with pytest.raises(KVCacheIntegrityError):
        tree.insert([2, 2], [0])  # page already cached elsewhere


# -- property test ----------------------------------------------------------------------------
PAGE = 2
tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=10)
namespaces_st = st.sampled_from([None, "a", ("lora", 1)])


class TreeMachine(RuleBasedStateMachine):
    """Model: (namespace, token prefix of i+1 pages) -> page id, plus the pages each lock covers."""

    def __init__(self):
        super().__init__()
        self.tree = make_tree(PAGE)
        self.model: dict[tuple, int] = {}
        self.next_page = 0
        self.locks: list[tuple[object, list[int]]] = []  # (node, pages the locker matched)

    def _model_match(self, tokens, ns) -> list[int]:
        pages = []
        for end in range(PAGE, len(tokens) + 1, PAGE):
            page = self.model.get((ns, tuple(tokens[:end])))
            if page is None:
                break
            pages.append(page)
        return pages

    @rule(tokens=tokens_st, ns=namespaces_st)
    def insert(self, tokens, ns):
        n = len(tokens) // PAGE
        pages = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        present = len(self._model_match(tokens[: n * PAGE], ns))
        assert self.tree.insert(tokens, pages, ns) == present
        for i in range(present, n):
            self.model[(ns, tuple(tokens[: (i + 1) * PAGE]))] = pages[i]

    @rule(tokens=tokens_st, ns=namespaces_st)
    def match(self, tokens, ns):
        before = (self.tree.num_cached_pages, self.tree.num_evictable_pages)
        result = self.tree.match(tokens, ns)
        assert result.pages == self._model_match(tokens, ns)  # same tokens, same namespace
        assert (self.tree.num_cached_pages, self.tree.num_evictable_pages) == before

    @rule(tokens=tokens_st, ns=namespaces_st)
    def lock(self, tokens, ns):
        result = self.tree.match(tokens, ns)
        if result.node is not None:
            self.tree.lock(result.node)
            self.locks.append((result.node, result.pages))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        node, _ = self.locks.pop(i % len(self.locks))
        self.tree.unlock(node)

    @rule(n=st.integers(0, 8))
    def evict(self, n):
        evictable = self.tree.num_evictable_pages
        released = self.tree.evict(n)
        assert len(released) == min(n, evictable)
        protected = {p for _, pages in self.locks for p in pages}
        assert not protected & set(released)
        self.model = {k: v for k, v in self.model.items() if v not in released}

    @invariant()
    def consistent(self):
        self.tree.check_integrity(Counter(node for node, _ in self.locks))
        assert self.tree.num_cached_pages == len(self.model)
        assert set(self.tree.cached_pages()) == set(self.model.values())


TreeMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestTreeMachine = TreeMachine.TestCase
