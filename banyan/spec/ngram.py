"""Prompt lookup (n-gram) proposer: find the request's last n tokens earlier in its own history and propose
what followed them there. No model.

Per request an index maps every n-gram (n in [prompt_lookup_min, prompt_lookup_max]) to the end of its latest
occurrence that has a token after it; each new token adds one entry per n, so a step costs O(n_max^2) whatever
the history's length, and a prompt is indexed once, in O(len * n_max^2).

    tokens    a b c d x y a b c d
    index     (c, d) -> 4  ((c, d) ends at position 4 and x follows; the last (c, d) is not indexed: nothing
                            follows it yet)
    propose   longest n first: the last n tokens (c, d) -> end 4 -> drafts x y a b ... (up to max_k)

An n-gram followed by different tokens in different places is a vote: the drafts continue the latest occurrence
of the token that followed it most often, the first to reach that count on a tie (kept as each occurrence is
indexed: O(1); only n-grams seen twice hold a vote). In input-grounded work the text being rewritten comes first, so
on a tie its continuation wins over a later one in the model's own output. Replayed on recorded greedy outputs
(banyan/bench/spec_replay.py, default model, 2-vCPU Zen 3) this took batch-1 code edits 1.68x -> 1.72x and 1.76x ->
1.81x and rewrites 1.92x -> 1.95x and 2.02x -> 2.07x of the decode, against the latest occurrence ("recent text
predicts best"); ties broken toward the latest gained nothing. Where a model's output loops and the loop shifts (a
tiny random model's) the latest occurrence follows the shift sooner: 1.45x against the vote's 1.41x.

Drafts may run past the history's end: the continuation of position e is taken to repeat with period len - e, so a
repeated pattern (a a a a, or a b a b) proposes max_k tokens and not only what is left before the end.
Keys are hashes of n-gram tuples (smaller than the tuples); a lookup checks the tokens, so a collision costs a
missed proposal, never a wrong one.
"""

from __future__ import annotations

from collections.abc import Sequence

from banyan.errors import InvalidParameterError
from banyan.spec.proposer import Proposer


class _History:
    """One request's n-gram index: hash(n-gram) -> end of its latest occurrence with a token after it, and for an
    n-gram seen more than once the vote of what followed it."""

    def __init__(self):
        self.ends: dict[int, int] = {}
        self.votes: dict[int, dict[int, list[int]]] = {}  # repeated n-grams: following token -> [count, latest end]
        self.best: dict[int, int] = {}  # repeated n-grams: the following token that leads the vote
        self.num_indexed = 0  # n-grams ending before this position are in `ends`

    def add(self, key: int, end: int, token_ids: Sequence[int]) -> None:
        """The n-gram hashed to `key` ends at `end`, followed by token_ids[end]."""
        previous = self.ends.get(key)
        self.ends[key] = end
        if previous is None:
            return
        votes = self.votes.get(key)
        if votes is None:  # its second occurrence: the vote starts with the first
            first = token_ids[previous]
            votes = self.votes[key] = {first: [1, previous]}
            self.best[key] = first
        follower = token_ids[end]
        entry = votes.setdefault(follower, [0, end])
        entry[0] += 1
        entry[1] = end
        if entry[0] > votes[self.best[key]][0]:
            self.best[key] = follower

    def source(self, key: int) -> int | None:
        """Where the drafts for this n-gram come from: the end of the latest occurrence followed by the vote's
        leader (the only occurrence, for an n-gram seen once); None if it was never seen."""
        votes = self.votes.get(key)
        return self.ends.get(key) if votes is None else votes[self.best[key]][1]


class NgramProposer(Proposer):
    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 5):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise InvalidParameterError(
                "prompt_lookup_min", f"must be in [1, prompt_lookup_max={prompt_lookup_max}], got {prompt_lookup_min}")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self._histories: dict[str, _History] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], max_k: int) -> list[int]:
        return self.propose_with_evidence(request_id, token_ids, max_k)[0]

    def propose_with_evidence(self, request_id: str, token_ids: Sequence[int], max_k: int) -> tuple[list[int], int]:
        history = self._indexed(request_id, token_ids)
        length = len(token_ids)
        if max_k <= 0:
            return [], 0
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            key = tuple(token_ids[length - n :])
            end = history.source(hash(key))
            if end is not None and tuple(token_ids[end - n : end]) == key:
                return _continuation(token_ids, end, max_k), _match_length(token_ids, end, n)
        return [], 0

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        self._histories.pop(request_id, None)

    def _indexed(self, request_id: str, token_ids: Sequence[int]) -> _History:
        """The request's index, extended to every n-gram that has a token after it in token_ids."""
        history = self._histories.get(request_id)
        if history is None or len(token_ids) < history.num_indexed:  # new, or rewound: (re)build
            history = self._histories[request_id] = _History()
        #   n-gram [end - n, end) is indexed once token `end` exists: end < len(token_ids)
        for end in range(max(history.num_indexed, self.min_n), len(token_ids)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                history.add(hash(tuple(token_ids[end - n : end])), end, token_ids)
        history.num_indexed = max(history.num_indexed, len(token_ids))
        return history


MAX_EVIDENCE = 64
"""How far back a match is measured: past a few dozen tokens it predicts no better."""


def _match_length(token_ids: Sequence[int], end: int, n: int) -> int:
    """How many tokens before position `end` equal those before the text's end (at least the n looked up)."""
    length = len(token_ids)
    while n < min(end, MAX_EVIDENCE) and token_ids[end - n - 1] == token_ids[length - n - 1]:
        n += 1
    return n


def _continuation(token_ids: Sequence[int], end: int, max_k: int) -> list[int]:
    """max_k tokens following position `end`: token_ids[end:], continued with period len - end past the end."""
    length = len(token_ids)
    drafts: list[int] = []
    for j in range(max_k):
        drafts.append(token_ids[end + j] if end + j < length else drafts[end + j - length])
    return drafts

