"""The shared-prefix wait, specified step by step: new requests that share a prefix nobody has cached yet compute it
once (banyan/scheduler/prefix.py). Pages of 4 tokens; the shared prefix is 3 pages (12 tokens), and a request waits
for as little as one page (shared_prefix_wait_tokens=4) unless a test says otherwise."""

from __future__ import annotations

import dataclasses

from banyan.request import RequestStatus
from banyan.scheduler import SampledToken, StepResult
from tests.unit import test_scheduler
from tests.unit.test_scheduler import make_request, run_to_end, step

PREFIX = list(range(500, 512))  # 3 pages, cached nowhere yet


def make_scheduler(prefix_wait_tokens=4, **kw):
    return test_scheduler.make_scheduler(prefix_wait_tokens=prefix_wait_tokens, **kw)


def add(scheduler, requests):
    for r in requests:
        scheduler.add_request(r)
    return requests


def computed_prompt_tokens(scheduler):
    """Prompt tokens computed at first admission (not taken from the cache)."""
    return scheduler.stats.prefix_query_tokens - scheduler.stats.prefix_hit_tokens


def test_requests_sharing_an_uncached_prefix_compute_it_once():
    s = make_scheduler()
    a, b, c = add(s, [make_request(prompt_len=15, prefix=PREFIX, arrival=float(i)) for i in range(3)])
    assert step(s) == {a.request_id: 15}  # b and c wait for a's pages
    assert step(s) == {a.request_id: 1, b.request_id: 3, c.request_id: 3}
    assert b.num_cached_tokens == c.num_cached_tokens == 12
    run_to_end(s)
    assert computed_prompt_tokens(s) == 15 + 3 + 3
    assert s.kv.stats().num_in_use == 0


def test_a_request_sharing_nothing_uncached_is_not_delayed():
    s = make_scheduler()
    leader, follower = add(s, [make_request(prompt_len=15, prefix=PREFIX, arrival=float(i)) for i in range(2)])
    other = make_request(prompt_len=15, arrival=2.0)  # no common prefix
    short = make_request(prompt_len=15, prefix=PREFIX[:3], arrival=3.0)  # less than a page in common
    salted = make_request(prompt_len=15, prefix=PREFIX, arrival=4.0)
    salted.cache_salt = "another tenant"  # the same tokens in another namespace share no pages
    add(s, [other, short, salted])
    assert set(step(s)) == {leader.request_id, other.request_id, short.request_id, salted.request_id}
    assert follower.status == RequestStatus.WAITING


def test_a_request_that_differs_inside_the_leaders_next_page_does_not_wait():
    """What it shares with the leader is cached already; the leader's next page is not its to reuse."""
    s = make_scheduler(max_num_batched_tokens=8)
    leader = add(s, [make_request(prompt_len=20, prefix=PREFIX, arrival=0.0)])[0]
    step(s)  # the leader's first 2 pages are cached
    diverging = add(s, [make_request(prompt_len=20, prefix=PREFIX[:10], arrival=1.0)])[0]
    s.config = dataclasses.replace(s.config, max_num_batched_tokens=64)
    assert set(step(s)) == {leader.request_id, diverging.request_id}
    assert diverging.num_cached_tokens == 8


def test_with_chunked_prefill_followers_wait_until_the_leader_is_past_the_shared_pages():
    s = make_scheduler(max_num_batched_tokens=8)
    leader, follower = add(s, [make_request(prompt_len=14, prefix=PREFIX, arrival=float(i)) for i in range(2)])
    assert step(s) == {leader.request_id: 8}  # pages 0-1
    assert step(s) == {leader.request_id: 6}  # page 2: the follower waits for it rather than use the 2 tokens left
    assert step(s) == {leader.request_id: 1, follower.request_id: 2}
    assert follower.num_cached_tokens == 12
    run_to_end(s)
    assert computed_prompt_tokens(s) == 14 + 2


def test_when_the_leader_is_aborted_the_next_in_line_leads_from_what_was_cached():
    s = make_scheduler(max_num_batched_tokens=10)
    leader, second, third = add(s, [make_request(prompt_len=14, prefix=PREFIX, arrival=float(i)) for i in range(3)])
    assert step(s) == {leader.request_id: 10}  # pages 0-1 cached, page 2 half computed
    s.finish_requests([leader.request_id], RequestStatus.FINISHED_ABORTED)
    assert step(s) == {second.request_id: 6}  # from the 2 cached pages; third waits for page 2 again
    assert second.num_cached_tokens == 8
    run_to_end(s)
    assert third.num_cached_tokens == 12 and third.finish_reason == second.finish_reason == "length"
    assert s.kv.stats().num_in_use == 0


def test_a_preempted_leader_holds_no_one_back_and_leads_again_when_readmitted():
    # 6 pages of 4 tokens: at step 3 the earlier request's decode needs a page while the leader is mid-prefill.
    s = make_scheduler(num_pages=6, max_num_batched_tokens=8)
    earlier = make_request(prompt_len=7, max_tokens=4, arrival=0.0)
    leader, follower = [make_request(prompt_len=14, prefix=PREFIX, max_tokens=2, arrival=1.0 + i) for i in range(2)]
    add(s, [earlier, leader, follower])
    assert [step(s) for _ in range(2)] == [{earlier.request_id: 7, leader.request_id: 1},
                                           {earlier.request_id: 1, leader.request_id: 7}]
    batch = s.schedule()
    assert batch.preempted == [leader] and [x.request for x in batch.scheduled] == [earlier]
    s.update(batch, StepResult(sampled={earlier.request_id: SampledToken(7, 0.0)}))
    step(s)  # the leader, first in line, finds no room until `earlier` ends; the follower waits behind it
    assert step(s) == {leader.request_id: 6}  # readmitted from its 2 cached pages: the follower waits for page 2
    assert step(s) == {leader.request_id: 1, follower.request_id: 2}
    assert follower.num_cached_tokens == 12 and leader.metrics.num_preemptions == 1
    run_to_end(s)
    assert s.kv.stats().num_in_use == 0


def test_priority_order_is_kept_among_requests_that_do_not_wait():
    s = make_scheduler(policy="priority", max_num_seqs=2)
    low = make_request(prompt_len=15, priority=5, arrival=0.0)
    leader = make_request(prompt_len=15, prefix=PREFIX, priority=1, arrival=1.0)
    follower = make_request(prompt_len=15, prefix=PREFIX, priority=1, arrival=2.0)
    add(s, [low, leader, follower])
    assert set(step(s)) == {leader.request_id, low.request_id}  # the follower waits; low takes the free seat
    run_to_end(s)
    assert follower.num_cached_tokens == 12


def test_switched_off_every_request_computes_the_prefix():
    s = make_scheduler(prefix_wait_tokens=0)
    requests = add(s, [make_request(prompt_len=15, prefix=PREFIX, arrival=float(i)) for i in range(3)])
    assert step(s) == {r.request_id: 15 for r in requests}
    run_to_end(s)
    assert computed_prompt_tokens(s) == 3 * 15


def test_a_request_waits_only_for_at_least_the_threshold_of_pages():
    """shared_prefix_wait_tokens=8 (2 pages): a request waits while the leader will compute 2 pages it can use."""
    s = make_scheduler(prefix_wait_tokens=8, max_num_batched_tokens=10)
    leader, follower = add(s, [make_request(prompt_len=14, prefix=PREFIX, arrival=float(i)) for i in range(2)])
    one_page = add(s, [make_request(prompt_len=14, prefix=PREFIX[:5], arrival=2.0)])[0]  # 1 page in common
    assert step(s) == {leader.request_id: 10}  # the follower waits (3 pages to come); one_page finds no budget
    # page 2 is the last shared page to come: less than 2, so the follower is admitted and computes it itself
    assert step(s) == {leader.request_id: 4, follower.request_id: 6}
    assert follower.num_cached_tokens == 8
    run_to_end(s)
    assert one_page.num_cached_tokens == 4 and s.kv.stats().num_in_use == 0


def test_the_default_threshold_is_32_tokens():
    s = test_scheduler.make_scheduler(page_size=4, max_num_batched_tokens=256)
    assert s.config.shared_prefix_wait_tokens == 32
    short = [make_request(prompt_len=15, prefix=PREFIX, arrival=float(i)) for i in range(2)]  # 12 in common
    long_prefix = list(range(600, 632))
    long = [make_request(prompt_len=40, prefix=long_prefix, arrival=2.0 + i) for i in range(2)]  # 32 in common
    add(s, short + long)
    assert set(step(s)) == {short[0].request_id, short[1].request_id, long[0].request_id}


def test_a_long_queue_of_followers_in_a_small_cache_never_stalls():
    """Every step runs something, requests get preempted, the queue drains, and no page leaks."""
    s = make_scheduler(num_pages=12, max_num_batched_tokens=8, max_num_seqs=4)
    add(s, [make_request(prompt_len=13 + i % 5, prefix=PREFIX[: 4 + 4 * (i % 3)], max_tokens=6, arrival=float(i))
            for i in range(12)])
    for _ in range(300):
        if not s.has_unfinished_requests():
            break
        batch = s.schedule()
        assert not batch.is_empty
        s.update(batch, StepResult(sampled={x.request.request_id: SampledToken(7, 0.0) for x in batch.scheduled
                                            if x.samples}))
        s.kv.check_integrity()
    assert not s.has_unfinished_requests() and s.kv.stats().num_in_use == 0
    assert s.stats.num_preemptions > 0 and s.stats.prefix_hit_tokens > 0
