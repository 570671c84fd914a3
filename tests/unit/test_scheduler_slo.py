"""The slo policy, step by step on a fake clock: earliest deadline first, fair across tenants, and a request
that cannot meet its targets refused before it costs a step (scheduler/policy.py)."""

from __future__ import annotations

import argparse

import pytest

from banyan.config_args import add_engine_args, engine_config
from banyan.errors import error_info
from banyan.request import RequestStatus, Slo
from banyan.scheduler.policy import (
    KeyShareExceededError,
    SloUnattainableError,
    blame,
    expected_wait,
    fair_ahead,
    refusal,
    with_defaults,
)
from tests.unit.test_scheduler import make_request, make_scheduler, step

STEP = 0.1  # seconds each stand-in step takes on the fake clock


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def slo_scheduler(clock: FakeClock, **kw):
    s = make_scheduler(policy="slo", **kw)
    s.policy.deadlines.clock = clock
    return s


def slo_request(clock: FakeClock, ttft_ms=None, tpot_ms=None, tenant=None, prompt_len=16, max_tokens=1):
    r = make_request(prompt_len=prompt_len, max_tokens=max_tokens, arrival=clock.now)
    r.slo = Slo(ttft_ms, tpot_ms, tenant)
    return r


def check(s, request) -> None:
    """What the engine runs as a request arrives under slo: raises SloUnattainableError, or queues nothing."""
    s.policy.deadlines.check_new(request, s.running, s.waiting)


def timed_step(s, clock: FakeClock, seconds: float = STEP) -> dict:
    scheduled = step(s)
    clock.now += seconds
    return scheduled


def backlogged(clock: FakeClock, num_queued: int, ttft_ms=60_000.0):
    """A scheduler that admits one 16-token request per 0.1 s step (measured over a few backlogged steps),
    with `num_queued` more requests waiting: the k-th queued request's first token is due (k + 1 + 1.5) steps on
    (those ahead, itself, the rest of the step running and its own)."""
    s = slo_scheduler(clock, max_num_seqs=1, max_num_batched_tokens=16)
    for _ in range(4 + num_queued):
        s.add_request(slo_request(clock, ttft_ms))
    for _ in range(4):
        timed_step(s, clock)
    assert len(s.waiting) == num_queued and s.policy.deadlines.step_seconds == pytest.approx(STEP)
    return s


def test_waiting_requests_go_earliest_deadline_first():
    clock = FakeClock()
    s = slo_scheduler(clock, max_num_seqs=1)
    late, soon, middle, none = (slo_request(clock, ttft) for ttft in (3000, 1000, 2000, None))
    for r in (none, late, soon, middle):
        s.add_request(r)
    admitted = [next(iter(timed_step(s, clock))) for _ in range(4)]
    assert admitted == [soon.request_id, middle.request_id, late.request_id, none.request_id]  # no target: last


def test_the_victim_of_a_preemption_is_the_request_with_most_slack():
    clock = FakeClock()
    s = slo_scheduler(clock)
    tight, loose = slo_request(clock, 500), slo_request(clock, 5000)
    assert s.policy.pick_victim([tight, loose]) is loose


def test_nothing_is_refused_before_a_queue_was_measured():
    clock = FakeClock()
    s = slo_scheduler(clock)
    check(s, slo_request(clock, ttft_ms=1))  # no measurement: optimistic


def test_a_request_the_queue_would_make_late_is_refused_when_it_arrives():
    clock = FakeClock()
    s = backlogged(clock, num_queued=10, ttft_ms=1600)  # queued 0.4 s ago: their deadlines are 1.2 s from now
    # behind those 10: (10 + itself + 1.5) steps = 1.25 s
    with pytest.raises(SloUnattainableError) as refused:
        check(s, slo_request(clock, ttft_ms=1220))  # due 1.22 s from now, after all 10
    info = error_info(refused.value)
    assert (info.status, info.code) == (503, "slo_unattainable") and "1220 ms ttft" in info.message
    assert info.retry_after == pytest.approx(0.03)
    check(s, slo_request(clock, ttft_ms=1300))


def test_a_tighter_deadline_waits_only_behind_the_tighter_ones():
    clock = FakeClock()
    s = backlogged(clock, num_queued=10, ttft_ms=60_000)
    check(s, slo_request(clock, ttft_ms=300))  # goes first: 1 + 1.5 steps


def test_without_a_queue_the_step_time_alone_refuses():
    clock = FakeClock()
    s = slo_scheduler(clock)  # room for every request: nothing ever waits
    for _ in range(3):
        s.add_request(slo_request(clock, max_tokens=50))
    for _ in range(3):
        timed_step(s, clock, seconds=1.0)  # a big batch: slow steps
    assert not s.waiting and s.policy.deadlines.admitted_per_step == 0.0  # no queue, no pace
    with pytest.raises(SloUnattainableError):
        check(s, slo_request(clock, ttft_ms=1400))  # the rest of a step, then its own: 1.5 s
    check(s, slo_request(clock, ttft_ms=1600))


def test_a_step_slower_than_the_tpot_target_is_refused():
    clock = FakeClock()
    s = backlogged(clock, num_queued=0)
    with pytest.raises(SloUnattainableError, match="50 ms tpot"):
        check(s, slo_request(clock, tpot_ms=50))
    check(s, slo_request(clock, tpot_ms=150))


def test_waiting_requests_that_can_no_longer_make_it_end_unrun():
    clock = FakeClock()
    s = backlogged(clock, num_queued=0)
    queued = [slo_request(clock, ttft_ms=1000) for _ in range(6)]
    for r in queued:
        s.add_request(r)  # feasible when they came: 6 ahead at most, 0.7 s
    clock.now += 0.5  # the core stalled; now only the first few can still make it
    batch = s.schedule()
    refused = set(batch.finished)
    assert refused == set(queued[3:])  # 0.5 s gone: the k-th needs (k + 2.5) steps, k = 3 would take 0.55 s
    for r in refused:
        assert r.status == RequestStatus.FINISHED_ERROR and r.num_computed_tokens == 0
        assert (r.error.status, r.error.code) == (503, "slo_unattainable") and r.error.retry_after > 0
        assert r.request_id not in s.requests
    assert [item.request for item in batch.scheduled] == [queued[0]]
    s.kv.check_integrity()


def test_a_tenant_flooding_the_queue_delays_its_own_requests_first():
    clock = FakeClock()
    s = backlogged(clock, num_queued=0)
    flood = [slo_request(clock, 60_000, tenant="a") for _ in range(4)]
    clock.now += 0.01
    other = [slo_request(clock, 60_000, tenant="b") for _ in range(2)]  # later deadlines, by 10 ms
    for r in flood + other:
        s.add_request(r)
    order = [next(iter(timed_step(s, clock))) for _ in range(6)]
    a, b = [r.request_id for r in flood], [r.request_id for r in other]
    assert order == [a[0], b[0], a[1], b[1], a[2], a[3]]


def test_fcfs_ignores_targets_and_refuses_nothing():
    clock = FakeClock()
    s = make_scheduler(policy="fcfs", max_num_seqs=1)
    first, second = slo_request(clock, 5000), slo_request(clock, 1)
    for r in (first, second):
        s.add_request(r)
    assert s.policy.deadlines is None
    assert [next(iter(step(s))) for _ in range(2)] == [first.request_id, second.request_id]


def test_the_servers_defaults_fill_only_what_the_request_left_unset():
    assert with_defaults(Slo(ttft_ms=100, tenant="t"), 2000, 200) == Slo(100, 200, "t")
    assert with_defaults(None, 2000, None) == Slo(ttft_ms=2000)
    assert with_defaults(Slo(tenant="t"), None, None) is None


def test_the_server_computes_the_wait_the_core_would_from_its_snapshot():
    clock = FakeClock()
    s = backlogged(clock, num_queued=5)
    snap = s.policy.deadlines.snapshot(s.running, s.waiting)
    at_server = expected_wait(snap["slo_step_seconds"], snap["slo_prefill_per_step"], snap["slo_admitted_per_step"],
                              snap["slo_queue_tokens"] + 16, snap["slo_queue_requests"] + 1)
    in_core = s.policy.deadlines.wait_seconds(16 * 6, 6)  # behind the 5, its own 16 tokens
    assert at_server == pytest.approx(in_core) == pytest.approx((6 + 1.5) * STEP)


def test_the_server_refuses_from_the_cores_measurements():
    assert refusal(Slo(ttft_ms=2000), elapsed=0.0, wait=2.5, step_seconds=0.05).retry_after == pytest.approx(0.5)
    assert refusal(Slo(ttft_ms=2000), elapsed=0.0, wait=1.5, step_seconds=0.05) is None
    assert refusal(None, elapsed=0.0, wait=99.0, step_seconds=9.0) is None


@pytest.mark.parametrize("flag", ["--scheduling-policy", "--policy"])
def test_flags_vllms_name_and_the_old_one(flag):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args([flag, "slo", "--default-ttft-slo-ms", "2000", "--default-tpot-slo-ms", "200"])
    sched = engine_config(args).scheduler
    assert (sched.policy, sched.default_ttft_slo_ms, sched.default_tpot_slo_ms) == ("slo", 2000.0, 200.0)


def flooded(clock: FakeClock, num_flood: int, ttft_ms: float):
    """`backlogged`, then key "a" queues `num_flood` requests and key "b" one, all due `ttft_ms` after now."""
    s = backlogged(clock, num_queued=0)
    for tenant in ["a"] * num_flood + ["b"]:
        s.add_request(slo_request(clock, ttft_ms, tenant=tenant))
    return s


def test_a_key_holding_more_than_its_share_is_refused_with_429_and_a_light_key_is_served():
    clock = FakeClock()
    s = flooded(clock, num_flood=20, ttft_ms=1600)
    with pytest.raises(KeyShareExceededError) as refused:  # behind its own 20: (21 + 1.5) steps = 2.25 s
        check(s, slo_request(clock, ttft_ms=1600, tenant="a"))
    info = error_info(refused.value)
    assert (info.status, info.type, info.code) == (429, "rate_limit_error", "slo_unattainable")
    assert "this API key has 21 of the 22 requests in flight, more than its share (1/2 of them)" in info.message
    assert "1600 ms ttft" in info.message and info.retry_after > 0
    check(s, slo_request(clock, ttft_ms=1600, tenant="b"))  # ahead of most of a's: its turn comes within 1.6 s


def test_a_key_within_its_share_is_refused_with_the_servers_503():
    clock = FakeClock()
    s = flooded(clock, num_flood=2, ttft_ms=60_000)  # b: 2 of the 4 in flight with its new one, an equal share
    with pytest.raises(SloUnattainableError) as refused:
        check(s, slo_request(clock, ttft_ms=100, tenant="b"))  # below one step: nobody's backlog is to blame
    assert not isinstance(refused.value, KeyShareExceededError) and error_info(refused.value).status == 503


def test_the_key_to_blame_holds_more_than_an_equal_share_among_the_keys_in_flight():
    error = SloUnattainableError("late", retry_after=2.0)
    assert blame(error, own=30, total=30, tenants=1) is error  # alone: the server is overloaded, 503
    assert blame(error, own=15, total=30, tenants=2) is error  # exactly its share
    share = blame(error, own=16, total=30, tenants=2)
    assert isinstance(share, KeyShareExceededError) and share.retry_after == 2.0


def test_the_server_places_a_keys_request_where_turns_between_keys_put_it():
    assert fair_ahead(0, [30, 2]) == 2  # a light key: one of each other key's before it
    assert fair_ahead(5, [1, 30]) == 5 + 1 + 6  # a heavy one: its own, and as many turns of the others


def test_an_idle_core_forgets_the_pace_of_a_queue_that_is_gone():
    """A burst the core refused left a slow pace behind; kept, the server refused every request from it (an idle
    core measures nothing, so it never changed): found by the two-key flood over HTTP."""
    clock = FakeClock()
    s = backlogged(clock, num_queued=0)
    d = s.policy.deadlines
    d.admitted_per_step = d.prefill_per_step = 0.01  # one admission per 100 steps: a first token 10 s away
    busy = d.snapshot([slo_request(clock)], [])
    assert busy["slo_admitted_per_step"] == 0.01
    idle = d.snapshot([], [])
    assert idle["slo_admitted_per_step"] == idle["slo_prefill_per_step"] == 0.0 and idle["slo_step_seconds"] > 0
    wait = expected_wait(idle["slo_step_seconds"], 0.0, 0.0, 16, 1)
    assert refusal(Slo(ttft_ms=2000), 0.0, wait, idle["slo_step_seconds"]) is None  # the step time alone counts


def test_the_first_backlogged_steps_pace_the_queue_as_their_mean():
    clock = FakeClock()
    s = slo_scheduler(clock, max_num_seqs=1, max_num_batched_tokens=16)
    for _ in range(6):
        s.add_request(slo_request(clock, 60_000, max_tokens=2))  # one admission every other step
    for _ in range(5):
        timed_step(s, clock)
    assert s.policy.deadlines.admitted_per_step == pytest.approx(0.5, abs=0.15)


def test_the_wait_estimate_learns_its_own_error_from_first_tokens():
    clock = FakeClock()
    s = backlogged(clock, num_queued=0)
    deadlines = s.policy.deadlines
    for _ in range(40):  # every first token comes twice as late as estimated (steps slowing, the server's time)
        r = slo_request(clock, ttft_ms=60_000)
        check(s, r)
        at, plain = r.metrics.slo_forecast
        assert at == clock.now and plain == pytest.approx(1.5 * STEP)  # nothing queued: the rest of a step, its own
        clock.now += 2 * plain
        deadlines.first_token(r)
        assert r.metrics.slo_forecast is None  # taught once
    assert deadlines.bias == pytest.approx(2.0, rel=0.05)
    assert deadlines.wait_seconds(16, 1) == pytest.approx(2 * plain, rel=0.05)
    with pytest.raises(SloUnattainableError):  # the plain estimate would have let it in
        check(s, slo_request(clock, ttft_ms=1000 * plain * 1.5))
    snap = deadlines.snapshot(s.running, s.waiting)  # the server plans with the same bias
    at_server = expected_wait(snap["slo_step_seconds"], snap["slo_prefill_per_step"], snap["slo_admitted_per_step"],
                              16, 1, snap["slo_wait_bias"])
    assert at_server == pytest.approx(deadlines.wait_seconds(16, 1))


def test_the_learned_bias_is_bounded_and_a_request_without_an_estimate_teaches_nothing():
    clock = FakeClock()
    s = backlogged(clock, num_queued=0)
    deadlines = s.policy.deadlines
    unchecked = slo_request(clock, ttft_ms=60_000)
    deadlines.first_token(unchecked)  # arrived before anything was measured: no estimate to compare
    assert deadlines.bias == 1.0
    for _ in range(200):  # a stalled machine: first tokens 100x later than estimated
        r = slo_request(clock, ttft_ms=60_000)
        check(s, r)
        clock.now += 100.0
        deadlines.first_token(r)
    assert deadlines.bias == pytest.approx(4.0)


def test_the_scheduler_reports_each_first_token_to_the_estimate():
    clock = FakeClock()
    s = backlogged(clock, num_queued=0)
    r = slo_request(clock, ttft_ms=60_000)
    check(s, r)
    s.add_request(r)
    assert r.metrics.slo_forecast is not None
    timed_step(s, clock)
    timed_step(s, clock)
    assert r.metrics.first_token_time is not None and r.metrics.slo_forecast is None
