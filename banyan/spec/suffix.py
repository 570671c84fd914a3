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

To propose: the longest suffix of the text (at most max_match tokens) that is a path with a continuation (in the
request's trie, read off the nodes its last token reached; in the shared trie, a galloping search), then the most
frequent child, step by step, while the path's probability (product of child count / node count) stays >=
min_token_prob, for at most max_k and max_spec_factor * match length tokens: a long, frequent match speculates
far, a short or ambiguous one little or not at all. The trie whose path scores more expected accepted tokens (the
sum of those probabilities) wins.
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

    def has_children(self) -> bool:
        return bool(self._more) or self._child is not None  # a dict emptied by remove() stays

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

    def longest_match(self, context: Sequence[int], max_match: int) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context` (at most max_match tokens) that is a path with a continuation,
        and its length; (None, 0) if there is none. Galloping, then bisecting: if a suffix is followed by a token
        somewhere, so is each shorter suffix (the paths are every substring of the sequences added, up to max_depth
        tokens), so a few walks from the root find it where trying each length from the longest down took max_match."""
        def continued(m: int) -> _Node | None:
            node = self.find(context[len(context) - m :])
            return node if node is not None and node.has_children() else None

        limit = min(max_match, len(context), self.max_depth - 1)
        found, m, miss = None, 0, limit + 1  # continued(m) holds (m = 0: nothing yet), continued(miss) does not
        probe = 1
        while probe <= limit and m < limit:  # 1, 2, 4, ... then limit
            node = continued(probe)
            if node is None:
                miss = probe
                break
            found, m, probe = node, probe, min(2 * probe, limit)
        while miss - m > 1:
            mid = (m + miss) // 2
            node = continued(mid)
            if node is None:
                miss = mid
            else:
                found, m = node, mid
        return found, m

    def speculate(self, match: tuple[_Node | None, int], max_k: int, max_spec_factor: float,
                  min_token_prob: float) -> tuple[list[int], float, int]:
        """(drafts, expected accepted tokens, length of the suffix matched) from `match` (longest_match's)."""
        node, m = match
        if node is None:
            return [], 0.0, 0
        drafts: list[int] = []
        prob, score = 1.0, 0.0
        limit = min(max_k, int(max_spec_factor * m), self.max_depth - m)
        while len(drafts) < limit and node.has_children():
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

    The trie is built on the first step whose last two tokens occurred together before in the text, with a token
    after them. Until then a match in the text is at most the last token, and that is answered from where each token
    occurs (`positions`): a request that never repeats two tokens in a row (random text, sampled) costs a list
    append a token instead of max_depth trie nodes (a 16-stream run of 128-token random prompts spent 2% of its time
    building tries that were only ever asked about one-token matches)."""

    def __init__(self):
        self.trie: SuffixTrie | None = None
        self.open_ends: list[tuple[_Node, int]] = []
        self.num_indexed = 0
        self.positions: dict[int, list[int]] = {}  # while there is no trie: token -> where it occurs, in order

    def longest_match(self, max_match: int) -> tuple[_Node | None, int]:
        """SuffixTrie.longest_match over this request's own text, read off the open ends (the nodes of the text's
        suffixes, deepest first) without a walk from the root."""
        found, m = None, 0
        for node, depth in reversed(self.open_ends):
            if depth > max_match or not node.has_children():
                break
            found, m = node, depth
        return found, m


def speculate_one_token_match(text: Sequence[int], occurrences: list[int], max_k: int, max_spec_factor: float,
                              min_token_prob: float, max_depth: int) -> tuple[list[int], float, int]:
    """SuffixTrie.speculate for a match of the text's last token alone, from the positions where it occurs in the text
    (`occurrences`, ascending, the last one at the end) instead of a trie: the same drafts and score. A path's count is
    how many of its occurrences fit in the text; its children are what follows those, first occurring first."""
    starts, drafts, prob, score = occurrences, [], 1.0, 0.0
    limit = min(max_k, int(max_spec_factor), max_depth - 1)
    while len(drafts) < limit:
        after = len(drafts) + 1  # the next token's offset from an occurrence's start
        follows: dict[int, list[int]] = {}
        for start in starts:
            if start + after < len(text):
                follows.setdefault(text[start + after], []).append(start)
        if not follows:
            break
        token, continued = max(follows.items(), key=lambda item: len(item[1]))  # first occurring wins ties
        prob *= len(continued) / len(starts)
        if prob < min_token_prob:
            break
        drafts.append(token)
        score += prob
        starts = continued
    return drafts, score, 1


class SuffixProposer(Proposer):
    def __init__(self, max_depth: int = 24, max_match: int | None = None, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, max_cached_requests: int = 1000, max_cached_nodes: int = 1 << 20):
        """max_match: the longest suffix of the text matched (default 16, less one than a shallower max_depth)."""
        max_match = min(16, max_depth - 1) if max_match is None else max_match
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
        if max_k <= 0:
            return [], 0
        options = (max_k, self.max_spec_factor, self.min_token_prob)
        if local.trie is not None:
            own = local.trie.speculate(local.longest_match(self.max_match), *options)
        elif token_ids and len(occurrences := local.positions.get(token_ids[-1], ())) > 1:
            own = speculate_one_token_match(token_ids, occurrences, *options, self.max_depth)
        else:
            own = [], 0.0, 0
        shared = self.shared.speculate(self.shared.longest_match(token_ids, self.max_match), *options)
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
            positions = local.positions
            for i in range(local.num_indexed, len(token_ids)):
                positions.setdefault(token_ids[i], []).append(i)
            local.num_indexed = len(token_ids)
            if not _two_tokens_repeat(token_ids, positions):
                return local
            local.trie, local.num_indexed, local.positions = SuffixTrie(self.max_depth), 0, {}
        for token in token_ids[local.num_indexed :]:
            local.open_ends = local.trie.extend(local.open_ends, token)
        local.num_indexed = len(token_ids)
        return local


def _two_tokens_repeat(text: Sequence[int], positions: dict[int, list[int]]) -> bool:
    """Whether the text's last two tokens occurred together earlier, followed by a token."""
    if len(text) < 2:
        return False
    before = text[-2]
    return any(start > 0 and text[start - 1] == before for start in positions[text[-1]][:-1])
