"""The Engine's own verbs, as the core process and the offline LLM use them: abort hands back the last
deltas, stats() is everything EngineStats reports, and test faults come in through `before_step`."""

from __future__ import annotations

import pytest

from banyan import LLM, SamplingParams
from banyan.engine.faults import GRAMMAR_FAULT, Fault
from banyan.errors import ErrorInfo
from tests.factories import write_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_engine_facade")
    write_model_dir(path, "llama", seed=3)
    return path


@pytest.fixture
def engine(model_dir):
    llm = LLM(str(model_dir), block_size=4, num_pages=64, num_threads=1)
    yield llm.engine
    llm.engine.close()


def params(max_tokens=20, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_abort_returns_the_last_delta_of_each_running_request(engine):
    engine.add_request("a", [5, 6, 7, 8, 9], params(logprobs=1))
    engine.add_request("b", [5, 6, 7], params())
    engine.step()
    engine.step()
    deltas = engine.abort_requests(["a", "unknown"])
    assert [(d.request_id, d.finish_reason, d.new_token_ids, d.error) for d in deltas] == [("a", "abort", [], None)]
    assert deltas[0].new_logprobs == []  # every token was reported already
    assert engine.abort_requests(["a"]) == []  # finished: nothing to report twice
    assert engine.unfinished_request_ids() == ["b"]
    assert [d.finish_reason for d in engine.abort_requests(engine.unfinished_request_ids())] == ["abort"]
    assert engine.stats().kv_usage == 0.0  # their pages are free, or cached and held by no one
    engine.kv.check_integrity()


def test_stats_report_load_cache_and_counters(engine):
    idle = engine.stats()
    assert (idle.num_running, idle.num_waiting, idle.kv_usage, idle.num_pages) == (0, 0, 0.0, engine.num_pages)
    assert (idle.prefix_query_tokens, idle.grammar_cache_entries) == (0, 0)
    prompt = list(range(10, 30))
    engine.add_request("first", prompt, params(max_tokens=2))
    engine.add_request("second", prompt, params(max_tokens=2))
    engine.step()
    busy = engine.stats()
    assert busy.num_running + busy.num_waiting == 2 and busy.kv_usage > 0
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("third", prompt, params(max_tokens=2))
    engine.step()
    after = engine.stats()
    assert after.prefix_query_tokens == 3 * len(prompt) and after.prefix_hit_tokens >= 16  # whole pages reused


def test_a_before_step_hook_runs_before_each_step(engine):
    engine.before_step.append(Fault.parse("raise-after-steps=2"))
    engine.add_request("a", [5, 6, 7], params())
    engine.step()
    with pytest.raises(RuntimeError, match="injected fault at step 2"):
        engine.step()


def test_the_grammar_fault_ends_constrained_requests_only(engine):
    engine.before_step.append(Fault.parse("grammar-raise-after-tokens=2"))
    engine.add_request("constrained", [5, 6, 7], params(max_tokens=30, structured_outputs={"regex": "[a-z]{20,30}"}))
    engine.add_request("plain", [5, 6, 7], params(max_tokens=8))
    ended = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.finish_reason is not None:
                ended[delta.request_id] = delta
    assert ended["plain"].finish_reason == "length"
    failed = ended["constrained"]
    assert failed.finish_reason == "error" and failed.stop_reason is None
    assert failed.error == ErrorInfo(f"the grammar rejected the output: {GRAMMAR_FAULT}", param="structured_outputs")
