"""Queue order, preemption victims, and deadlines.

fcfs: arrival order. priority: lower `priority` value first, then arrival. slo: earliest time-to-first-token
deadline first (arrival + the request's `Slo.ttft_ms`; none: after every deadline), fair across tenants. The
victim of a preemption is always the request that would be served last: the latest, the lowest priority, or the
one with the most slack.

Under slo, `Deadlines` also refuses what cannot be served in time, before it costs a step:

    wait(request) = (max(tokens ahead / prefill tokens per step, requests ahead / admissions per step) + 1.5)
                    x step time               (step time: every step that ran; the two paces: while requests queued)

    tokens ahead:   the prompt tokens still to compute of the running requests and of every waiting one served
                    before it (its own prompt included); requests ahead: those waiting ones, itself included.
    refused:        now + wait(request) > its TTFT deadline, or the measured step time > its TPOT target
                    (503 slo_unattainable, Retry-After: when the queue ahead will have drained enough).

    wait x bias:    the estimate learns its own error: bias = EWMA of (the first-token wait a request had) /
                    (the wait estimated when it arrived), in [0.5, 4]. Steps that slow as the batch grows, and the
                    server's own time before the core sees a request, make the plain estimate short; measured here,
                    they no longer let requests in that end up late.

The first term binds when prompts are long (compute), the second when max_num_seqs or the cache is full (the queue
moves only as running requests finish). Before a step was measured nothing is refused; before a queue was, only the
step time counts (a request that cannot have its first token within 1.5 steps). Fairness: a tenant's
k-th waiting request (k = 0, 1, ... in deadline order) is ordered as if its deadline were k + s service slots later,
s = the tenant's admissions of the last seconds (each decaying e^(-age / FAIRNESS_WINDOW)) and one slot = the
measured seconds per admission, so one key flooding the queue delays its own requests first.

A refusal is the key's own doing when its tenant holds more than an equal share of the requests in flight (running
and waiting) among the tenants that have some: 429 (rate_limit_error, still code slo_unattainable, the share named
in the message) instead of the server-wide 503. A tenant alone holds exactly its share: that is the server overloaded.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec

from banyan.errors import BanyanError
from banyan.registry import Registry
from banyan.request import Request, RequestStatus, Slo

if TYPE_CHECKING:
    from banyan.scheduler.batch import ScheduledRequest

POLICIES: Registry[Callable[[Request], tuple]] = Registry("policy")  # name -> sort key: smaller is served first
EWMA_RATE = 0.05
"""Weight of one backlogged step in the measured rates (about the last 20 steps count; the first 20 steps of a
queue as a plain mean, so that the first step's 0 or 1 admission does not stand for the pace for long)."""
FIRST_TOKEN_STEPS = 1.5
"""Steps a request at the head of the queue waits for its first token: the rest of the step running (half, on
average), then its own."""
FAIRNESS_WINDOW = 2.0
"""Seconds over which a tenant's admissions count against its share (an exponential decay's time constant)."""
BIAS_RATE = 0.1
"""Weight of one request's first token in the estimate's learned bias (about the last 10 requests count)."""
BIAS_BOUNDS = (0.5, 4.0)
"""The learned bias stays within these: one odd request (a stall of the whole machine) cannot shut the door."""


class SloUnattainableError(BanyanError):
    """The request cannot meet its latency target given the queue and the measured step times."""

    status = 503
    code = "slo_unattainable"
    public_message = None

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class KeyShareExceededError(SloUnattainableError):
    """The request cannot meet its latency target and its API key holds more than its share of the requests in
    flight: the key's own backlog makes it late, not the server's load."""

    status = 429
    type = "rate_limit_error"


def blame(error: SloUnattainableError, own: int, total: int, tenants: int) -> SloUnattainableError:
    """The refusal as the key reads it: 429 when its tenant holds `own` of the `total` requests in flight, more than
    an equal share among the `tenants` that have some; the server-wide 503 otherwise (a tenant alone included)."""
    if tenants < 2 or own * tenants <= total:
        return error
    return KeyShareExceededError(f"this API key has {own} of the {total} requests in flight, more than its share "
                                 f"(1/{tenants} of them): {error}", retry_after=error.retry_after)


def fair_ahead(own: int, others: Iterable[int]) -> int:
    """Requests served before a tenant's next one when tenants take turns (what fair_order comes to when deadlines
    are alike): its own `own`, and of each other tenant's count in `others` at most own + 1."""
    return own + sum(min(n, own + 1) for n in others)


def tenant_of(request: Request) -> str | None:
    return request.slo.tenant if request.slo is not None else None


def ttft_deadline(request: Request) -> float:
    """When the request's first token is due (wall clock); inf without a TTFT target."""
    slo = request.slo
    if slo is None or slo.ttft_ms is None:
        return math.inf
    return request.metrics.arrival_time + slo.ttft_ms / 1000.0


@POLICIES.register("fcfs")
def _arrival(request: Request) -> tuple:
    return (request.metrics.arrival_time, request.seq_no)


@POLICIES.register("priority")
def _priority(request: Request) -> tuple:
    return (request.priority, request.metrics.arrival_time, request.seq_no)


@POLICIES.register("slo")
def _deadline(request: Request) -> tuple:
    return (ttft_deadline(request), request.metrics.arrival_time, request.seq_no)


class SchedulingPolicy:
    def __init__(self, name: str = "fcfs", clock: Callable[[], float] = time.time):
        self.key = POLICIES.get(name)
        """Sort key of a request: smaller is served first."""
        self.deadlines = Deadlines(clock) if name == "slo" else None
        """Under slo: the measured rates and the refusals; None otherwise."""

    def pick_victim(self, running: Iterable[Request]) -> Request:
        """The running request to preempt: the one served last."""
        return max(running, key=self.key)

    def admission_order(self, waiting: list[Request]) -> list[Request]:
        """The order waiting requests are admitted in (`waiting` is sorted by `key`)."""
        return list(waiting) if self.deadlines is None else self.deadlines.fair_order(waiting)


class Deadlines:
    """The slo policy's measurements (the step time; prefill tokens and admissions per step while requests queue; as
    EWMAs) and the decisions made from them. `clock` is wall time, as arrival times are."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._step_average = self._last_step = 0.0  # seconds; 0: nothing measured yet
        self.prefill_per_step = 0.0  # while requests queue (EWMAs)
        self.admitted_per_step = 0.0
        self._last: tuple | None = None  # the previous schedule: time, prefill, admitted, busy, backlogged
        self._admitted_total = self._admitted_before = 0
        self._paced_steps = 0  # backlogged steps in the paces: a running mean until 1 / EWMA_RATE of them
        self._served: dict[str | None, tuple[float, float]] = {}  # tenant -> (admissions, decayed to this time)
        self.bias = 1.0  # measured first-token wait / the wait estimated at arrival (EWMA, BIAS_BOUNDS)

    # -- measuring --------------------------------------------------------------------------------
    def admitted(self, request: Request) -> None:
        """The scheduler admitted the request (first admission or readmission): counted for the pace, and against
        its tenant's fair share."""
        self._admitted_total += 1
        tenant = tenant_of(request)
        self._served[tenant] = (self._served_by(tenant, self.clock()) + 1.0, self.clock())

    def observe_schedule(self, scheduled: Sequence[ScheduledRequest], backlogged: bool) -> None:
        """A schedule() just ended: what it holds (the step about to run) and whether requests still wait. The
        period to the next call is that step's time: it counts when the step ran something, and the step's
        prefill tokens and admissions count when requests waited too (the queue's pace, not the arrivals')."""
        now = self.clock()
        if self._last is not None:
            then, prefill, admitted, was_busy, was_backlogged = self._last
            if was_busy and now > then:
                self._last_step = now - then
                self._step_average = _ewma(self._step_average, self._last_step)
            if was_backlogged and now > then:
                self._paced_steps += 1
                weight = max(EWMA_RATE, 1.0 / self._paced_steps)  # one step's 0 or 1 admission is no pace yet
                self.prefill_per_step += weight * (prefill - self.prefill_per_step)
                self.admitted_per_step += weight * (admitted - self.admitted_per_step)
        prefill = sum(max(0, min(s.end, s.request.num_prompt_tokens) - s.start) for s in scheduled)
        self._last = (now, prefill, self._admitted_total - self._admitted_before, bool(scheduled), backlogged)
        self._admitted_before = self._admitted_total

    def first_token(self, request: Request) -> None:
        """The request has its first token: the wait estimated when it arrived (check_new), against the wait it
        had, teaches the bias. A request that arrived before anything was measured taught nothing."""
        forecast, request.metrics.slo_forecast = request.metrics.slo_forecast, None
        if forecast is None:
            return
        at, estimated = forecast
        if estimated > 0.0:
            ratio = min(max((self.clock() - at) / estimated, BIAS_BOUNDS[0]), BIAS_BOUNDS[1])
            self.bias += BIAS_RATE * (ratio - self.bias)

    def forget_pace_if_idle(self, running: Sequence[Request], waiting: Sequence[Request]) -> None:
        """With nothing running or waiting, the queue's pace is forgotten (the next queue's is measured afresh):
        kept, a slow pace measured on a burst the core then refused had the server refuse every request from then
        on, leaving the core idle and nothing to measure it again."""
        if not running and not waiting:
            self.prefill_per_step = self.admitted_per_step = 0.0
            self._paced_steps = 0

    @property
    def measured(self) -> bool:
        return self.step_seconds > 0.0

    @property
    def step_seconds(self) -> float:
        """The step time to plan with: the average, or the last step when it was slower (a batch that grows makes
        every step slower than the average says)."""
        return max(self._step_average, self._last_step)

    def wait_seconds(self, tokens_ahead: int, requests_ahead: int) -> float:
        """Expected seconds until a request with this much queued work before it (its own included) gets its
        first token; 0 before anything was measured."""
        return expected_wait(self.step_seconds, self.prefill_per_step, self.admitted_per_step, tokens_ahead,
                             requests_ahead, self.bias)

    def snapshot(self, running: Sequence[Request], waiting: Sequence[Request]) -> dict[str, float]:
        """EngineSnapshot's slo_* fields: the measurements and the queue, from which the server's admission check
        computes a new request's wait as the core would (expected_wait), its own prompt and requests sent since
        added. An idle core's pace is forgotten first."""
        self.forget_pace_if_idle(running, waiting)
        return {"slo_step_seconds": self.step_seconds, "slo_prefill_per_step": self.prefill_per_step,
                "slo_admitted_per_step": self.admitted_per_step,
                "slo_queue_tokens": _prefill_left(running) + _prefill_left(waiting), "slo_queue_requests": len(waiting),
                "slo_wait_bias": self.bias}

    # -- deciding -----------------------------------------------------------------------------------
    def fair_order(self, waiting: list[Request]) -> list[Request]:
        """Deadline order, each request moved (k + s) service slots later: k its rank among its tenant's waiting
        requests, s its tenant's recent admissions (module docstring)."""
        slot = self.step_seconds / self.admitted_per_step if self.admitted_per_step > 0 else 0.0
        if slot == 0.0:
            return list(waiting)
        now, rank, keyed = self.clock(), {}, []
        for request in waiting:  # already in deadline order, so each tenant's ranks follow its deadlines
            tenant = tenant_of(request)
            k = rank[tenant] = rank.get(tenant, self._served_by(tenant, now) - 1.0) + 1.0
            keyed.append((ttft_deadline(request) + k * slot, request))
        return [request for *_, request in sorted(keyed, key=lambda item: item[0])]  # stable: ties keep their order

    def _served_by(self, tenant: str | None, now: float) -> float:
        """The tenant's admissions, each weighing less as it ages (e^(-age / FAIRNESS_WINDOW))."""
        count, at = self._served.get(tenant, (0.0, now))
        count *= math.exp(-max(0.0, now - at) / FAIRNESS_WINDOW)
        self._served[tenant] = (count, now)
        return count

    def check_new(self, request: Request, running: Sequence[Request], waiting: Sequence[Request]) -> None:
        """Raise SloUnattainableError if the request, queued where the fair deadline order puts it, cannot meet its
        targets (KeyShareExceededError when its tenant holds more than its share)."""
        if not self.measured or request.slo is None:
            return
        self.forget_pace_if_idle(running, waiting)
        order = list(waiting)  # in deadline order; the new request goes after those due when it is (it has no seq_no yet)
        bisect.insort_right(order, request, key=lambda r: (ttft_deadline(r), r.metrics.arrival_time))
        order = self.fair_order(order)
        ahead = order[:order.index(request)]
        tokens = _prefill_left(running) + _prefill_left(ahead) + request.num_prompt_tokens
        wait = self.wait_seconds(tokens, len(ahead) + 1)
        self._check(request, wait, Counter(map(tenant_of, [*running, *order])))
        request.metrics.slo_forecast = (self.clock(), wait / self.bias)  # admitted: its first token will tell

    def unattainable(self, running: Iterable[Request], order: Sequence[Request]) -> list[tuple[Request, BanyanError]]:
        """The waiting requests (never started, in admission order) that can no longer meet their TTFT deadline,
        each with its error; the work of those kept counts ahead of the later ones, the refused do not."""
        if not self.measured:
            return []
        refused, tokens, count = [], _prefill_left(running), 0
        in_flight = Counter(map(tenant_of, [*running, *order]))
        for request in order:
            if request.status != RequestStatus.WAITING or request.metrics.first_token_time is not None:
                tokens += _prefill_left([request])  # preempted: it has its first token, never refused
                count += 1
                continue
            try:
                self._check(request, self.wait_seconds(tokens + request.num_prompt_tokens, count + 1), in_flight)
            except SloUnattainableError as e:
                refused.append((request, e))
                continue
            tokens += request.num_prompt_tokens
            count += 1
        return refused

    def _check(self, request: Request, wait: float, in_flight: Counter) -> None:
        """Raise the refusal, if any, blamed on the request's key when its tenant holds more than its share of
        `in_flight` (requests per tenant)."""
        error = refusal(request.slo, self.clock() - request.metrics.arrival_time, wait, self.step_seconds)
        if error is not None:
            raise blame(error, in_flight[tenant_of(request)], in_flight.total(), len(+in_flight))


def refusal(slo: Slo | None, elapsed: float, wait: float, step_seconds: float) -> SloUnattainableError | None:
    """Why a request `elapsed` seconds after its arrival, with `wait` seconds to go before its first token and
    steps of `step_seconds`, cannot meet its targets; None when it can (the core's check and the server's)."""
    if slo is None:
        return None
    if slo.ttft_ms is not None and elapsed + wait > slo.ttft_ms / 1000.0:
        return SloUnattainableError(
            f"the first token would come about {elapsed + wait:.2f} s after arrival (the queue ahead at the measured "
            f"step times), past the {slo.ttft_ms:g} ms ttft target", retry_after=elapsed + wait - slo.ttft_ms / 1000.0)
    if slo.tpot_ms is not None and step_seconds * 1000.0 > slo.tpot_ms:
        return SloUnattainableError(
            f"a step takes {step_seconds * 1000.0:.0f} ms now, more than the {slo.tpot_ms:g} ms tpot target",
            retry_after=1.0)
    return None


def with_defaults(slo: Slo | None, ttft_ms: float | None, tpot_ms: float | None) -> Slo | None:
    """The request's targets, the server's defaults where it set none (None: no target at all)."""
    slo = slo or Slo()
    slo = msgspec.structs.replace(slo, ttft_ms=slo.ttft_ms if slo.ttft_ms is not None else ttft_ms,
                                  tpot_ms=slo.tpot_ms if slo.tpot_ms is not None else tpot_ms)
    return slo if slo.ttft_ms is not None or slo.tpot_ms is not None else None


def expected_wait(step_seconds: float, prefill_per_step: float, admitted_per_step: float, tokens_ahead: int,
                  requests_ahead: int, bias: float = 1.0) -> float:
    """Seconds until a request with this much queued work before it (its own included) gets its first token
    (module docstring), times the estimate's learned bias; a pace not measured yet (0) counts for nothing, and so
    does a step time of 0."""
    steps = max(_steps_for(tokens_ahead, prefill_per_step), _steps_for(requests_ahead, admitted_per_step))
    return (steps + FIRST_TOKEN_STEPS) * step_seconds * bias


def _ewma(average: float, value: float) -> float:
    """One more observation in an average; the first one (average 0) seeds it."""
    if average <= 0.0:
        return float(value)
    return average + EWMA_RATE * (value - average)


def _steps_for(amount: float, per_step: float) -> float:
    """Steps to get through `amount` at `per_step` each; 0 while the pace is unknown (nothing measured yet)."""
    return amount / per_step if amount > 0 and per_step > 0 else 0.0


def _prefill_left(requests: Iterable[Request]) -> int:
    """Prompt tokens the requests still have to compute."""
    return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in requests)
