"""RadixTree: page-aligned token prefixes -> the KV pages that hold them (prefix caching).

One root per namespace (cache salt, LoRA id, ...; None is the default), so no match ever crosses
namespaces. Each edge holds a key of whole pages and their page ids; children are keyed by the
tokens of their first page, so siblings never share one. With page_size 2:

    root[None] ─ (1,2, 3,4) [p7, p3] ┬─ (5,6) [p9]
                                     └─ (8,8, 9,9) [p1, p4]

Lock counts run up the parent chain: a node is locked while any node below it is. Eviction
takes unlocked leaves in LRU order, a leaf's last pages first. `match` never mutates; `lock`,
`unlock` and `insert` update access times. The tree stores ids only: the caller owns the pages'
reference counts.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import NamedTuple

from banyan.errors import InvalidParameterError
from banyan.kv_cache.block_pool import KVCacheIntegrityError


class TreeNode:
    __slots__ = ("key", "pages", "children", "parent", "namespace", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: TreeNode | None, namespace: Hashable):
        self.key = key  # len(key) == len(pages) * page_size
        self.pages = pages
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.namespace = namespace
        self.lock_ref = 0
        self.last_access = 0

    def chain(self) -> Iterator[TreeNode]:
        """This node and its ancestors, root excluded."""
        node = self
        while node.parent is not None:
            yield node
            node = node.parent


class MatchResult(NamedTuple):
    pages: list[int]
    node: TreeNode | None  # node holding pages[-1] (maybe only partly matched); None if nothing matched


class RadixTree:
    def __init__(self, page_size: int):
        if page_size <= 0:
            raise InvalidParameterError("page_size", f"must be positive, got {page_size}")
        self.page_size = page_size
        self._roots: dict[Hashable, TreeNode] = {}
        self._node_of: dict[int, TreeNode] = {}  # page id -> the node holding it
        self._num_evictable = 0
        self._clock = itertools.count(1)  # logical time: deterministic LRU order

    @property
    def num_cached_pages(self) -> int:
        return len(self._node_of)

    @property
    def num_evictable_pages(self) -> int:
        """Pages in unlocked nodes: all of them can be evicted, leaves first."""
        return self._num_evictable

    def cached_pages(self) -> Iterator[int]:
        return iter(self._node_of)

    def node_of(self, page: int) -> TreeNode | None:
        return self._node_of.get(page)

    # -- lookup -------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], namespace: Hashable = None) -> MatchResult:
        """Longest cached prefix of tokens made of whole pages. Never mutates."""
        root = self._roots.get(namespace)
        if root is None:
            return MatchResult([], None)
        key = self._page_aligned(tokens)
        node, pages, matched = root, [], 0
        while matched < len(key):
            child = node.children.get(key[matched : matched + self.page_size])
            if child is None:
                break
            m = self._common_pages(child.key, key, matched)
            pages += child.pages[:m]
            node, matched = child, matched + m * self.page_size
            if m < len(child.pages):
                break
        return MatchResult(pages, node if pages else None)

    def node_for_prefix(self, pages: Sequence[int]) -> TreeNode | None:
        """The node holding pages[-1], if `pages` is still exactly a root path's leading pages."""
        node = self._node_of.get(pages[-1]) if pages else None
        if node is None:
            return None
        path = [p for n in reversed(list(node.chain())) for p in n.pages]
        return node if path[: len(pages)] == list(pages) else None

    def evictable_pages_if_locked(self, node: TreeNode | None) -> int:
        """num_evictable_pages after lock(node), computed without locking."""
        chain = node.chain() if node is not None else ()
        return self._num_evictable - sum(len(n.pages) for n in chain if n.lock_ref == 0)

    # -- mutation -----------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int], namespace: Hashable = None) -> int:
        """Cache pages[i] as the KV of the i-th page of tokens; returns how many leading pages were
        already present (under these or other page ids). Only pages[that:] enter the tree; the
        caller keeps its duplicates of the leading ones."""
        ps = self.page_size
        if len(tokens) < len(pages) * ps:
            raise InvalidParameterError("tokens", f"{len(tokens)} tokens cannot fill {len(pages)} pages")
        if not pages:
            return 0
        key = tuple(tokens[: len(pages) * ps])
        node = self._roots.get(namespace) or self._new_root(namespace)
        now, done = next(self._clock), 0
        while done < len(pages):
            child = node.children.get(key[done * ps : (done + 1) * ps])
            if child is None:
                break
            m = self._common_pages(child.key, key, done * ps)
            if m < len(child.pages):
                child = self._split(child, m)
            child.last_access = now
            node, done = child, done + m
        if done < len(pages):
            self._add_leaf(node, key[done * ps :], list(pages[done:]), now)
        return done

    def lock(self, node: TreeNode) -> None:
        """Protect node and its ancestors from eviction (counted: unlock once per lock)."""
        now = next(self._clock)
        for n in node.chain():
            if n.lock_ref == 0:
                self._num_evictable -= len(n.pages)
            n.lock_ref += 1
            n.last_access = now

    def unlock(self, node: TreeNode) -> None:
        if node.lock_ref <= 0:
            raise KVCacheIntegrityError("unlock of a node that is not locked")
        now = next(self._clock)
        for n in node.chain():
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._num_evictable += len(n.pages)
            n.last_access = now  # releasing is a use too: freshly released prefixes go last

    def evict(self, num_pages: int) -> list[int]:
        """Drop up to num_pages pages from unlocked leaves, least recently used first, and return
        their ids; the caller gets them back (drops the tree's references)."""
        tiebreak = itertools.count()
        # Collecting the leaves is O(nodes) per call: eviction is rare next to matching.
        heap = [(n.last_access, next(tiebreak), n) for n in self._nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(heap)
        released: list[int] = []
        while heap and len(released) < num_pages:
            _, _, leaf = heapq.heappop(heap)
            released += self._drop_tail(leaf, min(len(leaf.pages), num_pages - len(released)))
            parent = leaf.parent
            if not leaf.pages and self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, next(tiebreak), parent))
        return released

    # -- internals ----------------------------------------------------------------------------
    def _page_aligned(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(tokens[: len(tokens) // self.page_size * self.page_size])

    def _common_pages(self, node_key: tuple[int, ...], key: tuple[int, ...], start: int) -> int:
        """Whole pages on which node_key agrees with key[start:]: page by page, each one tuple compare."""
        ps = self.page_size
        limit = min(len(node_key), len(key) - start) // ps
        if node_key[: limit * ps] == key[start : start + limit * ps]:
            return limit  # the usual case: the whole node matches
        m = 0
        while node_key[m * ps : (m + 1) * ps] == key[start + m * ps : start + (m + 1) * ps]:
            m += 1
        return m

    def _new_root(self, namespace: Hashable) -> TreeNode:
        root = self._roots[namespace] = TreeNode((), [], None, namespace)
        return root

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], pages: list[int], now: int) -> None:
        for page in pages:
            if page in self._node_of:
                raise KVCacheIntegrityError(f"page {page} inserted twice")
        leaf = TreeNode(key, pages, parent, parent.namespace)
        leaf.last_access = now
        parent.children[key[: self.page_size]] = leaf
        self._node_of.update(dict.fromkeys(pages, leaf))
        self._num_evictable += len(pages)

    def _split(self, node: TreeNode, m: int) -> TreeNode:
        """Cut node after its m-th page; returns the new upper half.

            parent ─ node(k0 k1 k2 | p0 p1 p2)          m = 1
        ->  parent ─ head(k0 | p0) ─ node(k1 k2 | p1 p2)

        `node` stays the lower half, so locks held on it stay valid; head inherits its lock count.
        """
        cut = m * self.page_size
        head = TreeNode(node.key[:cut], node.pages[:m], node.parent, node.namespace)
        head.lock_ref, head.last_access = node.lock_ref, node.last_access
        node.parent.children[node.key[: self.page_size]] = head
        node.key, node.pages, node.parent = node.key[cut:], node.pages[m:], head
        head.children[node.key[: self.page_size]] = node
        self._node_of.update(dict.fromkeys(head.pages, head))
        return head

    def _drop_tail(self, leaf: TreeNode, k: int) -> list[int]:
        """Remove the last k pages of an unlocked leaf; the whole leaf (and an emptied root) when
        k covers it.

            key:   [ page 0 | page 1 | ... | page n-k | ... | page n-1 ]
                   [<------ kept: n-k pages ------>][<-- dropped: k -->]
        """
        keep = len(leaf.pages) - k
        dropped = leaf.pages[keep:]
        if keep == 0:
            parent = leaf.parent
            del parent.children[leaf.key[: self.page_size]]
            if parent.parent is None and not parent.children:
                del self._roots[parent.namespace]
        leaf.key, leaf.pages = leaf.key[: keep * self.page_size], leaf.pages[:keep]
        for page in dropped:
            del self._node_of[page]
        self._num_evictable -= k
        return dropped

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return node.parent is not None and not node.children and node.lock_ref == 0

    def _nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # -- invariants ---------------------------------------------------------------------------
    def check_integrity(self, direct_locks: Mapping[TreeNode, int]) -> None:
        """Shapes, the page map and the counters agree; each node's lock count equals the locks
        taken on it directly (`direct_locks`, from the callers) plus its children's counts."""
        num_pages = num_unlocked = 0
        for root in self._roots.values():
            if root.key or root.pages or root.lock_ref:
                raise KVCacheIntegrityError(f"root of namespace {root.namespace!r} holds pages or locks")
        for node in self._nodes():
            self._check_node(node, direct_locks)
            num_pages += len(node.pages)
            num_unlocked += len(node.pages) if node.lock_ref == 0 else 0
        if num_pages != len(self._node_of):
            raise KVCacheIntegrityError(f"tree holds {num_pages} pages, page map {len(self._node_of)}")
        if num_unlocked != self._num_evictable:
            raise KVCacheIntegrityError(f"{num_unlocked} unlocked pages, counter says {self._num_evictable}")

    def _check_node(self, node: TreeNode, direct_locks: Mapping[TreeNode, int]) -> None:
        parent = node.parent
        if not node.pages or len(node.key) != len(node.pages) * self.page_size:
            raise KVCacheIntegrityError(f"node key of {len(node.key)} tokens for {len(node.pages)} pages")
        if parent.children.get(node.key[: self.page_size]) is not node or node.namespace != parent.namespace:
            raise KVCacheIntegrityError("node is not its parent's child under its first page")
        if any(self._node_of.get(page) is not node for page in node.pages):
            raise KVCacheIntegrityError(f"page map disagrees for pages {node.pages}")
        expected = direct_locks.get(node, 0) + sum(c.lock_ref for c in node.children.values())
        if node.lock_ref != expected:
            raise KVCacheIntegrityError(f"lock count {node.lock_ref}, holders account for {expected}")
