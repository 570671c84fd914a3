"""New prompts that share a prefix nobody has cached yet, added at once, compute it once (the shared-prefix wait,
banyan/scheduler/prefix.py), and each still gets exactly the tokens transformers gives it alone.

A tiny random Llama on disk, pages of 4 tokens; four prompts share a 3-page (12-token) prefix, a fifth shares nothing.
A request waits for as little as one page here (shared_prefix_wait_tokens=4; the default is 32 tokens).
"""

from __future__ import annotations

import random

import pytest

from banyan import LLM, SamplingParams
from tests.factories import reference_greedy, write_model_dir

MAX_NEW = 6
SHARED = 12
OWN_LENGTHS = [9, 5, 7, 11]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_shared_prefix")
    model = write_model_dir(path, "llama", seed=3)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(SHARED)]
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in OWN_LENGTHS]
    prompts.append([rng.randrange(3, vocab) for _ in range(15)])  # the unrelated one
    return path, prompts, [reference_greedy(model, p, MAX_NEW) for p in prompts]


def make_llm(path, **kw):
    kw.setdefault("shared_prefix_wait_tokens", 4)
    return LLM(str(path), num_threads=1, block_size=4, **kw)


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def computed_prompt_tokens(llm):
    stats = llm.engine.stats()
    return stats.prefix_query_tokens - stats.prefix_hit_tokens


def generate(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(),
                                                         use_tqdm=False)]


# 11: the leader computes its 21 tokens in 2 steps, the second with room left that the others must not take early
@pytest.mark.parametrize("budget", [2048, 11], ids=["one-step-prefill", "chunked-prefill"])
def test_the_shared_prefix_is_computed_once(tiny, budget):
    path, prompts, expected = tiny
    llm = make_llm(path, max_num_batched_tokens=budget)
    assert generate(llm, prompts) == expected
    assert computed_prompt_tokens(llm) == sum(map(len, prompts)) - SHARED * (len(OWN_LENGTHS) - 1)
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.stats().num_in_use == 0


def test_without_the_wait_each_prompt_computes_it(tiny):
    path, prompts, expected = tiny
    llm = make_llm(path, shared_prefix_wait_tokens=0)
    assert generate(llm, prompts) == expected
    assert computed_prompt_tokens(llm) == sum(map(len, prompts))


def run_engine(engine, prompts, abort_after_first_step=()):
    """Add every prompt at once, step to the end; returns the ids that got tokens in the first step, and each
    request's tokens."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy())
    got = {str(i): [] for i in range(len(prompts))}
    first = engine.step()
    engine.abort_requests(abort_after_first_step)
    for delta in first:
        got[delta.request_id] += delta.new_token_ids
    while engine.has_unfinished_requests():
        for delta in engine.step():
            got[delta.request_id] += delta.new_token_ids
    engine.kv.check_integrity()
    assert engine.kv.stats().num_in_use == 0
    return {d.request_id for d in first}, [got[str(i)] for i in range(len(prompts))]


def test_the_unrelated_prompt_is_not_delayed(tiny):
    path, prompts, expected = tiny
    first, outputs = run_engine(make_llm(path).engine, prompts)
    assert first == {"0", "4"}  # the leader and the unrelated prompt; the others wait one step for the pages
    assert outputs == expected


def test_an_aborted_leader_hands_over_to_the_next_in_line(tiny):
    path, prompts, expected = tiny
    engine = make_llm(path, max_num_batched_tokens=10).engine
    first, outputs = run_engine(engine, prompts, abort_after_first_step=["0"])
    assert first == set()  # the leader is mid-prompt: 2 of the 3 shared pages computed
    assert outputs[1:] == expected[1:]
    # the next in line took the 2 pages the leader left and computed the third; the others took all three
    assert engine.stats().prefix_hit_tokens == 8 + SHARED + SHARED


def test_with_preemption(tiny):
    path, prompts, expected = tiny
    llm = make_llm(path, num_pages=14, max_num_batched_tokens=8)
    assert generate(llm, prompts) == expected
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert llm.engine.scheduler.stats.prefix_hit_tokens == SHARED * (len(OWN_LENGTHS) - 1)
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.stats().num_in_use == 0
