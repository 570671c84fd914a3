"""The speculation controller and its config, specified on fake step-time curves (no model, no clock)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from banyan.errors import InvalidParameterError
from banyan.spec.config import SpeculativeConfig
from banyan.spec.controller import AcceptanceStats, SpecController, allocate, cut_to_budget, evidence_bucket
from banyan.spec.speculator import Speculator
from banyan.spec.step_time import StepTimeModel

# fake forward-time curves over N tokens: memory-bound then compute-bound, concave, and one with tile steps
CURVES = {
    "linear": lambda n: 0.010 + 0.0005 * n,
    "concave": lambda n: 0.010 + 0.002 * math.sqrt(n),
    "tiles": lambda n: 0.010 + 0.004 * math.ceil(n / 8),  # non-convex: a bump every 8 tokens
    "convex": lambda n: 0.010 + 0.00002 * n * n,
}


def make_time_model(curve=CURVES["linear"], points=(1, 2, 4, 8, 16, 32, 64, 128, 256), rate=0.1):
    """A StepTimeModel seeded with `curve` at `points` (at every token count, it is the curve exactly)."""
    return StepTimeModel([(n, curve(n)) for n in points], rate=rate)


def make_controller(policy=None, k=4, prior=(0.8,), time_model=None, table=None, **kw):
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k, policy=policy,
                               num_speculative_tokens_per_batch_size=table)
    return SpecController(config, time_model or make_time_model(), prior, **kw)


class NoTime:
    """A step-time model that fails if read: proves a decision was taken without it."""

    def predict(self, num_tokens):
        raise AssertionError("the step-time model was read")

    def observe(self, num_tokens, seconds):
        raise AssertionError("the step-time model was updated")


def rate_of(ks, gains, curve, base_tokens=0, base_emitted=0.0, overhead=0.0, jump=0.0):
    """R(k) = (E_base + sum_i (1 + sum_{j<=k_i} g_ij)) / (t(B + sum_i (1 + k_i)) + overhead + [any k_i] jump)."""
    emitted = base_emitted + sum(1 + sum(row[:k]) for row, k in zip(gains, ks))
    return emitted / (curve(base_tokens + len(ks) + sum(ks)) + overhead + (jump if any(ks) else 0.0))


def brute_force(gains, curve, base_tokens=0, base_emitted=0.0, max_drafts=None, overhead=0.0, jump=0.0):
    choices = itertools.product(*(range(len(row) + 1) for row in gains))
    allowed = [ks for ks in choices if max_drafts is None or sum(ks) <= max_drafts]
    return max(rate_of(ks, gains, curve, base_tokens, base_emitted, overhead, jump) for ks in allowed)


def random_gains(rng, n, max_k):
    """Chain-rule gains of random per-position acceptances, with exact 0 and 1 among them."""
    rows = []
    for _ in range(n):
        choices = [0.0, 1.0, rng.random(), rng.random(), rng.random()]
        alphas = [rng.choice(choices) for _ in range(rng.randint(0, max_k))]
        rows.append(AcceptanceStats(alphas, rate=0.5).gains(len(alphas)))
    return rows


# --- the plain path ---------------------------------------------------------------------------------------------

def test_nothing_to_propose_is_the_plain_path_and_touches_nothing():
    c = make_controller(time_model=NoTime())
    assert c.choose(["a", "b", "c"], [0, 0, 0], base_tokens=50) == [0, 0, 0]
    assert c.stats == {}  # no request state created either


def test_acceptance_forced_to_zero_is_the_plain_path():
    c = make_controller(prior=(0.0,), time_model=NoTime())
    for _ in range(100):
        assert c.choose(["a", "b"], [4, 2]) == [0, 0]


def test_learned_zero_acceptance_turns_speculation_off():
    c = make_controller(prior=(0.9,), probe_rate=1e-9)
    assert c.choose(["a"], [4]) == [4]  # optimistic prior, one request: draft all
    for _ in range(30):
        ks = c.choose(["a"], [4])
        c.observe("a", ks[0], 0)
    assert c.choose(["a"], [4]) == [0]


# --- exactness against brute force ------------------------------------------------------------------------------

@pytest.mark.parametrize("sparse", [False, True], ids=["every_token", "sparse_buckets"])
@pytest.mark.parametrize("curve", sorted(CURVES))
def test_allocation_matches_brute_force(curve, sparse):
    """Up to 4 requests of up to 4 drafts: the rate of `allocate`'s choice is the best of all combinations."""
    rng = random.Random(curve)
    # buckets at every token count (the model is the curve), or a few (interpolated, flat below, extrapolated)
    model = make_time_model(CURVES[curve], points=(2, 3, 9, 17, 30) if sparse else range(1, 81))
    for _ in range(150):
        gains = random_gains(rng, rng.randint(1, 4), 4)
        base_tokens, base_emitted = rng.choice([0, 0, 5, 40]), rng.choice([0.0, 1.0])
        max_drafts = rng.choice([None, None, 0, 3])
        ks = allocate(gains, model, base_tokens, base_emitted, max_drafts)
        assert all(0 <= k <= len(row) for k, row in zip(ks, gains))
        assert max_drafts is None or sum(ks) <= max_drafts
        best = brute_force(gains, model.predict, base_tokens, base_emitted, max_drafts)
        assert rate_of(ks, gains, model.predict, base_tokens, base_emitted) == pytest.approx(best, rel=1e-12)


def test_allocation_with_a_per_sequence_cost_matches_brute_force():
    """A step's cost besides its tokens (s per sequence past the first) is part of the optimum, not a constant
    to drop: the rate divides by it."""
    rng = random.Random(1)
    model = make_time_model(CURVES["linear"], points=range(1, 81))
    for _ in range(150):
        gains = random_gains(rng, rng.randint(1, 4), 4)
        overhead = rng.choice([0.0, 0.002, 0.02])
        ks = allocate(gains, model, overhead=overhead)
        best = brute_force(gains, model.predict, overhead=overhead)
        assert rate_of(ks, gains, model.predict, overhead=overhead) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("curve", ["linear", "tiles", "flat"])
def test_allocation_with_a_verify_jump_matches_brute_force(curve):
    """Verifying anything costs a step a fixed j more (a GPU's plain step replays a CUDA graph, a verify step cannot):
    the optimum weighs the first draft against j plus its own cost, and later ones against their own."""
    rng = random.Random(curve)
    shape = {"flat": lambda n: 0.0076 + 0.00001 * n}.get(curve) or CURVES[curve]  # an H200's: drafts nearly free
    model = make_time_model(shape, points=range(1, 81))
    for _ in range(150):
        gains = random_gains(rng, rng.randint(1, 4), 4)
        overhead, jump = rng.choice([0.0, 0.002]), rng.choice([0.0, 0.0015, 0.01, 0.05])
        ks = allocate(gains, model, overhead=overhead, verify_seconds=jump)
        best = brute_force(gains, model.predict, overhead=overhead, jump=jump)
        assert rate_of(ks, gains, model.predict, overhead=overhead, jump=jump) == pytest.approx(best, rel=1e-12)


def test_a_bump_in_step_time_does_not_stop_the_scan():
    # 3 requests on the tile curve: 6 drafts cross a tile at 9 tokens and lower the rate, 12 fill the next tile;
    # a greedy that stops at the first drop keeps 5 drafts (rate 521/s), the optimum is 12 (667/s)
    gains = [AcceptanceStats([0.9, 0.8, 0.7, 0.6], rate=0.5).gains(4)] * 3
    ks = allocate(gains, make_time_model(CURVES["tiles"], points=range(1, 40)))
    assert ks == [4, 4, 4]
    assert rate_of(ks, gains, CURVES["tiles"]) == pytest.approx(brute_force(gains, CURVES["tiles"]))


def test_speculation_pays_at_batch_one_and_not_when_compute_bound():
    flat_then_linear = make_time_model(lambda n: max(0.02, 0.001 * n))
    c = make_controller(prior=(0.7,), time_model=flat_then_linear)
    assert c.choose(["a"], [4]) == [4]  # 1 token or 5 cost the same 20 ms: draft all
    ids = [f"r{i}" for i in range(64)]
    assert c.choose(ids, [4] * 64) == [0] * 64  # 64 tokens cost 64 ms; each draft adds 1 ms for < 1 token


def test_when_speculation_cannot_pay_the_scan_ends_at_once():
    class Counted(StepTimeModel):
        def predict(self, num_tokens):
            reads.append(num_tokens)
            return super().predict(num_tokens)

    reads = []
    compute_bound = Counted([(1, 0.001), (256, 0.256)])  # 1 ms a token: a draft costs as much as a whole token
    assert allocate([[0.9, 0.8, 0.7]] * 64, compute_bound) == [0] * 64
    assert reads == [64]  # R(0) only: no draft can beat it, so nothing was sorted or scanned
    assert allocate([[0.9, 0.8, 0.7]], make_time_model(lambda n: 0.010 + 0.002 * n)) == [3]  # cheap drafts pay


def test_ties_go_to_the_plain_path():
    # a draft certain to pass but that costs exactly what it brings: R(0) = 1/1, R(1) = 2/2
    assert allocate([[1.0]], StepTimeModel([(1, 1.0), (2, 2.0)])) == [0]


# --- policies ---------------------------------------------------------------------------------------------------

def test_fixed_policy_drafts_what_the_proposer_has_up_to_k():
    c = make_controller(policy="fixed", k=3, prior=(0.0,), time_model=NoTime())
    assert c.choose(["a", "b", "c"], [5, 2, 0]) == [3, 2, 0]


def test_token_budget_cuts_shallow_positions_first():
    c = make_controller(policy="fixed", k=3)
    # budget 10 = 2 base + 3 requests' own tokens + 5 drafts: first drafts of all, then second drafts
    assert c.choose(["a", "b", "c"], [3, 3, 1], base_tokens=2, token_budget=10) == [2, 2, 1]
    assert cut_to_budget([3, 3, 1], 4) == [2, 1, 1]
    assert cut_to_budget([2, 0], 0) == [0, 0]


def test_table_policy_follows_vllm_batch_size_ranges():
    c = make_controller(k=3, table=[[1, 2, 3], [3, 4, 1]], time_model=NoTime())
    assert c.config.policy == "table"
    assert c.choose(["a"], [5]) == [3]
    assert c.choose(["a", "b"], [5, 2]) == [3, 2]
    assert c.choose(["a", "b", "c"], [5, 0, 5]) == [1, 0, 1]
    assert c.choose([f"r{i}" for i in range(5)], [5] * 5) == [0] * 5  # batch size in no range


def test_adaptive_respects_the_token_budget():
    c = make_controller(prior=(1.0,), time_model=make_time_model(lambda n: 0.02))
    assert sum(c.choose(["a", "b"], [4, 4], token_budget=5)) == 3


# --- acceptance estimates ---------------------------------------------------------------------------------------

def test_ewma_learns_only_the_positions_it_observed():
    s = AcceptanceStats([0.5, 0.5, 0.5, 0.5], rate=0.5)
    s.update(drafted=3, accepted=1)  # position 1 passed, 2 rejected, 3 unobserved (2 failed), 4 not drafted
    assert s.alphas == [0.75, 0.25, 0.5, 0.5]
    s.update(drafted=2, accepted=2)  # both passed; position 3 was not drafted
    assert s.alphas == [0.875, 0.625, 0.5, 0.5]
    assert s.gains(3) == pytest.approx([0.875, 0.875 * 0.625, 0.875 * 0.625 * 0.5])
    assert s.expected_tokens(2) == pytest.approx(1 + 0.875 + 0.875 * 0.625)
    with pytest.raises(ValueError):
        s.update(drafted=2, accepted=3)


def test_idle_steps_relax_toward_the_prior():
    s = AcceptanceStats([0.0, 0.2], rate=0.5, relax_to=[0.8, 0.6], relax_rate=0.1)
    for _ in range(3):
        s.idle()
    assert s.alphas == pytest.approx([0.8 - 0.8 * 0.9**3, 0.6 - 0.4 * 0.9**3])  # each step 10% of the way


def test_new_requests_are_seeded_from_the_global_prior():
    c = make_controller(k=2, prior=(0.5, 0.4), global_rate=0.5, request_rate=0.3)
    assert c.request_stats("a").alphas == [0.5, 0.4]
    c.observe("a", 2, 2)
    assert c.global_stats.alphas == pytest.approx([0.75, 0.7])
    assert c.request_stats("a").alphas == pytest.approx([0.65, 0.58])
    assert c.request_stats("b").alphas == pytest.approx([0.75, 0.7])  # seeded now, from what was learned
    c.observe("b", 0, 0)  # nothing drafted: nothing learned
    assert c.request_stats("b").alphas == pytest.approx([0.75, 0.7])
    c.finish("a")
    assert "a" not in c.stats


def test_a_request_turned_off_is_probed_again():
    # a draft adds a third to the step: it pays once P(accept) > 1/3
    c = make_controller(prior=(0.9,), probe_rate=0.05, time_model=make_time_model(lambda n: 0.010 + 0.005 * n))
    for _ in range(20):
        c.observe("a", 4, 0)
    assert c.choose(["a"], [4]) == [0]
    steps = next(s for s in range(1, 500) if c.choose(["a"], [4])[0] > 0)
    assert 5 < steps < 100  # estimates relaxed toward the proposer's prior until a draft pays again


def test_where_every_draft_fails_requests_stop_probing_until_the_global_prior_recovers():
    """Random text: a new request each step with a proposal that is always rejected. Requests relax toward what
    the workload taught (the global prior), not toward the proposer's hopes, so probing fades; the global prior
    itself recovers slowly, so speculation is tried again much later."""
    c = make_controller(prior=(0.9,), time_model=make_time_model(lambda n: 0.010 + 0.005 * n))
    drafted_per_100 = []
    for block in range(6):
        drafted = 0
        for step in range(100):
            rid = f"r{block}-{step // 10}"  # requests of 10 steps each
            k = c.choose([rid], [4])[0]
            if k:
                c.observe(rid, k, 0)
                drafted += 1
            if step % 10 == 9:
                c.finish(rid)
        drafted_per_100.append(drafted)
    assert drafted_per_100[0] >= 5 and sum(drafted_per_100[2:]) <= drafted_per_100[0]
    # nothing drafted for a while: the global prior drifts back toward the declared one until a draft pays again
    quiet = next(s for s in range(1, 10_000) if c.choose([f"new-{s}"], [4])[0] > 0)
    assert 10 < quiet < 5000


def test_copying_requests_keep_drafting_beside_fresh_text_that_always_fails():
    """A mixed batch: half the requests copy a document (long matches, drafts pass), half write fresh text (chance
    matches of two tokens, drafts fail). Each kind learns its own evidence bucket's prior, so the fresh text turns
    its own drafting off without talking the copying requests out of theirs, new ones included."""
    c = make_controller(prior=(0.9,), time_model=make_time_model(lambda n: 0.010 + 0.002 * n))
    copying = [f"copy{i}" for i in range(4)]
    drafted = {"copy": 0, "fresh": 0}
    for step in range(300):
        fresh = [f"fresh{i}-{step // 10}" for i in range(4)]  # fresh requests come and go, every 10 steps
        ids = copying + fresh
        ks = c.choose(ids, [4] * 8, evidence=[40] * 4 + [2] * 4)
        for rid, k in zip(ids, ks):
            if k:
                c.observe(rid, k, k if rid.startswith("copy") else 0)
                drafted["copy" if rid.startswith("copy") else "fresh"] += step >= 200
        if step % 10 == 9:
            for rid in fresh:
                c.finish(rid)
    assert drafted["copy"] == 4 * 100  # every copying request drafts every step once the priors have learned
    assert drafted["fresh"] <= 10
    ids = [*copying, "new-copy", *(f"new-fresh{i}" for i in range(4))]
    assert c.choose(ids, [4] * 9, evidence=[40] * 5 + [2] * 4) == [4] * 5 + [0] * 4
    assert c.prior(evidence_bucket(2)).alphas[0] < 0.8 < 0.99 < c.prior(evidence_bucket(40)).alphas[0]


def test_unobserved_positions_follow_the_deepest_observed_one():
    s = AcceptanceStats([0.7, 0.6, 0.5, 0.5], rate=0.5, follow_unseen=True)
    assert s.alphas == [0.7, 0.6, 0.5, 0.5]  # nothing observed: the declared prior
    s.update(drafted=1, accepted=1)
    assert s.alphas == [0.85] * 4 and s.seen == [True, False, False, False]
    s.update(drafted=2, accepted=1)  # position 2 now observed (rejected); 3 and 4 follow it
    assert s.alphas == pytest.approx([0.925, 0.425, 0.425, 0.425])
    seeded = AcceptanceStats(s.alphas, rate=0.5, follow_unseen=True, seen=s.seen)
    seeded.update(drafted=1, accepted=1)  # position 2 was observed where the seed came from: it keeps its value
    assert seeded.alphas == pytest.approx([0.9625, 0.425, 0.425, 0.425])


def test_copying_requests_draft_deeper_than_the_declared_prior_once_their_first_drafts_pass():
    """The mixed serving run's failure: 8 requests decode at once and each draft token adds 8% to the step, so a
    draft pays when it passes with P > ~0.75. Copying requests' first drafts pass at ~0.95, but positions 2..5 sat at
    the declared prior (0.6, 0.5, ...), never paid, were never drafted, never learned: k stayed 1 for good. With
    unobserved positions following the observed ones, k climbs to where the drafts really stop paying."""
    curve = lambda n: 0.100 + 0.008 * n  # noqa: E731
    c = make_controller(k=5, prior=(0.7, 0.6, 0.5), time_model=make_time_model(curve))
    ids = [f"copy{i}" for i in range(4)] + [f"fresh{i}" for i in range(4)]
    history = []
    for step in range(60):
        ks = c.choose(ids, [5] * 8, evidence=[40] * 4 + [0] * 4)
        for rid, k in zip(ids, ks):
            if k:
                c.observe(rid, k, k if rid.startswith("copy") else 0)  # copies always pass, fresh text never
        history.append(ks)
    assert history[0][:4] == [1] * 4  # the declared prior: only the first position pays
    assert history[-1] == [5] * 4 + [0] * 4
    gains = [c.request_stats(rid).gains(5) for rid in ids]
    assert rate_of(history[-1], gains, curve) == pytest.approx(brute_force(gains, curve))


def test_a_request_whose_evidence_changes_is_seeded_from_its_new_bucket():
    c = make_controller(k=2, prior=(0.5,), global_rate=0.5)
    c.choose(["a"], [2], evidence=[2])
    for _ in range(5):
        c.observe("a", 2, 0)  # chance matches fail
    assert c.request_stats("a").alphas[0] < 0.1
    c.choose(["a"], [2], evidence=[30])  # now it copies: what copying requests taught (here the declared prior)
    assert c.request_stats("a").alphas == [0.5, 0.5]
    assert c.prior(evidence_bucket(2)).alphas[0] < 0.05 and c.global_stats.alphas == [0.5, 0.5]


def test_evidence_buckets_are_powers_of_two():
    assert [evidence_bucket(e) for e in (0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 1000)] == [0, 1, 2, 2, 3, 3, 4, 5, 5, 6, 6]


# --- step time --------------------------------------------------------------------------------------------------

def test_step_time_interpolates_and_extrapolates():
    m = StepTimeModel([(1, 0.010), (8, 0.010), (16, 0.020)])
    assert m.predict(1) == m.predict(0) == 0.010  # flat below the first bucket
    assert m.predict(12) == pytest.approx(0.015)
    assert m.predict(32) == pytest.approx(0.040)  # the last slope goes on


def test_steps_past_the_measured_range_learn_the_slope_there():
    """A start-up measurement cut short at 8 tokens, steep at its end (8 -> 0.45 s, 60 ms a token beyond); steps of
    16 and 24 tokens really cost 0.50 and 0.55 s. Extrapolating would keep overestimating them by 40-60%."""
    m = StepTimeModel([(1, 0.12), (4, 0.21), (8, 0.45)], rate=0.1, up_rate=0.02)
    assert m.predict(24) == pytest.approx(1.41)
    for _ in range(100):
        m.observe(16, 0.50)
        m.observe(24, 0.55)
    assert m.tokens == [1, 4, 8, 16]  # 24 < 2 x 16: no bucket of its own
    assert m.predict(16) == pytest.approx(0.50, rel=0.05) and m.predict(24) == pytest.approx(0.55, rel=0.1)
    assert m.predict(8) == pytest.approx(0.45, rel=0.05)


def test_step_time_is_refreshed_online_and_stays_monotone():
    m = StepTimeModel([(1, 0.010), (8, 0.020), (16, 0.030)], rate=0.5)
    m.observe(8, 0.040)  # on a bucket: that bucket's EWMA
    assert m.seconds == pytest.approx([0.010, 0.030, 0.030])
    m.observe(12, 0.040)  # between buckets: both neighbours, by their interpolation weights
    assert m.seconds == pytest.approx([0.010, 0.0325, 0.0325])
    m.observe(4, 0.001)  # a noisy fast step may dent the fit but never the prediction's order
    assert all(m.predict(n) <= m.predict(n + 1) for n in range(1, 40))


def test_step_times_stay_positive_when_steps_are_far_faster_than_the_fit():
    m = StepTimeModel([(1, 1.0), (8, 1.05), (32, 1.3)], rate=0.5)  # scaled from a long prefill
    for _ in range(20):
        m.observe(1, 0.01)  # decodes: the 1-token bucket falls to about 0.01
        m.observe(6, 0.012)  # verify passes: far below the 1..8 interpolation
    assert min(m.seconds) > 0 and m.predict(1) > 0
    m.observe(1, 0.01)  # an edge observation divides by predict(1)


def test_min_slope_bounds_every_later_prediction():
    rng = random.Random(1)
    for _ in range(20):
        m = StepTimeModel([(n, rng.uniform(0.01, 0.05)) for n in rng.sample(range(1, 64), 5)], rate=0.5)
        for _ in range(10):
            m.observe(rng.randint(1, 80), rng.uniform(0.005, 0.08))
        for n in range(0, 90):
            for d in (1, 2, 7, 50):
                assert m.predict(n + d) >= m.predict(n) + d * m.min_slope(n) - 1e-12


def test_step_time_converges_to_a_new_curve():
    m = make_time_model(CURVES["linear"])
    slower = CURVES["concave"]
    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randint(1, 300)
        m.observe(n, slower(n))
    for n in (1, 8, 64, 256):
        assert m.predict(n) == pytest.approx(slower(n), rel=0.05)


def test_what_each_sequence_adds_is_learned_apart_from_the_token_curve():
    """Steps of several sequences cost the one-sequence curve plus s per sequence past the first: the controller
    learns s from them, and the curve stays the one-sequence one (a step of 8 decoding requests is not an 8-token
    verify), refreshed by steps of one sequence."""
    curve, s = CURVES["linear"], 0.0008
    c = make_controller(time_model=make_time_model(curve))
    rng = random.Random(0)
    for _ in range(2000):
        n, seqs = rng.randint(1, 48), rng.choice([1, 1, 2, 4, 8])
        seqs = min(seqs, n)
        c.observe_step(n, curve(n) + s * (seqs - 1) + rng.uniform(0, 0.0002), seqs)
    assert c.seq_seconds == pytest.approx(s, rel=0.2)
    for n in (1, 6, 16, 40):
        assert c.step_time.predict(n) == pytest.approx(curve(n), rel=0.05)


def test_per_sequence_cost_makes_drafts_pay_beside_many_decoding_requests():
    """8 requests whose drafts pass at 0.7: priced as one sequence's 8 tokens alone (14 ms), a draft (1.5 ms) pays
    only above 0.86; with the 0.8 ms each request past the first adds (19.6 ms), above 0.61: it pays, as the brute-force
    optimum over the true cost says."""
    curve = lambda n: 0.002 + 0.0015 * n  # noqa: E731
    ids = [f"r{i}" for i in range(8)]
    c = make_controller(prior=(0.7,), k=1, time_model=make_time_model(curve))
    assert c.choose(ids, [1] * 8) == [0] * 8
    c.seq_seconds = 0.0008
    ks = c.choose(ids, [1] * 8)
    gains = [[0.7]] * 8
    assert ks == [1] * 8
    assert rate_of(ks, gains, curve, overhead=0.0008 * 7) == pytest.approx(brute_force(gains, curve, overhead=0.0056))


def test_what_verifying_adds_to_a_step_of_several_sequences_is_learned_apart_from_s():
    """Steps of several sequences that verify drafts cost j more than those that do not: s is learned from the plain
    ones and j from the others, and one sequence's steps teach neither (its jump is in the curve)."""
    curve, s, j = CURVES["linear"], 0.0008, 0.0015
    c = make_controller(time_model=make_time_model(curve))
    rng = random.Random(0)
    for _ in range(3000):
        n, seqs, drafted = rng.randint(2, 48), rng.choice([1, 2, 4, 8]), rng.random() < 0.3
        seqs = min(seqs, n)
        seconds = curve(n) + s * (seqs - 1) + (j if drafted and seqs > 1 else 0.0) + rng.uniform(0, 0.0002)
        c.observe_step(n, seconds, seqs, drafted=drafted)
    assert c.seq_seconds == pytest.approx(s, rel=0.2)
    assert c.verify_seconds == pytest.approx(j, rel=0.2)


def test_a_verify_jump_keeps_drafts_that_cannot_repay_it_off_beside_other_requests():
    """16 requests whose drafts pass at 0.05, on a curve where drafts are nearly free (an H200's): without j the
    controller drafts for all of them; once it has learned that verifying costs 1.5 ms more, for none. One request
    alone is priced by the curve, whatever j is."""
    curve = lambda n: 0.0076 + 0.00001 * n  # noqa: E731
    ids = [f"r{i}" for i in range(16)]
    c = make_controller(prior=(0.05,), k=1, time_model=make_time_model(curve, points=range(1, 81)))
    assert c.choose(ids, [1] * 16) == [1] * 16
    c.verify_seconds = 0.0015
    assert c.choose(ids, [1] * 16) == [0] * 16
    assert c.choose(ids[:1], [1]) == [1]


def test_a_stalled_step_of_many_sequences_moves_the_per_sequence_cost_little():
    c = make_controller()
    c.observe_step(8, 60.0, num_seqs=8)  # descheduled for a minute
    c.observe_step(1000, 2 * c.step_time.predict(1000), num_seqs=2)  # a prefill chunk beside a decode, slowed 2x
    assert c.seq_seconds < 0.1 * c.step_time.predict(1)


def test_step_time_trusts_fast_steps_more_than_slow_ones():
    m = StepTimeModel([(1, 0.010), (8, 0.020)], rate=0.1, up_rate=0.02)
    for _ in range(3):
        m.observe(8, 0.060)  # a few steps slowed by another process
    assert m.predict(8) < 0.0225
    for _ in range(30):
        m.observe(8, 0.012)  # the step really got cheaper
    assert m.predict(8) == pytest.approx(0.012, rel=0.1)
    for _ in range(300):
        m.observe(8, 0.030)  # ... and a lasting rise is still learned, slowly
    assert m.predict(8) == pytest.approx(0.030, rel=0.05)


def test_one_stalled_step_cannot_move_the_fit_far():
    m = StepTimeModel([(1, 0.010), (8, 0.020)], rate=0.1, up_rate=0.02)
    m.observe(1, 60.0)  # the engine sat idle between two runs, or the process was descheduled
    assert m.predict(1) <= 0.010 * (1 + 0.02)
    assert m.predict(8) == pytest.approx(0.020)


def test_step_time_needs_two_token_counts():
    with pytest.raises(ValueError):
        StepTimeModel([(4, 0.01), (4, 0.02)])


# --- config -----------------------------------------------------------------------------------------------------

def test_config_defaults_and_vllm_lookup_filling():
    c = SpeculativeConfig(method="ngram")
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max, c.policy) == (8, 1, 5, "adaptive")
    assert SpeculativeConfig(method="ngram", prompt_lookup_max=3).prompt_lookup_min == 3
    assert SpeculativeConfig(method="ngram", prompt_lookup_min=4).prompt_lookup_max == 4
    assert SpeculativeConfig(method="suffix").prompt_lookup_min is None
    d = SpeculativeConfig.from_json('{"method": "ngram", '
                                    '"num_speculative_tokens_per_batch_size": [[9, 16, 1], [1, 8, 3]]}')
    assert d.policy == "table" and d.num_speculative_tokens_per_batch_size == ((1, 8, 3), (9, 16, 1))
    assert SpeculativeConfig(method="draft_model", model="/m").model == "/m"
    assert SpeculativeConfig(method="layer_skip", num_layers=4).num_layers == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.method = "suffix"


def test_the_draft_cap_defaults_to_8_where_the_controller_picks_free_drafts_else_5():
    """ngram and suffix under the adaptive policy may draft up to 8 (the controller decides each step; their drafts
    cost no forward); a fixed k, a table, or a draft model's forwards keep vLLM's usual 5; a given cap stays."""
    def cap(**fields) -> int:
        return SpeculativeConfig(**fields).num_speculative_tokens

    assert cap(method="ngram") == cap(method="suffix") == cap(method="suffix", policy="adaptive") == 8
    assert cap(method="ngram", policy="fixed") == cap(method="suffix", policy="fixed") == 5
    assert cap(method="ngram", num_speculative_tokens_per_batch_size=[[1, 4, 5]]) == 5
    assert cap(method="draft_model", model="/m") == cap(method="layer_skip") == 5
    assert cap(method="ngram", num_speculative_tokens=3) == cap(method="draft_model", model="/m",
                                                                num_speculative_tokens=3) == 3


TABLE = "num_speculative_tokens_per_batch_size"


@pytest.mark.parametrize("fields, param", [
    ({"method": "medusa"}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ({"method": "ngram", "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "suffix", "prompt_lookup_min": 2}, "prompt_lookup_min"),
    ({"method": "draft_model"}, "model"),
    ({"method": "ngram", "model": "/m"}, "model"),
    ({"method": "ngram", "num_layers": 2}, "num_layers"),
    ({"method": "layer_skip", "num_layers": 0}, "num_layers"),
    ({"method": "ngram", "policy": "greedy"}, "policy"),
    ({"method": "ngram", "policy": "table"}, TABLE),
    ({"method": "ngram", "policy": "fixed", TABLE: [[1, 4, 2]]}, TABLE),
    ({"method": "ngram", TABLE: [[1, 8, 2], [8, 9, 1]]}, TABLE),
    ({"method": "ngram", TABLE: [[1, 8, 6]]}, TABLE),
    ({"method": "ngram", TABLE: [[4, 2, 1]]}, TABLE),
    ({"method": "ngram", TABLE: [[1, 2]]}, TABLE),
    ({"method": "ngram", TABLE: []}, TABLE),
    ({"method": "ngram", "speculative_model": "x", "typo": 1}, "speculative_model"),
    ({"method": "ngram", "suffix_decoding_max_tree_depth": 8}, "suffix_decoding_max_tree_depth"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 1}, "suffix_decoding_max_tree_depth"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": "high"}, "suffix_decoding_min_token_prob"),
    ({"num_speculative_tokens": 3}, "method"),
])
def test_config_errors_name_the_field(fields, param):
    with pytest.raises(InvalidParameterError) as info:
        SpeculativeConfig.from_dict(fields)
    assert info.value.param == param
    assert param in str(info.value)


def test_config_suffix_settings_reach_the_proposer_with_vllms_names():
    config = SpeculativeConfig.from_json('{"method": "suffix", "suffix_decoding_max_tree_depth": 8, '
                                         '"suffix_decoding_max_cached_requests": 0, '
                                         '"suffix_decoding_max_spec_factor": 2, "suffix_decoding_min_token_prob": 0.3}')
    proposer = Speculator(config).proposer
    assert (proposer.max_depth, proposer.max_match, proposer.max_cached_requests) == (8, 7, 0)
    assert (proposer.max_spec_factor, proposer.min_token_prob) == (2, 0.3)
    proposer.finish("a", [10, 11, 12, 13])  # no cross-request memory: the next request learns nothing from it
    assert proposer.propose("b", [1, 10, 11], 4) == [] and proposer.shared.num_nodes == 1
    default = Speculator(SpeculativeConfig(method="suffix")).proposer
    assert (default.max_depth, default.max_match, default.max_cached_requests) == (24, 16, 1000)


def test_config_json_errors():
    for text in ("{not json", "[1, 2]"):
        with pytest.raises(InvalidParameterError) as info:
            SpeculativeConfig.from_json(text)
        assert info.value.param == "speculative_config"
