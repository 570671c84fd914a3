"""KVCacheManager: the scheduler's contract with the KV cache, read as a specification."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from banyan.errors import InvalidParameterError
from banyan.kv_cache import KVCacheManager, PrefixMatch, StalePrefixError


def make_manager(page_size: int = 4, num_pages: int = 32, enable_prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_pages, page_size, enable_prefix_caching)


def run_prompt(kv: KVCacheManager, request_id: str, tokens, namespace=None) -> PrefixMatch:
    """Admit a request the way the scheduler does, compute its whole prompt, cache it."""
    prefix = kv.match_prefix(tokens[:-1], namespace)
    assert kv.allocate_slots(request_id, len(tokens), prefix)
    kv.cache_completed_pages(request_id, tokens, len(tokens), namespace)
    kv.check_integrity()
    return prefix


def test_prefix_is_reused_across_two_requests():
    kv = make_manager(page_size=4)
    prompt = list(range(10))  # 2 full pages + 2 tokens
    assert run_prompt(kv, "a", prompt).num_tokens == 0
    prefix = run_prompt(kv, "b", prompt[:8] + [99, 98, 97])
    assert prefix.num_tokens == 8
    assert list(kv.page_table("b"))[:2] == list(kv.page_table("a"))[:2] == prefix.page_ids
    assert kv.stats().num_in_use == 3 + 1  # 2 shared + a's tail + b's tail
    kv.free("a")
    kv.free("b")
    kv.check_integrity()
    assert kv.stats().num_cached == 2 and kv.stats().num_in_use == 0


def test_match_prefix_never_mutates():
    kv = make_manager()
    run_prompt(kv, "a", list(range(9)))
    kv.free("a")
    before = (kv.stats(), kv.num_allocatable_pages())
    for _ in range(3):
        assert kv.match_prefix(list(range(9))).num_tokens == 8
    assert (kv.stats(), kv.num_allocatable_pages()) == before


def test_partial_page_tail_is_not_cached():
    kv = make_manager(page_size=4)
    run_prompt(kv, "a", list(range(7)))
    assert kv.match_prefix(list(range(7))).num_tokens == 4
    kv.free("a")
    assert kv.stats().num_cached == 1 and kv.stats().num_free == 31


def test_eviction_takes_least_recently_used_pages_first():
    kv = make_manager(page_size=2, num_pages=6)
    for rid, token in [("old", 1), ("mid", 2), ("new", 3)]:
        run_prompt(kv, rid, [token] * 4)
        kv.free(rid)
    assert kv.stats().num_cached == 6 and kv.num_allocatable_pages() == 6
    assert kv.allocate_slots("x", 4)  # needs 2 pages: evicts "old" only
    assert kv.match_prefix([1] * 4).num_tokens == 0
    assert kv.match_prefix([2] * 4).num_tokens == 4
    assert kv.match_prefix([3] * 4).num_tokens == 4
    kv.check_integrity()


def test_prefix_pages_are_locked_before_eviction():
    kv = make_manager(page_size=2, num_pages=4)
    run_prompt(kv, "a", [1, 1, 2, 2])
    kv.free("a")  # 2 cached pages, 2 free
    prefix = kv.match_prefix([1, 1, 2, 2, 3])
    assert prefix.num_tokens == 4
    assert not kv.allocate_slots("b", 10, prefix)  # 3 new pages: only 2 free once the prefix is locked
    assert kv.allocate_slots("b", 8, prefix)
    assert list(kv.page_table("b"))[:2] == prefix.page_ids
    kv.check_integrity()


def test_failed_allocation_changes_nothing():
    kv = make_manager(page_size=2, num_pages=4)
    run_prompt(kv, "a", [1, 1, 2, 2])
    kv.free("a")
    assert kv.allocate_slots("b", 2)
    before = (kv.stats(), kv.page_table("b"), kv.match_prefix([1, 1, 2, 2]))
    assert not kv.allocate_slots("b", 10)
    assert not kv.allocate_slots("c", 10, kv.match_prefix([1, 1, 2, 2]))
    assert (kv.stats(), kv.page_table("b"), kv.match_prefix([1, 1, 2, 2])) == before
    assert kv.page_table("c") == ()
    kv.check_integrity()


def test_allocation_grows_by_whole_pages():
    kv = make_manager(page_size=4)
    assert kv.pages_needed("a", 5) == 2
    assert kv.allocate_slots("a", 5)
    assert kv.pages_needed("a", 8) == 0 and kv.pages_needed("a", 9) == 1
    assert kv.allocate_slots("a", 8) and len(kv.page_table("a")) == 2
    assert kv.allocate_slots("a", 9) and len(kv.page_table("a")) == 3
    with pytest.raises(InvalidParameterError):
        kv.allocate_slots("a", 20, PrefixMatch([0], 4))  # prefix only on the first allocation


def test_trim_gives_back_the_pages_only_rejected_drafts_filled():
    kv = make_manager(page_size=4, num_pages=8)
    prompt = list(range(9))  # 2 full pages (cached) + 1 token
    run_prompt(kv, "a", prompt)
    assert kv.allocate_slots("a", 9 + 1 + 6)  # the last token and 6 drafts: up to 16 tokens, 4 pages
    free = kv.stats().num_free
    assert kv.trim("a", 10) == 1 and kv.stats().num_free == free + 1  # 2 accepted: 10 tokens, 3 pages
    assert kv.trim("a", 4) == 1 and len(kv.page_table("a")) == 2  # settled (cached) pages are never given back
    assert kv.trim("unknown", 0) == 0
    kv.check_integrity()
    kv.free("a")
    kv.check_integrity()
    assert kv.stats().num_in_use == 0


def test_caching_disabled_matches_nothing_and_frees_everything():
    kv = make_manager(enable_prefix_caching=False)
    prompt = list(range(12))
    run_prompt(kv, "a", prompt)
    assert kv.match_prefix(prompt).num_tokens == 0
    kv.free("a")
    assert kv.stats().num_free == 32 and kv.stats().num_cached == 0


def test_duplicate_concurrent_prefixes_keep_private_copies():
    kv = make_manager(page_size=2, num_pages=16)
    prompt = [5, 5, 6, 6, 7]
    for rid in "ab":  # both admitted before either has cached anything
        assert kv.allocate_slots(rid, len(prompt), kv.match_prefix(prompt[:-1]))
    kv.cache_completed_pages("a", prompt, 5)
    kv.cache_completed_pages("b", prompt, 5)  # tree already has these tokens: b keeps its own
    kv.check_integrity()
    assert kv.match_prefix(prompt).page_ids == list(kv.page_table("a"))[:2]
    assert not set(kv.page_table("a")) & set(kv.page_table("b"))
    kv.free("b")
    assert kv.stats().num_free == 16 - 3  # b's three pages all went back
    kv.free("a")
    kv.check_integrity()
    assert kv.stats().num_cached == 2


def test_stale_prefix_is_rejected():
    kv = make_manager(page_size=2, num_pages=2)
    run_prompt(kv, "a", [1, 1, 2, 2])
    kv.free("a")
    prefix = kv.match_prefix([1, 1, 2, 2])
    assert kv.allocate_slots("b", 4)  # evicts the cached prompt
    with pytest.raises(StalePrefixError):
        kv.allocate_slots("c", 6, prefix)
    kv.check_integrity()


def test_namespaces_are_isolated_and_fixed_per_request():
    kv = make_manager(page_size=2)
    run_prompt(kv, "a", [1, 1, 2, 2, 3], namespace="tenant-1")
    assert kv.match_prefix([1, 1, 2, 2], "tenant-2").num_tokens == 0
    assert kv.match_prefix([1, 1, 2, 2], "tenant-1").num_tokens == 4
    with pytest.raises(InvalidParameterError):
        kv.cache_completed_pages("a", [1, 1, 2, 2, 3, 3], 6, namespace="tenant-2")


def test_free_is_idempotent_and_reset_needs_idle_cache():
    kv = make_manager()
    run_prompt(kv, "a", list(range(9)))
    assert not kv.reset_prefix_cache()  # a still holds its pages
    assert kv.match_prefix(list(range(9))).num_tokens == 8
    kv.free("a")
    kv.free("a")
    kv.free("never-seen")
    assert kv.reset_prefix_cache()
    assert kv.stats() == (32, 32, 0, 0, 0.0)


# -- property test ----------------------------------------------------------------------------
PAGE = 2
BASES = [[1, 1, 2, 2, 3], [1, 1, 2, 2, 4, 4], [7, 7, 7]]


class ManagerMachine(RuleBasedStateMachine):
    """Requests with shared prompts in a few namespaces, run in chunks, finished at random.

    `content[page]` is what the test believes a page holds: (namespace, the tokens up to its end).
    A match must only return pages whose content is exactly the queried prefix, and a running
    request's computed pages must never be handed to anyone else.
    """

    caching = True

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_pages=12, page_size=PAGE, enable_prefix_caching=self.caching)
        self.running: dict[str, dict] = {}
        self.content: dict[int, tuple] = {}
        self.ids = 0

    def _write(self, rid: str) -> None:
        """Record what the request's fully computed pages now hold."""
        r = self.running[rid]
        for i, page in enumerate(self.kv.page_table(rid)[: r["computed"] // PAGE]):
            self.content[page] = (r["ns"], tuple(r["tokens"][: (i + 1) * PAGE]))

    def _snapshot(self):
        tables = {rid: self.kv.page_table(rid) for rid in self.running}
        return self.kv.stats(), self.kv.num_allocatable_pages(), tables

    @rule(base=st.sampled_from(BASES), tail=st.lists(st.integers(0, 2), max_size=4),
          ns=st.sampled_from([None, "x"]), chunk=st.integers(1, 6))
    def admit(self, base, tail, ns, chunk):
        tokens, rid = base + tail, f"r{self.ids}"
        self.ids += 1
        prefix = self.kv.match_prefix(tokens[:-1], ns)
        for i, page in enumerate(prefix.page_ids):
            assert self.content[page] == (ns, tuple(tokens[: (i + 1) * PAGE]))
        target = min(len(tokens), prefix.num_tokens + chunk)
        before = self._snapshot()
        if not self.kv.allocate_slots(rid, target, prefix):
            assert self._snapshot() == before
            return
        self.running[rid] = {"tokens": tokens, "ns": ns, "computed": target}
        self._write(rid)
        self.kv.cache_completed_pages(rid, tokens, target, ns)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 50), chunk=st.integers(1, 4), extra=st.integers(0, 2))
    def step(self, i, chunk, extra):
        rid = sorted(self.running)[i % len(self.running)]
        r = self.running[rid]
        r["tokens"].append(extra)  # a decoded token: the sequence keeps growing
        target = min(len(r["tokens"]), r["computed"] + chunk)
        before = self._snapshot()
        if not self.kv.allocate_slots(rid, target):
            assert self._snapshot() == before
            return
        r["computed"] = target
        self._write(rid)
        self.kv.cache_completed_pages(rid, r["tokens"], target, r["ns"])

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 50))
    def finish(self, i):
        rid = sorted(self.running)[i % len(self.running)]
        del self.running[rid]
        self.kv.free(rid)
        self.kv.free(rid)

    @rule()
    def drain(self):
        for rid in list(self.running):
            self.kv.free(rid)
        self.running.clear()
        assert self.kv.reset_prefix_cache()
        assert self.kv.stats().num_free == self.kv.num_pages

    @invariant()
    def consistent(self):
        self.kv.check_integrity()
        for rid, r in self.running.items():  # nobody overwrote a running request's pages
            for i, page in enumerate(self.kv.page_table(rid)[: r["computed"] // PAGE]):
                assert self.content[page] == (r["ns"], tuple(r["tokens"][: (i + 1) * PAGE]))
        if not self.caching:
            assert self.kv.stats().num_cached == 0


class ManagerMachineNoCaching(ManagerMachine):
    caching = False


ManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
ManagerMachineNoCaching.TestCase.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
TestManagerMachine = ManagerMachine.TestCase
TestManagerMachineNoCaching = ManagerMachineNoCaching.TestCase
