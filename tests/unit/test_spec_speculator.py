"""The Speculator's start-up measurement of step time (calibrate), on fake forward-time curves: no model, no clock."""

from __future__ import annotations

import pytest

from banyan.spec.config import SpeculativeConfig
from banyan.spec.speculator import CALIBRATION_REPEATS, STEP_TIME_SHAPE, Speculator, calibration_ladder


def make_speculator() -> Speculator:
    return Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4))


class FakeForward:
    """time_forward(n) on a known curve; `noise[n]` extra seconds on the first timing of n (a descheduled run)."""

    def __init__(self, curve, noise=None):
        self.curve, self.noise, self.calls = curve, dict(noise or {}), []

    def __call__(self, n: int) -> float:
        self.calls.append(n)
        return self.curve(n) + self.noise.pop(n, 0.0)


def test_calibration_fits_the_measured_curve_keeping_the_least_of_each_timing():
    spec = make_speculator()
    curve = lambda n: 0.002 + 0.0003 * n  # noqa: E731
    spec.calibrate(FakeForward(curve, noise={4: 0.1, 16: 0.1}), max_tokens=64)
    model = spec.controller.step_time
    assert model.tokens[0] == 1 and model.tokens[-1] == 64
    for n in (1, 3, 4, 5, 16, 40, 64, 200):  # on the points, between them, and extrapolated past the last
        assert model.predict(n) == pytest.approx(curve(n))


def test_calibration_warms_up_first_and_repeats_each_count():
    spec, forward = make_speculator(), FakeForward(lambda n: 0.01)
    spec.calibrate(forward, max_tokens=8)
    assert forward.calls[0] == 1  # the warm-up, not kept
    counts = forward.calls[1:]
    assert sorted(set(counts)) == [1, 2, 3, 4, 5, 8]  # one request's verify passes (k <= 4) and the span
    assert all(counts.count(n) == CALIBRATION_REPEATS for n in set(counts))


def test_calibration_stops_at_its_time_budget_and_extrapolates():
    spec, forward = make_speculator(), FakeForward(lambda n: 0.1 * n)
    spec.calibrate(forward, max_tokens=1024, budget_seconds=2.0)
    model = spec.controller.step_time
    assert model.tokens == [1, 2, 4]  # a slow model is not timed at every count; the span comes first
    assert model.predict(100) == pytest.approx(10.0)  # the last slope goes on


def test_a_spent_budget_still_spans_a_batch_of_verify_passes_and_one_requests_every_count():
    spec, forward = make_speculator(), FakeForward(lambda n: 0.05 + 0.002 * n)
    spec.calibrate(forward, max_tokens=1024, budget_seconds=1.5)
    # the span of a small batch, then 1 + k for every k <= 4 (where row tiles make the curve step), then wider
    assert spec.controller.step_time.tokens == [1, 2, 3, 4, 5, 8, 16, 32]
    assert forward.calls[1:].index(3) > forward.calls[1:].index(16)  # the span first


def test_the_ladder_times_each_count_once_in_span_first_order():
    assert calibration_ladder(5)[:8] == (1, 2, 4, 8, 16, 3, 5, 6)
    for k in (1, 5, 12):
        ladder = calibration_ladder(k)
        assert len(ladder) == len(set(ladder)) and set(range(1, k + 2)) <= set(ladder)


def test_a_failed_measurement_keeps_the_assumed_shape_for_the_first_step_to_scale():
    spec = make_speculator()
    spec.calibrate(FakeForward(lambda n: 0.0), max_tokens=64)
    spec.observe_step(1, 0.05)
    shape = dict(STEP_TIME_SHAPE)
    assert spec.controller.step_time.predict(8) == pytest.approx(0.05 * shape[8] / shape[1], rel=0.2)


class StepClock:
    """The speculator's clock: each read returns the next value."""

    def __init__(self, *values):
        self.values = list(values)

    def __call__(self) -> float:
        return self.values.pop(0)


def counting_proposer(spec: Speculator) -> list[int]:
    """Replaces the proposer's pass with a counted one; returns the count (a one-element list)."""
    calls, propose = [0], spec.proposer.propose_with_evidence

    def counted(*args):
        calls[0] += 1
        return propose(*args)

    spec.proposer.propose_with_evidence = counted
    return calls


FRESH = [("fresh", [5, 9, 2, 7, 3, 8], 4)]  # nothing repeats: ngram has nothing to propose
REPEATING = [("repeating", [1, 2, 3, 1, 2, 3, 1, 2], 4)]  # a pattern ngram continues


def test_a_pass_that_drafts_nothing_is_paid_for_by_the_passes_skipped_after_it():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    spec = Speculator(config, clock=StepClock(0.0, 0.5, 10.0, 10.5))
    calls = counting_proposer(spec)
    spec.observe_step(1, 5.0)  # steps of 5 s: a pass of 0.5 s is 10 steps' share (1% each)
    assert spec.drafts(FRESH, 0, 0.0, 64) == {} and calls[0] == 1
    assert spec.skip_passes == 10
    for _ in range(10):
        assert spec.drafts(REPEATING, 0, 0.0, 64) == {}  # skipped: the plain path, the proposer not asked
    assert calls[0] == 1
    assert spec.drafts(REPEATING, 0, 0.0, 64)["repeating"][:2] == [3, 1]  # asked again, and this pass drafts
    assert calls[0] == 2 and spec.skip_passes == 0


def test_a_pass_small_against_the_step_or_one_that_drafts_skips_nothing():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    spec = Speculator(config, clock=StepClock(0.0, 0.001, 1.0, 1.5))
    spec.observe_step(1, 5.0)
    assert spec.drafts(FRESH, 0, 0.0, 64) == {} and spec.skip_passes == 0  # 0.001 s: under 1% of a 5 s step
    assert spec.drafts(REPEATING, 0, 0.0, 64) and spec.skip_passes == 0  # 0.5 s, but it drafted


def test_without_a_measured_step_no_pass_is_skipped():
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4), clock=StepClock(0.0, 100.0))
    assert spec.drafts(FRESH, 0, 0.0, 64) == {} and spec.skip_passes == 0


def test_the_fixed_policy_never_skips_a_pass():
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4, policy="fixed"),
                      clock=StepClock(0.0, 0.5))
    spec.observe_step(1, 5.0)
    assert spec.drafts(FRESH, 0, 0.0, 64) == {} and spec.skip_passes == 0
