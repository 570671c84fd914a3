"""Suffix decoding (the idea of Arctic Inference's suffix decoding): propose the most frequent continuation of
the longest suffix of the request's text seen before, in this request or in recent requests' outputs.

Two tries of the same kind, each holding every suffix of its sequences cut at max_depth tokens, with a count
per node (how often that path occurs):

    sequence  a b a c      suffixes cut at depth 2:  a b · b a · a c · c
    trie      root ─ a(2) ─ b(1)                 the path a b occurs once, a twice
                   │      └ c(1)
                   ├ b(1) ─ a(1)
                   └ c(1)

- per request: over its prompt + output, extended by the new tokens each step (O(max_depth) a token). Up to
  max_depth nodes a token, about 65 bytes each: an 8k-token prompt of distinct text is 190k nodes, 13 MB,
  indexed in 0.3 s on the first proposal (then about 45 us a step);
- shared: over the outputs of recently finished requests, least recently added evicted first, within
  max_cached_requests and max_cached_nodes (the memory bound: a node per distinct path). "Least recently
  added", not used: crediting a match to the requests whose outputs made it would need a set per node.

To propose: the longest suffix of the text (at most max_match tokens) that is a path with a continuation,
then the most frequent child, step by step, while the path's probability (product of child count / node count)
stays >= min_token_prob, for at most max_k and max_spec_factor * match length tokens: a long, frequent match
speculates far, a short or ambiguous one little or not at all. The trie whose path scores more expected
accepted tokens (the sum of those probabilities) wins.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from banyan.errors import InvalidParameterError
from banyan.spec.proposer import Proposer


class _Node:
    """A trie node and its children: none, one held inline (_token, _child), or a dict once there are two. Most
    nodes are on a path that occurred once and have one child: inline, a node costs a quarter of one with a dict."""

    __slots__ = ("count", "_token", "_child", "_more")

    def __init__(self):
        self.count = 0
        self._token = 0
        self._child: _Node | None = None
        self._more: dict[int, _Node] | None = None

    def get(self, token: int) -> _Node | None:
        if self._more is not None:
            return self._more.get(token)
        return self._child if self._token == token else None

    def add(self, token: int) -> _Node:
        child = _Node()
        if self._more is not None:
            self._more[token] = child
        elif self._child is None:
            self._token, self._child = token, child
        else:
            self._more, self._child = {self._token: self._child, token: child}, None
        return child

    def remove(self, token: int) -> None:
        if self._more is not None:
            del self._more[token]
        else:
            self._child = None

    def children(self) -> Iterable[tuple[int, _Node]]:
        if self._more is not None:
            return self._more.items()
        return () if self._child is None else ((self._token, self._child),)


class SuffixTrie:
    """Every suffix of the sequences added, cut at max_depth tokens; a node's count is how often its path occurs."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 1

    def extend(self, open_ends: list[tuple[_Node, int]], token: int) -> list[tuple[_Node, int]]:
        """Append `token` to a sequence whose suffixes shorter than max_depth end at `open_ends` (node, depth);
        returns the new open ends. A sequence starts with open_ends = []."""
        new_ends = []
        for node, depth in open_ends + [(self.root, 0)]:
            child = node.get(token)
            if child is None:
                child = node.add(token)
                self.num_nodes += 1
            child.count += 1
            if depth + 1 < self.max_depth:
                new_ends.append((child, depth + 1))
        return new_ends

    def add(self, tokens: Sequence[int]) -> None:
        open_ends: list[tuple[_Node, int]] = []
        for token in tokens:
            open_ends = self.extend(open_ends, token)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo add(tokens): one count less along each suffix's path; a node left at zero goes, with the rest
        of that path (a child never counts more than its parent, so nothing else hangs below it)."""
        for start in range(len(tokens)):
            path = tokens[start : start + self.max_depth]
            node = self.root
            for i, token in enumerate(path):
                child = node.get(token)
                child.count -= 1
                if child.count == 0:
                    node.remove(token)
                    self.num_nodes -= len(path) - i
                    break
                node = child

    def find(self, tokens: Sequence[int]) -> _Node | None:
        node = self.root
        for token in tokens:
            node = node.get(token)
            if node is None:
                return None
        return node

    def speculate(self, context: Sequence[int], max_k: int, max_match: int, max_spec_factor: float,
                  min_token_prob: float) -> tuple[list[int], float, int]:
        """(drafts, expected accepted tokens, length of the suffix matched) from the longest suffix of `context`
        with a continuation."""
        for m in range(min(max_match, len(context), self.max_depth - 1), 0, -1):
            node = self.find(context[len(context) - m :])
            if node is not None and any(node.children()):
                break
        else:
            return [], 0.0, 0
        drafts: list[int] = []
        prob, score = 1.0, 0.0
        limit = min(max_k, int(max_spec_factor * m), self.max_depth - m)
        while len(drafts) < limit and any(node.children()):
            token, child = max(node.children(), key=lambda item: item[1].count)  # first added wins ties
            prob *= child.count / node.count  # P(token | path), the path's own end counted as "no token"
            if prob < min_token_prob:
                break
            drafts.append(token)
            score += prob
            node = child
        return drafts, score, m


class _Local:
    """One request's trie over its prompt + output, and how far it has read.

    The trie is built on the first step whose last token occurred before (in this text, or as a path of the
    shared trie): until then no suffix can match anywhere, so nothing is proposed, and a request that never
    repeats itself (random text) costs a set insertion a token instead of max_depth trie nodes."""

    def __init__(self):
        self.trie: SuffixTrie | None = None
        self.open_ends: list[tuple[_Node, int]] = []
        self.num_indexed = 0
        self.seen: set[int] = set()  # while there is no trie: every token but the last


class SuffixProposer(Proposer):
    def __init__(self, max_depth: int = 24, max_match: int = 16, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, max_cached_requests: int = 1000, max_cached_nodes: int = 1 << 20):
        if not 1 <= max_match < max_depth:
            raise InvalidParameterError("max_match", f"must be in [1, max_depth={max_depth}), got {max_match}")
        self.max_depth, self.max_match = max_depth, max_match
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.max_cached_requests, self.max_cached_nodes = max_cached_requests, max_cached_nodes
        self.shared = SuffixTrie(max_depth)
        self._cached: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # request id -> output, oldest first
        self._local: dict[str, _Local] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], max_k: int) -> list[int]:
        return self.propose_with_evidence(request_id, token_ids, max_k)[0]

    def propose_with_evidence(self, request_id: str, token_ids: Sequence[int], max_k: int) -> tuple[list[int], int]:
        local = self._indexed(request_id, token_ids)
        if max_k <= 0 or local.trie is None:
            return [], 0
        options = (self.max_match, self.max_spec_factor, self.min_token_prob)
        own = local.trie.speculate(token_ids, max_k, *options)
        shared = self.shared.speculate(token_ids, max_k, *options)
        drafts, _, matched = max(own, shared, key=lambda option: option[1])
        return drafts, matched if drafts else 0

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """Drop the request's trie; remember its output in the shared trie, evicting the oldest outputs to
        stay within max_cached_requests and max_cached_nodes."""
        self._local.pop(request_id, None)
        if request_id in self._cached:  # the same id again (a retry): its newer output replaces the old
            self.shared.remove(self._cached.pop(request_id))
        if not output_token_ids or self.max_cached_requests == 0:
            return
        self._cached[request_id] = tuple(output_token_ids)
        self.shared.add(output_token_ids)
        while self._cached and (len(self._cached) > self.max_cached_requests
                                or self.shared.num_nodes > self.max_cached_nodes):
            _, evicted = self._cached.popitem(last=False)
            self.shared.remove(evicted)

    def _indexed(self, request_id: str, token_ids: Sequence[int]) -> _Local:
        local = self._local.get(request_id)
        if local is None or len(token_ids) < local.num_indexed:  # new, or rewound: (re)build
            local = self._local[request_id] = _Local()
        if local.trie is None:
            local.seen.update(token_ids[max(0, local.num_indexed - 1) : -1])
            local.num_indexed = len(token_ids)
            last = token_ids[-1] if token_ids else None
            if last not in local.seen and self.shared.root.get(last) is None:
                return local  # the last token is new everywhere: no suffix of the text can match yet
            local.trie, local.num_indexed, local.seen = SuffixTrie(self.max_depth), 0, set()
        for token in token_ids[local.num_indexed :]:
            local.open_ends = local.trie.extend(local.open_ends, token)
        local.num_indexed = len(token_ids)
        return local
