"""The scheduler, specified step by step with a model stand-in that always samples token 7."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from banyan.config import SchedulerConfig
from banyan.errors import CacheCapacityError
from banyan.kv_cache import KVCacheManager
from banyan.request import Request, RequestStatus
from banyan.sampling_params import SamplingParams
from banyan.scheduler import SampledToken, Scheduler, StepResult
from banyan.structured import GrammarMatcher

NEXT_TOKEN = 7


def make_scheduler(page_size=4, num_pages=64, max_num_batched_tokens=64, max_num_seqs=16, policy="fcfs", max_model_len=256, prefix_caching=True, jump_forward=True, prefix_wait_tokens=32):
    kv = KVCacheManager(num_pages, page_size, enable_prefix_caching=prefix_caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, policy=policy,
                             enable_jump_forward=jump_forward, shared_prefix_wait_tokens=prefix_wait_tokens)
    return Scheduler(config, kv, max_model_len)


_ids = iter(range(10**9))


def make_request(prompt_len=10, max_tokens=4, prefix=(), priority=0, arrival=None, eos=(), **params):
    prompt = list(prefix) + [100 + (next(_ids) % 1000) for _ in range(prompt_len - len(prefix))]
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(f"r{next(_ids)}", prompt, sp, eos_token_ids=eos, max_tokens=max_tokens, priority=priority, arrival_time=arrival)


def make_requests(n, prompt_len=10, shared_prefix=(), **kw):
    return [make_request(prompt_len, prefix=shared_prefix, arrival=float(i), **kw) for i in range(n)]


def step(scheduler, token=NEXT_TOKEN):
    """One schedule + update with the stand-in model; returns {request_id: tokens scheduled}."""
    batch = scheduler.schedule()
    result = StepResult(sampled={s.request.request_id: SampledToken(token, -0.5) for s in batch.scheduled if s.samples})
    scheduler.update(batch, result)
    scheduler.kv.check_integrity()
    return {s.request.request_id: s.num_new_tokens for s in batch.scheduled}


def run_to_end(scheduler, max_steps=1000):
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return
        step(scheduler)
    raise AssertionError("requests did not finish")


def test_budget_is_shared_and_long_prompts_are_chunked():
    s = make_scheduler(max_num_batched_tokens=16)
    a, b, c = make_requests(3, prompt_len=10)
    for r in (a, b, c):
        s.add_request(r)
    assert step(s) == {a.request_id: 10, b.request_id: 6}  # b's prompt is split across steps
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0
    # Running requests go first: a decodes, b finishes its prompt, c gets the rest.
    assert step(s) == {a.request_id: 1, b.request_id: 4, c.request_id: 10}


def test_chunked_prefill_samples_only_when_caught_up():
    s = make_scheduler(max_num_batched_tokens=16)
    r = make_request(prompt_len=40)
    s.add_request(r)
    assert [step(s)[r.request_id] for _ in range(3)] == [16, 16, 8]
    assert r.num_output_tokens == 1 and r.num_computed_tokens == 40
    assert step(s) == {r.request_id: 1}


def test_max_num_seqs_caps_the_batch():
    s = make_scheduler(max_num_seqs=2)
    reqs = make_requests(3, prompt_len=4)
    for r in reqs:
        s.add_request(r)
    assert set(step(s)) == {reqs[0].request_id, reqs[1].request_id}


def test_shared_prefix_hits_the_cache():
    s = make_scheduler(page_size=4)
    first = make_request(prompt_len=12, max_tokens=1)
    s.add_request(first)
    run_to_end(s)
    second = make_request(prompt_len=15, prefix=first.prompt_token_ids, max_tokens=1)
    s.add_request(second)
    assert step(s) == {second.request_id: 15 - 12}
    assert second.num_cached_tokens == 12
    assert s.stats.prefix_hit_tokens == 12


def test_identical_prompt_recomputes_its_last_token():
    s = make_scheduler(page_size=4)
    first = make_request(prompt_len=12, max_tokens=1)
    s.add_request(first)
    run_to_end(s)
    again = make_request(prompt_len=12, prefix=first.prompt_token_ids, max_tokens=1)
    s.add_request(again)
    assert step(s) == {again.request_id: 4}  # the last page is recomputed to get logits
    assert again.num_cached_tokens == 8


def test_cache_salt_separates_namespaces():
    s = make_scheduler(page_size=4)
    first = make_request(prompt_len=12, max_tokens=1)
    first.cache_salt = "tenant-a"
    s.add_request(first)
    run_to_end(s)
    other = make_request(prompt_len=12, prefix=first.prompt_token_ids, max_tokens=1)
    other.cache_salt = "tenant-b"
    s.add_request(other)
    step(s)
    assert other.num_cached_tokens == 0


def test_preemption_frees_pages_and_the_victim_catches_up_later():
    # 6 pages of 4 tokens; two requests of 8 prompt tokens each grow until the pool runs out.
    s = make_scheduler(page_size=4, num_pages=6, max_num_batched_tokens=32)
    a, b = make_requests(2, prompt_len=8, max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    preempted = []
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        batch = s.schedule()
        preempted += [r.request_id for r in batch.preempted]
        result = StepResult(sampled={x.request.request_id: SampledToken(NEXT_TOKEN, 0.0) for x in batch.scheduled if x.samples})
        s.update(batch, result)
        s.kv.check_integrity()
    assert preempted and set(preempted) == {b.request_id}  # the later arrival is the victim
    assert b.metrics.num_preemptions >= 1
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert s.kv.stats().num_in_use == 0


def test_priority_policy_admits_and_preempts_by_priority():
    s = make_scheduler(policy="priority", max_num_seqs=1)
    low = make_request(prompt_len=4, priority=5, arrival=0.0)
    high = make_request(prompt_len=4, priority=1, arrival=1.0)
    s.add_request(low)
    s.add_request(high)
    assert set(step(s)) == {high.request_id}
    assert s.policy.pick_victim([low, high]) is low


def test_abort_frees_pages_at_once():
    s = make_scheduler()
    a, b = make_requests(2, prompt_len=10, max_tokens=50)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert s.kv.stats().num_in_use > 0
    s.finish_requests([a.request_id, b.request_id], RequestStatus.FINISHED_ABORTED)
    assert a.finish_reason == "abort" and not s.has_unfinished_requests()
    assert s.kv.stats().num_in_use == 0
    s.kv.check_integrity()


def test_abort_of_waiting_and_unknown_requests():
    s = make_scheduler(max_num_seqs=1)
    a, b = make_requests(2)
    s.add_request(a)
    s.add_request(b)
    step(s)
    s.finish_requests([b.request_id, "nope"], RequestStatus.FINISHED_ABORTED)
    assert b.is_finished and s.waiting == []


def test_request_larger_than_the_whole_cache_is_refused():
    s = make_scheduler(page_size=4, num_pages=4)
    with pytest.raises(CacheCapacityError):
        s.add_request(make_request(prompt_len=10, max_tokens=10))


def test_stop_conditions():
    s = make_scheduler()
    eos = make_request(prompt_len=4, max_tokens=10, eos=(NEXT_TOKEN,))
    stop_id = make_request(prompt_len=4, max_tokens=10, stop_token_ids=[NEXT_TOKEN])
    length = make_request(prompt_len=4, max_tokens=3)
    min_tok = make_request(prompt_len=4, max_tokens=10, eos=(NEXT_TOKEN,), min_tokens=2)
    ignore = make_request(prompt_len=4, max_tokens=3, eos=(), ignore_eos=True)
    for r in (eos, stop_id, length, min_tok, ignore):
        s.add_request(r)
    run_to_end(s)
    assert (eos.finish_reason, eos.num_output_tokens, eos.stop_reason) == ("stop", 1, None)
    assert (stop_id.finish_reason, stop_id.stop_reason) == ("stop", NEXT_TOKEN)
    assert (length.finish_reason, length.num_output_tokens) == ("length", 3)
    assert (min_tok.finish_reason, min_tok.num_output_tokens) == ("stop", 3)
    assert ignore.finish_reason == "length"


def test_max_model_len_ends_a_request():
    s = make_scheduler(max_model_len=12)
    r = make_request(prompt_len=10, max_tokens=100)
    s.add_request(r)
    run_to_end(s)
    assert r.finish_reason == "length" and r.num_tokens == 12


def test_siblings_share_the_prompt_pages():
    s = make_scheduler(page_size=4, prefix_wait_tokens=4)  # they wait for any whole page (the shared-prefix wait)
    prompt = make_request(prompt_len=13).prompt_token_ids
    kids = [make_request(prompt_len=13, prefix=prompt, arrival=float(i)) for i in range(3)]
    for k in kids:
        s.add_request(k)
    assert set(step(s)) == {kids[0].request_id}  # siblings wait for the shared prompt
    second = step(s)
    assert second[kids[1].request_id] == 1 and second[kids[2].request_id] == 1
    assert kids[1].num_cached_tokens == 12


# -- jump-forward: tokens a grammar forces are appended at once and computed as one extend ----------
FORCED = [8, 9, 10]


class ForcingMatcher(GrammarMatcher):
    """A grammar that forces FORCED at the start and after every NEXT_TOKEN, and allows anything else."""

    def __init__(self):
        self.accepted: list[int] = []

    def forced_tokens(self) -> list[int]:
        return list(FORCED) if self.accepted[-1:] in ([], [NEXT_TOKEN]) else []

    def accept_token(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    def fill_bitmask(self, bitmask, row): ...
    def is_terminated(self): return False  # fmt: skip
    def rollback(self, num_tokens): ...
    def reset(self): ...


def make_constrained(scheduler, **kw):
    request = make_request(structured_outputs={"regex": "[0-9]+"}, **kw)
    request.grammar = Future()
    request.grammar.set_result(ForcingMatcher())
    scheduler.add_request(request)
    return request


def test_forced_tokens_are_appended_and_computed_in_one_extend():
    s = make_scheduler()
    r = make_constrained(s, prompt_len=10, max_tokens=20)
    assert step(s) == {r.request_id: 13}  # the opening forced tokens join the prompt's step
    assert list(r.output_token_ids) == FORCED + [NEXT_TOKEN] + FORCED
    assert step(s) == {r.request_id: 4}  # sampled + forced: one extend, sampling after the last
    assert list(r.output_token_ids) == (FORCED + [NEXT_TOKEN]) * 2 + FORCED
    assert r.matcher.accepted == list(r.output_token_ids)
    assert r.logprobs is None  # forced tokens add logprobs only where they were asked for


def test_forced_tokens_count_towards_max_tokens():
    s = make_scheduler()
    cut = make_constrained(s, prompt_len=4, max_tokens=5)
    all_forced = make_constrained(s, prompt_len=4, max_tokens=2)
    assert step(s) == {cut.request_id: 7}  # all_forced never runs: its output was all forced
    assert (all_forced.finish_reason, list(all_forced.output_token_ids)) == ("length", FORCED[:2])
    assert (cut.finish_reason, list(cut.output_token_ids)) == ("length", FORCED + [NEXT_TOKEN] + FORCED[:1])
    assert not s.has_unfinished_requests()


def test_a_forced_stop_token_ends_the_request_there():
    s = make_scheduler()
    r = make_constrained(s, prompt_len=4, max_tokens=20, stop_token_ids=[FORCED[1]], logprobs=0)
    run_to_end(s)
    assert (r.finish_reason, r.stop_reason, list(r.output_token_ids)) == ("stop", FORCED[1], FORCED[:2])
    assert [(lp.token_id, lp.logprob, lp.rank) for lp in r.logprobs] == [(t, 0.0, 1) for t in FORCED[:2]]


def test_without_jump_forward_every_token_is_a_step():
    s = make_scheduler(jump_forward=False)
    r = make_constrained(s, prompt_len=10, max_tokens=3)
    assert [step(s) for _ in range(3)] == [{r.request_id: 10}, {r.request_id: 1}, {r.request_id: 1}]
    assert r.finish_reason == "length" and list(r.output_token_ids) == [NEXT_TOKEN] * 3


def test_a_grammar_library_that_raises_ends_its_request_only():
    s = make_scheduler()
    broken, plain = make_constrained(s, prompt_len=4, max_tokens=20), make_request(prompt_len=4, max_tokens=20)
    s.add_request(plain)
    step(s)

    def crash(token_id):
        raise RuntimeError("library panic")

    broken.matcher.accept_token = crash
    step(s)
    assert broken.finish_reason == "error" and "library panic" in broken.error.message
    assert plain.status == RequestStatus.RUNNING and plain.num_output_tokens == 2


def test_each_scheduled_request_carries_the_pages_of_its_tokens():
    """The Batch is self-contained: page_ids cover tokens [0, end), in the order the cache holds them."""
    s = make_scheduler(page_size=4, max_num_batched_tokens=8)
    a, b = make_requests(2, prompt_len=10, max_tokens=3)
    for r in (a, b):
        s.add_request(r)
    for _ in range(5):
        batch = s.schedule()
        for item in batch.scheduled:
            assert list(item.page_ids) == list(s.kv.page_table(item.request.request_id))[: -(-item.end // 4)]
        s.update(batch, StepResult(sampled={i.request.request_id: SampledToken(NEXT_TOKEN, -0.5)
                                            for i in batch.scheduled if i.samples}))
