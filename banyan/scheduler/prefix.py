"""What the prefix cache may serve a request, and the shared-prefix wait: new requests that share a prefix nobody
has cached yet compute it once.

The radix tree serves only pages already computed, and a running prefill inserts each full page the step after
it computes it (`Scheduler.update`). So N new prompts that share a system prompt, admitted in one step, would each
compute it. Instead the first one admitted (the leader) computes it, and a waiting request to which the leader is
about to give at least m pages of its prompt (m: `shared_prefix_wait_tokens` in whole pages) waits in the queue;
once the leader's prefill has moved past what they share, those pages are in the tree and the request starts
from its cache hit, computing only what is its own.

    leader:   [ computed: cached | page k .. page k+m-1 (not yet computed) | ... ]
    waits:    [ the same tokens through page k+m-1 ................ ]    the leader will cache m pages it can use
    admitted: [ the same tokens ...... | other tokens before page k+m ]  the leader would give it fewer: no wait

A leader is a running request still computing its prompt, or one admitted earlier in the same step, in the same
cache namespace. A request waits only while a leader is about to compute pages it shares, so it never waits for
pages that will not come: a leader that is preempted, aborted or finished leaves the running list and holds no one
back; the next request in line then becomes the leader, from whatever of the prefix was already cached. A request
that shares less than m uncached pages with every leader is admitted as before, in policy order.
"""

from __future__ import annotations

from collections.abc import Hashable

from banyan.request import Request


class PrefixLeaders:
    """The requests computing a prompt this step, found by their first page (and namespace)."""

    def __init__(self, page_size: int, min_tokens: int):
        self.page_size = page_size
        self.min_pages = max(1, -(-min_tokens // page_size))  # m: pages a wait must save at least
        self._by_first_page: dict[tuple[Hashable, tuple[int, ...]], list[Request]] = {}

    def add(self, request: Request, namespace: Hashable) -> None:
        """The request computes its prompt this step (or is running and will): it may lead others."""
        tokens = request.all_token_ids
        if len(tokens) >= self.page_size:  # less than a page: it caches nothing another request could reuse
            self._by_first_page.setdefault((namespace, tuple(tokens[: self.page_size])), []).append(request)

    def leader_of(self, request: Request, namespace: Hashable, matchable: int) -> Request | None:
        """A leader about to cache m pages of request.all_token_ids[:matchable] that are not cached yet, else None.

            leader:   [ p0 | p1 | p2 (computing) | p3 | p4 ... ]   k = num_computed_tokens // page_size = 2
            request:  [ p0 | p1 | p2 | p3 | ...                ]   m = 2: the same tokens through
                                                                   end = (k + m) * page_size
        """
        tokens, ps = request.all_token_ids, self.page_size
        for leader in self._by_first_page.get((namespace, tuple(tokens[:ps])), ()):
            end = (leader.num_computed_tokens // ps + self.min_pages) * ps
            if end <= matchable and end <= leader.num_tokens and tokens[:end] == leader.all_token_ids[:end]:
                return leader
        return None


def matchable_tokens(request: Request) -> int:
    """How many of the request's leading tokens the prefix cache may serve."""
    if request.pools_every_token:  # a mean-pooled embedding reads every position's hidden state: cached have none
        return 0
    limit = request.num_tokens - 1  # never the whole sequence: the last token must run to produce logits
    if request.prompt_logprobs is not None:
        # Token i's log-probability comes from position i - 1's logits, and cached positions have none:
        # the cache may serve only what lies before the first position still wanted.
        wanted = max(request.sampling_params.prompt_logprobs_start, len(request.prompt_logprobs))
        limit = min(limit, wanted - 1)
    return max(limit, 0)
