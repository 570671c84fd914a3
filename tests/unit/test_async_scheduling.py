"""Async scheduling (engine/overlap.py): step N+1 is scheduled and launched before step N's sampled ids are read.

On a CPU the device is the host, so nothing overlaps in time, but every part of the order runs: placeholders for
the tokens in flight, the gather that fills them, stop checks one step late, rows of requests that ended dropped,
preemption and abort of requests whose token is in flight. The specification: the same tokens as the plain engine
(greedy and seeded, with penalties and min_tokens), the same one counted read of the ids per step, no page leaked;
requests that need their token on the host at once (logprobs, prompt logprobs, structured output) and embeddings
answer as in the plain engine; speculative decoding turns it off."""

from __future__ import annotations

import logging
import random
import time

import pytest

from banyan import LLM, LoRARequest
from banyan.cli import build_parser
from banyan.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from banyan.config_args import config_from_kwargs, engine_config, engine_flags
from banyan.engine.engine import Engine
from banyan.kernels import cpu_gemv
from banyan.pooling_params import PoolingParams
from banyan.sampling_params import SamplingParams
from banyan.structured import GrammarCache
from banyan.spec.config import SpeculativeConfig
from tests.factories import write_model_dir
from tests.lora_factories import write_adapter
from tests.unit.test_host_reads import TensorReads

VOCAB_TOP = 300  # prompt ids in [3, VOCAB_TOP) of the tiny vocabulary (384)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    write_model_dir(path, "llama", seed=2)
    return path


def make_engine(model_dir, async_scheduling: bool, num_pages: int = 64, batch_invariant: bool | None = None,
                **config) -> Engine:
    """Small pages and a 24-token budget: prompts come in chunks beside decode rows; 4 seats: requests queue."""
    return Engine(EngineConfig(model=ModelConfig(model=str(model_dir), device="cpu", dtype="float32", num_threads=1,
                                                 batch_invariant=batch_invariant),
                               cache=CacheConfig(num_pages=num_pages, block_size=4),
                               scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24,
                                                         async_scheduling=async_scheduling),
                               **config))


def workload(stop_tokens: dict[int, int] | None = None) -> list[tuple[list[int], SamplingParams]]:
    """8 requests: prompts of 3 to 56 tokens, three sharing a 16-token prefix (prefix hits), 1 to 13 new tokens,
    greedy and seeded sampling with penalties, min_tokens and a logit bias; request i stops at stop_tokens[i]."""
    rng = random.Random(0)
    shared = [rng.randrange(3, VOCAB_TOP) for _ in range(16)]
    requests = []
    for i in range(8):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(3, VOCAB_TOP) for _ in range(rng.randrange(3, 40))]
        stop = [stop_tokens[i]] if stop_tokens and i in stop_tokens else []
        params = SamplingParams(temperature=0.0 if i % 2 else 0.9, top_p=0.9, seed=i, max_tokens=rng.randrange(1, 14),
                                ignore_eos=True, stop_token_ids=stop, repetition_penalty=1.2 if i == 3 else 1.0,
                                presence_penalty=0.5 if i == 4 else 0.0, min_tokens=3 if i == 5 else 0,
                                logit_bias={7: 3.0} if i == 6 else None)
        requests.append((prompt, params))
    return requests


def run(engine: Engine, requests, abort: dict[int, list[str]] | None = None):
    """Every request's tokens and finish reason, each step's counted reads, and whether a step was left in flight.
    abort: after step k, abort these request ids."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    tokens, reasons, reads, overlapped, step = {}, {}, [], False, 0
    while engine.has_unfinished_requests():
        deltas = engine.step()
        step += 1
        deltas += engine.abort_requests((abort or {}).get(step, []))
        for delta in deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                assert delta.request_id not in reasons, "a request finished twice"
                reasons[delta.request_id] = delta.finish_reason
        reads.append(engine.runner.to_host.step)
        overlapped |= engine.overlap is not None and engine.overlap.pending is not None
    return tokens, reasons, reads, overlapped


def assert_no_page_leaked(engine: Engine) -> None:
    engine.kv.check_integrity()
    assert engine.kv.stats().num_in_use == 0
    engine.kv.reset_prefix_cache()
    assert engine.kv.stats().num_free == engine.num_pages


def stops_from_a_plain_run(model_dir) -> dict[int, int]:
    """For requests 1, 2 and 7, a token they emit midway: a stop there ends them before their max_tokens, as an EOS."""
    tokens, *_ = run(make_engine(model_dir, False), workload())
    return {i: tokens[f"r{i}"][len(tokens[f"r{i}"]) // 2] for i in (1, 2, 7) if len(tokens[f"r{i}"]) >= 3}


@pytest.mark.parametrize("num_pages", [64, 16], ids=["roomy", "preempting"])
def test_same_tokens_as_the_plain_engine(model_dir, num_pages):
    stops = stops_from_a_plain_run(model_dir)
    assert len(stops) == 3
    requests = workload(stops)
    plain, overlapped = make_engine(model_dir, False, num_pages), make_engine(model_dir, True, num_pages)
    want_tokens, want_reasons, want_reads, _ = run(plain, requests)
    tokens, reasons, reads, in_flight = run(overlapped, requests)
    assert in_flight, "no step was left in flight"
    assert tokens == want_tokens and reasons == want_reasons
    assert [reasons[f"r{i}"] for i in stops] == ["stop"] * len(stops)
    assert all(step in ([], ["sampled ids"]) for step in reads)  # one counted read a step at most
    if num_pages == 64:  # the same sampling steps, each read once
        assert sum(map(len, reads)) == sum(map(len, want_reads))
    else:  # requests whose token was in flight were preempted, kept it, and came back
        assert overlapped.scheduler.stats.num_preemptions > 0
    assert_no_page_leaked(overlapped)


def test_one_counted_read_a_step(model_dir):
    """Every read is the counted one, once a step: the step before's ids, one step later than the plain engine."""
    requests = [([random.Random(i).randrange(3, VOCAB_TOP) for _ in range(5)],
                 SamplingParams(temperature=0.0, max_tokens=3 + i, ignore_eos=True)) for i in range(3)]
    seen = []
    for async_scheduling in (False, True):
        engine = make_engine(model_dir, async_scheduling)
        with TensorReads() as reads:
            _, _, counted, _ = run(engine, requests)
        assert len(reads.names) == sum(map(len, counted)), f"uncounted reads: {reads.names} against {counted}"
        seen.append(counted)
    plain, overlapped = seen
    assert overlapped == [[]] + plain  # the first step reads nothing; the last only settles
    assert all(step == ["sampled ids"] for step in plain)


def test_aborts_while_a_token_is_in_flight(model_dir):
    """An abort drops the aborted request's token in flight (never reported) and frees its pages at once; the others
    go on as in the plain engine, and an engine aborted whole serves the next request."""
    requests = workload()
    abort = {3: ["r0", "r1"], 6: ["r4"]}
    want, *_ = run(make_engine(model_dir, False), requests, abort)
    engine = make_engine(model_dir, True)
    got, *_ = run(engine, requests, abort)
    assert sum(len(want[r]) - len(got[r]) for r in ("r0", "r1", "r4")) >= 1  # a token in flight was dropped
    for request_id in want:
        if request_id in ("r0", "r1", "r4"):
            assert want[request_id][: len(got[request_id])] == got[request_id]
            assert len(want[request_id]) - len(got[request_id]) <= 1
        else:
            assert got[request_id] == want[request_id]
    assert_no_page_leaked(engine)
    everything = {2: [f"r{i}" for i in range(8)]}  # all in flight at once: the engine stops with a step unread
    run(engine, workload(), everything)
    assert engine.overlap.pending is not None and engine.kv.stats().num_in_use == 0
    alone, *_ = run(make_engine(model_dir, False), workload()[:1])
    tokens, *_ = run(engine, workload()[:1])
    assert tokens == alone


@pytest.mark.parametrize("slow_grammar", [False, True])
def test_requests_that_need_their_token_at_once_answer_as_plain(model_dir, monkeypatch, slow_grammar):
    """logprobs, prompt logprobs, structured output and embeddings make their steps synchronous; beside plain
    requests, which stay in flight, every answer equals the plain engine's. Batch-invariant where banyan's kernels
    are built (off by default on CPUs with AMX): the grammar compiles in the background, so which rows share a step
    can differ between the two runs (slow_grammar: the async run's takes 0.3 s), and without invariance a row's last
    bits (an embedding's, a logprob's) follow the rows beside it (an embedding differed so in a CI run under load)."""
    invariant = True if cpu_gemv.load() is not None else None
    if slow_grammar and invariant is None:
        pytest.skip("needs banyan's CPU kernels (batch invariance)")
    compile_grammar = GrammarCache._compile
    greedy = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    params = [SamplingParams(**greedy), SamplingParams(**greedy, logprobs=2), SamplingParams(**greedy, prompt_logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=6, structured_outputs={"regex": "[a-z]+"}),
              SamplingParams(temperature=0.7, seed=5, max_tokens=9, ignore_eos=True)]
    prompts = [[random.Random(i).randrange(3, VOCAB_TOP) for _ in range(4 + 3 * i)] for i in range(len(params))]
    answers = []
    for async_scheduling in (False, True):
        if slow_grammar and async_scheduling:
            monkeypatch.setattr(GrammarCache, "_compile", lambda self, *a: time.sleep(0.3) or compile_grammar(self, *a))
        engine = make_engine(model_dir, async_scheduling, batch_invariant=invariant)
        requests = [engine.add_request(f"r{i}", p, s) for i, (p, s) in enumerate(zip(prompts, params))]
        requests.append(engine.add_request("embed", prompts[-1], SamplingParams(), pooling_params=PoolingParams()))
        while engine.has_unfinished_requests():
            engine.step()
        answers.append([(list(r.output_token_ids), r.finish_reason, r.logprobs, r.prompt_logprobs, r.cumulative_logprob,
                         r.embedding) for r in requests])
        assert_no_page_leaked(engine)
    assert answers[1] == answers[0]


def test_lora_adapters_taking_turns_in_their_slots(tmp_path):
    """Three adapters for two slots: a request's adapter is forgotten at settle, one step later than in the plain
    engine, while its last row may still run; every output is the plain engine's."""
    base = write_model_dir(tmp_path / "model", "llama", seed=1)
    adapters = [None]
    for i, rank in enumerate((8, 4, 8)):
        write_adapter(tmp_path / f"a{i}", base, rank=rank, alpha=8, seed=i + 1)
        adapters.append(LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}")))
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, VOCAB_TOP) for _ in range(rng.randint(5, 30))]} for _ in range(8)]
    params = [SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=4 + i, ignore_eos=True) for i in range(8)]
    outputs = []
    for async_scheduling in (False, True):
        llm = LLM(str(tmp_path / "model"), block_size=4, num_threads=1, enable_lora=True, max_loras=2, max_lora_rank=8,
                  max_num_seqs=3, async_scheduling=async_scheduling)
        got = llm.generate(prompts, params, use_tqdm=False, lora_request=adapters * 2)
        outputs.append([o.outputs[0].token_ids for o in got])
        assert_no_page_leaked(llm.engine)
    assert outputs[1] == outputs[0]


def test_stop_strings_end_requests_as_plain(model_dir):
    """A stop string is checked on text by the frontend, which aborts the request: its token in flight is dropped."""
    prompts = [[random.Random(i).randrange(3, VOCAB_TOP) for _ in range(6)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(model_dir), num_threads=1, block_size=4, num_pages=64)
    texts = [o.outputs[0].text for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    stops = params.clone(stop=[text[4:7] for text in texts if len(text) > 8][:2])
    outputs = []
    for llm in (plain, LLM(str(model_dir), num_threads=1, block_size=4, num_pages=64, async_scheduling=True)):
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], stops, use_tqdm=False)
        outputs.append([(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in got])
        assert llm.engine.kv.stats().num_in_use == 0
    assert outputs[1] == outputs[0] and any(reason == "stop" for _, reason, _ in outputs[0])


def test_speculative_decoding_turns_it_off(model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="banyan.scheduler.overlap"):
        engine = make_engine(model_dir, True, speculative=SpeculativeConfig("ngram", 3, policy="fixed"))
    assert engine.overlap is None and "async scheduling is off: speculative decoding" in caplog.text


def test_the_serve_flag_and_its_values():
    def parse(*argv):
        return engine_config(build_parser().parse_args(["serve", *argv]))

    assert parse().scheduler.async_scheduling is False
    assert parse("--async-scheduling").scheduler.async_scheduling is True
    assert parse("--async-scheduling", "--no-async-scheduling").scheduler.async_scheduling is False
    assert engine_flags(parse("--async-scheduling")) == ["--async-scheduling"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--async-scheduling=yes"])
    assert config_from_kwargs({"async_scheduling": True}) == parse("--async-scheduling")
