"""Which data-parallel replica serves a request: round_robin, least_load, or cache_aware (SGLang's router idea).

cache_aware keeps, per replica, an approximate radix tree of the prompts it routed there (page-aligned token
chunks, under the request's cache namespace, as the engines' own trees). For each request:

    1. load unbalanced (max - min in-flight > BALANCE_ABS and max > BALANCE_REL * min)  -> least loaded replica
    2. else the replica whose tree matches the longest prefix, if it covers >= CACHE_THRESHOLD of the prompt
    3. else the replica whose tree is smallest (the most room), the less loaded on a tie
    then the prompt's pages are inserted into the chosen replica's tree.

The trees are approximate: a replica evicts pages the router cannot see. Each replica reports the pages it
evicted (EngineStats.num_evicted_pages); the router evicts as many from that replica's tree, least recently
routed first, as the engine does, and never holds more pages for a replica than its cache has.
Torch-free: the API server runs it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

BALANCE_ABS = 8  # requests
BALANCE_REL = 1.5
CACHE_THRESHOLD = 0.3


class _Node:
    __slots__ = ("children", "parent", "key", "last_used")

    def __init__(self, parent: _Node | None = None, key: tuple = ()):
        self.children: dict[tuple, _Node] = {}
        self.parent, self.key, self.last_used = parent, key, 0


class PrefixTree:
    """Page-aligned prompts routed to one replica, per namespace; a node is one page of tokens."""

    def __init__(self, page_size: int, capacity_pages: int):
        self.page_size, self.capacity = page_size, capacity_pages
        self.roots: dict[object, _Node] = {}
        self.num_pages = 0
        self._clock = itertools.count(1)

    def _pages(self, tokens: Sequence[int]) -> list[tuple]:
        P = self.page_size
        return [tuple(tokens[i : i + P]) for i in range(0, len(tokens) - P + 1, P)]

    def match(self, namespace: object, tokens: Sequence[int]) -> int:
        """Tokens of the longest routed prefix of `tokens` (whole pages). Changes nothing."""
        node, matched = self.roots.get(namespace), 0
        for page in self._pages(tokens):
            node = node.children.get(page) if node is not None else None
            if node is None:
                break
            matched += self.page_size
        return matched

    def insert(self, namespace: object, tokens: Sequence[int]) -> None:
        """Record `tokens` (whole pages) as routed here now; the least recently routed pages go past capacity."""
        node = self.roots.setdefault(namespace, _Node())
        now = next(self._clock)
        for page in self._pages(tokens):
            child = node.children.get(page)
            if child is None:
                child = node.children[page] = _Node(node, page)
                self.num_pages += 1
            child.last_used = now
            node = child
        if self.num_pages > self.capacity:
            self.evict(self.num_pages - self.capacity)

    def evict(self, num_pages: int) -> None:
        """Drop `num_pages` leaf pages, least recently routed first (a parent becomes a leaf in turn)."""
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(leaves)
        while num_pages > 0 and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.key]
            self.num_pages -= 1
            num_pages -= 1
            if not parent.children and parent.parent is not None:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))

    def _nodes(self):
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


@dataclass
class RouterStats:
    """Prompt tokens routed, and of those the tokens the chosen replica's tree matched (the router's hit rate)."""

    routed_tokens: int = 0
    matched_tokens: int = 0
    per_replica: list[int] = field(default_factory=list)  # requests routed to each replica

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.routed_tokens if self.routed_tokens else 0.0


class Router:
    """Picks a replica for each request among those alive; `policy`: cache_aware, round_robin or least_load."""

    def __init__(self, policy: str, num_replicas: int, page_size: int, capacity_pages: int):
        self.policy = policy
        self.trees = [PrefixTree(page_size, capacity_pages) for _ in range(num_replicas)]
        self.stats = RouterStats(per_replica=[0] * num_replicas)
        self._next = itertools.count()
        self._evicted = [0] * num_replicas  # each replica's eviction counter as last reported

    def choose(self, namespace: object, tokens: Sequence[int], loads: Sequence[int], alive: Sequence[bool]) -> int:
        """The replica for this prompt; `loads`: each replica's requests in flight. Records the routing."""
        candidates = [r for r, ok in enumerate(alive) if ok]
        if not candidates:
            raise ValueError("no replica is alive")
        if self.policy == "round_robin":
            replica = candidates[next(self._next) % len(candidates)]
        elif self.policy == "least_load":
            replica = min(candidates, key=lambda r: (loads[r], r))
        else:
            replica = self._cache_aware(namespace, tokens, loads, candidates)
        self.stats.routed_tokens += len(tokens)
        self.stats.matched_tokens += self.trees[replica].match(namespace, tokens)
        self.stats.per_replica[replica] += 1
        self.trees[replica].insert(namespace, tokens)
        return replica

    def _cache_aware(self, namespace: object, tokens: Sequence[int], loads: Sequence[int], candidates: list[int]) -> int:
        low, high = min(loads[r] for r in candidates), max(loads[r] for r in candidates)
        least_loaded = min(candidates, key=lambda r: (loads[r], r))
        if high - low > BALANCE_ABS and high > BALANCE_REL * low:
            return least_loaded
        matched = {r: self.trees[r].match(namespace, tokens) for r in candidates}
        best = max(candidates, key=lambda r: (matched[r], -loads[r]))
        if matched[best] and matched[best] >= CACHE_THRESHOLD * len(tokens):
            return best
        return min(candidates, key=lambda r: (self.trees[r].num_pages, loads[r], r))

    def observe_evictions(self, replica: int, num_evicted_pages: int) -> None:
        """A replica's eviction counter (since its start): the pages evicted since the last report leave its tree."""
        grown = num_evicted_pages - self._evicted[replica]
        self._evicted[replica] = num_evicted_pages
        if grown > 0:
            self.trees[replica].evict(grown)

    def forget(self, replica: int) -> None:
        """A replica that restarted (or died) holds nothing any more."""
        tree = self.trees[replica]
        self.trees[replica] = PrefixTree(tree.page_size, tree.capacity)
        self._evicted[replica] = 0
