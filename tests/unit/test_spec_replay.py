"""Speculation replayed on recorded greedy outputs (banyan/bench/spec_replay.py): the step counts and times it
reports, and its two ceilings, on traces whose answers can be worked out by hand."""

import random

import pytest

from banyan.bench.spec_replay import (
    Trace,
    best_step,
    longest_found,
    replay,
    replay_best_k,
    replay_copy_oracle,
    replay_evidence_k,
    replay_hindsight_evidence_k,
)
from banyan.spec import make_proposer
from banyan.spec.config import SpeculativeConfig
from banyan.spec.controller import EVIDENCE_BUCKETS
from banyan.spec.verify import greedy_accepted


def cheap(n):
    """A step curve where each verified draft costs 1% of a decode: drafting what passes always pays."""
    return 1.0 + 0.01 * (n - 1)


def ngram(policy="fixed", k=3):
    return SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k, "policy": policy})


def copy_trace(n=41):
    """A prompt the output repeats token for token (its first token came from the prefill)."""
    text = list(range(100, 100 + n))
    return Trace(prompt=[7] + text, output=text)


def test_a_greedy_request_keeps_the_longest_agreeing_prefix():
    assert greedy_accepted([1, 2, 3], [1, 2, 4, 5]) == 2
    assert greedy_accepted([9], [1]) == 0 and greedy_accepted([], [1]) == 0
    assert greedy_accepted([1, 2, 3], [1, 2]) == 2  # the output ends first


def test_longest_found_looks_for_a_contiguous_run_anywhere():
    history = [5, 1, 2, 3, 9, 1, 2, 4]
    assert longest_found(history, [1, 2, 3, 8]) == 3
    assert longest_found(history, [1, 2, 4, 5]) == 3
    assert longest_found(history, [6, 1]) == 0


def test_best_step_drafts_what_pays_and_ties_go_to_fewer():
    assert best_step(3, cheap) == 3
    assert best_step(3, lambda n: float(n)) == 0  # each draft costs a whole step: never better, so none
    assert best_step(0, cheap) == 0


def test_an_exact_copy_drafts_k_every_step_and_its_ratio_is_the_step_arithmetic():
    trace = copy_trace()  # 40 tokens to decode after the prefill's
    oracle = replay_copy_oracle([trace], max_k=3, step_seconds=cheap)
    # 4 tokens a step (3 drafts + the target's own): 10 steps
    assert oracle.steps == {3: 10}
    assert oracle.ratio == pytest.approx(40 * cheap(1) / (10 * cheap(4)))
    fixed = replay([trace], ngram(), cheap)  # the lookup finds the copy from the first token on
    assert fixed.steps == oracle.steps and fixed.ratio == oracle.ratio
    assert fixed.accepted == fixed.drafted == 30 and fixed.mean_accepted_len == 4.0


def test_nothing_to_copy_means_no_drafts_for_the_ceilings():
    rng = random.Random(0)
    trace = Trace(prompt=[rng.randrange(1000, 2000) for _ in range(30)], output=list(range(40)))
    for result in (replay_copy_oracle([trace], 5, cheap),
                   replay_best_k([trace], make_proposer("ngram", prompt_lookup_min=2, prompt_lookup_max=5), 5, cheap)):
        assert result.steps == {0: 39} and result.ratio == 1.0


def test_best_k_never_drafts_a_token_that_fails():
    rng = random.Random(1)
    prompt = [rng.randrange(50) for _ in range(200)]
    trace = Trace(prompt, prompt[40:60] + [rng.randrange(50) for _ in range(20)] + prompt[100:120])
    result = replay_best_k([trace], make_proposer("ngram"), 5, cheap)
    assert result.accepted == result.drafted > 0
    adaptive = replay([trace], ngram("adaptive", 5), cheap)
    assert result.ratio >= adaptive.ratio > 1.0


def test_a_k_per_evidence_bucket_in_hindsight_lies_between_the_best_single_k_and_best_k():
    rng = random.Random(1)
    prompt = [rng.randrange(50) for _ in range(200)]
    trace = Trace(prompt, prompt[40:60] + [rng.randrange(50) for _ in range(20)] + prompt[100:120])
    make = lambda: make_proposer("ngram")  # noqa: E731
    result, ks = replay_hindsight_evidence_k([trace], make, 5, cheap)
    assert set(ks) == set(EVIDENCE_BUCKETS) and all(0 <= k <= 5 for k in ks.values())
    assert result.ratio == replay_evidence_k([trace], make, ks, cheap).ratio  # the replay of the map it chose
    single = max(replay_evidence_k([trace], make, dict.fromkeys(EVIDENCE_BUCKETS, k), cheap).ratio for k in range(6))
    assert single <= result.ratio <= replay_best_k([trace], make(), 5, cheap).ratio
    assert result.accepted < result.drafted  # a fixed k drafts past what passes where best k would not


def test_k_per_evidence_bucket_drafts_nothing_where_no_draft_can_pay():
    result, ks = replay_hindsight_evidence_k([copy_trace()], lambda: make_proposer("ngram"), 3, lambda n: float(n))
    assert set(ks.values()) == {0} and result.steps == {0: 40} and result.ratio == 1.0
    copied, _ = replay_hindsight_evidence_k([copy_trace()], lambda: make_proposer("ngram"), 3, cheap)
    assert copied.steps == replay_copy_oracle([copy_trace()], 3, cheap).steps  # all of it passes: k 3 every step


def test_drafts_reach_as_far_as_max_tokens_allows():
    trace = copy_trace(9)
    assert trace.room(1) == 7  # 9 tokens, 1 emitted: 8 left, less the target's own
    assert Trace(trace.prompt, trace.output, max_tokens=20).room(1) == 18
    short = replay([Trace(trace.prompt, trace.output)], ngram(k=5), cheap)
    assert short.steps == {5: 1, 1: 1}  # 8 tokens to decode: 6, then the last 2 (the output's end is its max_tokens)
