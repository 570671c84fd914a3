"""KVCacheManager: the scheduler's only view of the KV cache.

It owns a BlockPool (free list, ref counts) and a RadixTree (prefix cache) and speaks in request
ids and page ids; tree nodes never leave this module.

Reference counts: every holder owns one reference. A page held by the tree and by k requests has
count k + 1; a request's private page has count 1; a free page 0. A request holding tree pages
locks the deepest tree node it uses, so a page that any request holds is never evictable.

    request lifecycle:  match_prefix -> allocate_slots(prefix) -> [allocate_slots ->
                        cache_completed_pages]* -> free
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from banyan.errors import BanyanError, InvalidParameterError
from banyan.kv_cache.block_pool import BlockPool, KVCacheIntegrityError
from banyan.kv_cache.radix_tree import RadixTree, TreeNode

__all__ = ["CacheStats", "KVCacheIntegrityError", "KVCacheManager", "PrefixMatch", "StalePrefixError"]


class StalePrefixError(BanyanError, ValueError):
    """A PrefixMatch given to allocate_slots no longer describes cached pages (evicted since)."""


class PrefixMatch(NamedTuple):
    page_ids: list[int]
    num_tokens: int  # == len(page_ids) * page_size


class CacheStats(NamedTuple):
    num_pages: int
    num_free: int
    num_cached: int  # in the tree and held by no request
    num_in_use: int  # held by at least one request
    usage: float  # num_in_use / num_pages


@dataclass
class _Holding:
    """What one request holds: its page table, the tree node it locks, how many of its leading
    pages are settled (in the tree, or known duplicates of tree pages), and its namespace."""

    pages: list[int] = field(default_factory=list)
    node: TreeNode | None = None
    num_settled: int = 0
    namespace: Hashable = None
    namespace_known: bool = False


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._pool = BlockPool(num_pages)
        self._tree = RadixTree(page_size)
        self._held: dict[str, _Holding] = {}
        self.num_evicted_pages = 0  # evicted to make room, since start-up

    # -- queries (never mutate) ---------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], namespace: Hashable = None) -> PrefixMatch:
        """Longest cached page-aligned prefix of token_ids. Never mutates. Empty when caching is off."""
        if not self.enable_prefix_caching:
            return PrefixMatch([], 0)
        pages = self._tree.match(token_ids, namespace).pages
        return PrefixMatch(pages, len(pages) * self.page_size)

    def page_table(self, request_id: str) -> Sequence[int]:
        """The request's pages in token order (read-only view; empty for unknown ids)."""
        holding = self._held.get(request_id)
        return tuple(holding.pages) if holding else ()

    def pages_needed(self, request_id: str, num_tokens: int) -> int:
        """New pages allocate_slots(request_id, num_tokens) would take (excluding any prefix)."""
        holding = self._held.get(request_id)
        return max(0, self._num_pages_for(num_tokens) - (len(holding.pages) if holding else 0))

    def num_allocatable_pages(self) -> int:
        """Free pages plus cached pages eviction could release."""
        return self._pool.num_free + self._tree.num_evictable_pages

    def stats(self) -> CacheStats:
        # O(cached pages): cheap next to a forward pass, not meant for inner loops.
        num_cached = sum(1 for p in self._tree.cached_pages() if self._pool.ref_count(p) == 1)
        num_free = self._pool.num_free
        num_in_use = self.num_pages - num_free - num_cached
        return CacheStats(self.num_pages, num_free, num_cached, num_in_use, num_in_use / self.num_pages)

    def num_locked_pages(self) -> int:
        """Pages in the radix tree that some request holds (locked: never evictable while it does)."""
        return self._tree.num_cached_pages - self._tree.num_evictable_pages

    # -- mutations ----------------------------------------------------------------------------
    def allocate_slots(self, request_id: str, num_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        """Make the request hold pages for its first num_tokens tokens (ceil(num_tokens/page_size) pages).

        `prefix` is given only on a request's first allocation: its pages become the request's first
        pages (ref-counted and locked against eviction) before new pages are appended. When free
        pages run short, evicts unlocked cached pages (LRU). If it still cannot, it changes nothing
        and returns False. Raises StalePrefixError if the prefix's pages left the tree since
        match_prefix, InvalidParameterError if a prefix comes with a later allocation.
        """
        holding = self._held.get(request_id)
        if prefix is None and holding is not None and len(holding.pages) * self.page_size >= num_tokens:
            return True  # the usual decode step: its last page has room
        held = holding.pages if holding else []
        prefix_pages = list(prefix.page_ids) if prefix else []
        if prefix_pages and held:
            raise InvalidParameterError("prefix", f"request {request_id!r} already holds pages")
        node = self._prefix_node(prefix_pages)
        need = max(0, self._num_pages_for(num_tokens) - len(held) - len(prefix_pages))
        # Capacity is checked as if the prefix were locked, so a failed call leaves even the LRU order alone.
        # (Free pages alone usually suffice: the tree walk is skipped then, a decode step holds hundreds.)
        if need > self._pool.num_free and need > self._pool.num_free + self._tree.evictable_pages_if_locked(node):
            return False
        if holding is None or prefix_pages:
            holding = self._held[request_id] = self._take_prefix(prefix_pages, node)
        self._make_free(need)  # runs after the prefix is locked, so it cannot evict it
        holding.pages += self._pool.allocate(need)
        return True

    def cache_completed_pages(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int, namespace: Hashable = None
    ) -> None:
        """Insert the request's full pages covering token_ids[:num_computed_tokens] (page-aligned, rounded
        down) into the tree so later requests can reuse them.

        Idempotent: pages already in the tree are skipped; if the tree already holds the same tokens
        under other pages, the request keeps its own pages privately. No-op when caching is off or the
        request holds no pages. A request must keep one namespace (InvalidParameterError otherwise).

            token_ids: [ page 0 | page 1 | page 2 | page 3 (partial) ...
                       0        ps       2ps      3ps  ^ num_computed_tokens
            pages:     [  p0    ,  p1    ,  p2    ,  p3   ]
                       [<--- settled --->][ new ][ p3 stays private ]
                                          ^ num_settled      ^ num_full = num_computed // ps
        """
        holding = self._held.get(request_id)
        if not self.enable_prefix_caching or holding is None:
            return
        self._check_namespace(holding, namespace)
        num_full = min(num_computed_tokens // self.page_size, len(holding.pages), len(token_ids) // self.page_size)
        if num_full <= holding.num_settled:
            return
        key = token_ids[: num_full * self.page_size]
        present = self._tree.insert(key, holding.pages[:num_full], namespace)
        self._pool.incref(holding.pages[present:num_full])  # the tree's reference to what it took
        self._relock(holding, self._tree.match(key, namespace).node)
        holding.num_settled = num_full

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Return the request's pages past its first ceil(num_tokens / page_size) to the free list (speculation:
        pages only rejected drafts wrote). Such pages are private: the tree holds only computed, verified tokens,
        and settled pages are never given back. Returns how many pages were freed; unknown ids free nothing.

            pages:  [ p0 | p1 | p2 | p3 ]      num_tokens = 6, page_size = 4: keep p0, p1
                    [ verified ..  ^ rejected drafts ..]
        """
        holding = self._held.get(request_id)
        if holding is None:
            return 0
        keep = max(self._num_pages_for(num_tokens), holding.num_settled)
        extra = holding.pages[keep:]
        del holding.pages[keep:]
        self._pool.decref(extra)
        return len(extra)

    def free(self, request_id: str) -> None:
        """Release all the request's pages: private pages return to the free list; tree pages stay
        cached, unlocked, evictable once no request holds them. Unknown ids are ignored (idempotent)."""
        holding = self._held.pop(request_id, None)
        if holding is None:
            return
        if holding.node is not None:
            self._tree.unlock(holding.node)
        self._pool.decref(holding.pages)

    def reset_prefix_cache(self) -> bool:
        """Drop every unlocked cached page; returns False if some cached pages stay (held by requests)."""
        self._pool.decref(self._tree.evict(self._tree.num_evictable_pages))
        return self._tree.num_cached_pages == 0

    # -- invariants ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """free + cached + in_use == total; every page's ref count equals the number of its holders
        (requests + the tree); no page both free and held; locks consistent. Raises KVCacheIntegrityError."""
        self._pool.check_integrity()
        holders = self._count_holders()
        for page in range(self.num_pages):
            if self._pool.ref_count(page) != holders[page]:
                raise KVCacheIntegrityError(
                    f"page {page}: ref count {self._pool.ref_count(page)}, {holders[page]} holders"
                )
        self._tree.check_integrity(Counter(h.node for h in self._held.values() if h.node is not None))
        self._check_held_pages_locked()
        in_use = {p for h in self._held.values() for p in h.pages}
        cached = set(self._tree.cached_pages()) - in_use
        if self._pool.num_free + len(cached) + len(in_use) != self.num_pages:
            raise KVCacheIntegrityError(
                f"free {self._pool.num_free} + cached {len(cached)} + in use {len(in_use)} != {self.num_pages}"
            )
        if self.stats()[1:4] != (self._pool.num_free, len(cached), len(in_use)):
            raise KVCacheIntegrityError(f"stats {self.stats()} disagree with the holders")

    # -- internals ----------------------------------------------------------------------------
    def _num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _prefix_node(self, prefix_pages: list[int]) -> TreeNode | None:
        if not prefix_pages:
            return None
        node = self._tree.node_for_prefix(prefix_pages)
        if node is None:
            raise StalePrefixError(f"prefix pages {prefix_pages[:4]}... are no longer cached")
        return node

    def _take_prefix(self, prefix_pages: list[int], node: TreeNode | None) -> _Holding:
        holding = _Holding(pages=prefix_pages, num_settled=len(prefix_pages))
        if node is not None:
            self._tree.lock(node)
            self._pool.incref(prefix_pages)
            holding.node, holding.namespace, holding.namespace_known = node, node.namespace, True
        return holding

    def _make_free(self, need: int) -> None:
        """Evict until `need` pages are free (the caller checked that enough are evictable)."""
        short = need - self._pool.num_free
        if short <= 0:
            return
        released = self._tree.evict(short)
        self.num_evicted_pages += len(released)
        if len(self._pool.decref(released)) != len(released):
            raise KVCacheIntegrityError("an evicted page is still held by a request")

    def _relock(self, holding: _Holding, node: TreeNode | None) -> None:
        # Lock the new node before unlocking the old one: their shared ancestors never dip to 0.
        if node is not None:
            self._tree.lock(node)
        if holding.node is not None:
            self._tree.unlock(holding.node)
        holding.node = node

    def _check_namespace(self, holding: _Holding, namespace: Hashable) -> None:
        if holding.namespace_known and holding.namespace != namespace:
            raise InvalidParameterError(
                "namespace", f"request cached under {holding.namespace!r}, now given {namespace!r}"
            )
        holding.namespace, holding.namespace_known = namespace, True

    def _count_holders(self) -> Counter[int]:
        holders: Counter[int] = Counter(self._tree.cached_pages())
        for request_id, holding in self._held.items():
            if len(set(holding.pages)) != len(holding.pages):
                raise KVCacheIntegrityError(f"request {request_id!r} holds a page twice")
            holders.update(holding.pages)
        return holders

    def _check_held_pages_locked(self) -> None:
        """A page a request holds is never evictable: its tree node (if any) is locked."""
        for request_id, holding in self._held.items():
            for page in holding.pages:
                node = self._tree.node_of(page)
                if node is not None and node.lock_ref == 0:
                    raise KVCacheIntegrityError(f"request {request_id!r} holds evictable page {page}")
