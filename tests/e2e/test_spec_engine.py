"""Speculative decoding in the engine (issue 13): with ngram or suffix drafts, greedy output equals the output
without speculation token for token, however the batch is cut (chunked prefill, prefix hits, preemption, n > 1,
stop strings), the KV cache stays consistent after every step, and k = 0 is the plain path (no verifier call).

One tiny random Llama on disk; prompts repeat a phrase so that the proposers have something to copy.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

import banyan.engine.engine as engine_module
import banyan.spec.verify as spec_verify
from banyan import LLM, SamplingParams
from banyan.errors import InvalidParameterError
from banyan.ipc.core_process import STATS_INTERVAL
from tests.factories import write_model_dir
from tests.server_process import start_server

MAX_NEW = 24
CONFIGS = {
    "ngram-fixed3": {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"},
    "ngram-adaptive": {"method": "ngram", "num_speculative_tokens": 5},
    "suffix-fixed3": {"method": "suffix", "num_speculative_tokens": 3, "policy": "fixed"},
    "suffix-adaptive": {"method": "suffix", "num_speculative_tokens": 5},
    "layer_skip-fixed3": {"method": "layer_skip", "num_speculative_tokens": 3, "policy": "fixed", "num_layers": 1},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_spec")
    model = write_model_dir(path, "llama", seed=1)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    phrase = [rng.randrange(3, vocab) for _ in range(9)]
    prompts = [phrase * 3 + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 4, 9, 13)]
    prompts.append([rng.randrange(3, vocab) for _ in range(20)])  # little to copy
    prompts.append(prompts[2][:24] + [rng.randrange(3, vocab) for _ in range(6)])  # a prefix hit on prompt 2
    return path, prompts


@pytest.fixture
def verify_calls(monkeypatch):
    """Every call of the verifier (its general path or its plain-greedy one), by the drafts it was given."""
    calls = []

    def counting(verifier, drafts_of):
        def call(*args, **kwargs):
            calls.append(drafts_of(args))
            return verifier(*args, **kwargs)
        return call

    monkeypatch.setattr(spec_verify, "verify", counting(spec_verify.verify, lambda args: args[1].shape))
    monkeypatch.setattr(spec_verify, "verify_plain_greedy",
                        counting(spec_verify.verify_plain_greedy, lambda args: [len(d) for d in args[1]]))
    return calls


def generate(path, prompts, params, speculative_config=None, proposer=None, **settings):
    """Outputs per prompt, and the engine, with check_integrity run before every step and after the last;
    proposer: a stand-in for the proposer's propose_with_evidence."""
    settings = {"block_size": 4, "num_threads": 1, "num_pages": 256} | settings  # few pages: integrity checks are fast
    llm = LLM(str(path), speculative_config=speculative_config, **settings)
    engine = llm.engine
    if proposer is not None:
        engine.speculator.proposer.propose_with_evidence = proposer
    if engine.speculator is not None:
        # a tiny model's step is well under a millisecond, so the proposal budget would skip most passes and
        # whether anything is drafted here would hang on timing (the budget has tests of its own)
        engine.speculator.proposal_share = math.inf
    engine.before_step.append(lambda e: e.kv.check_integrity())
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine.kv.check_integrity()
    assert engine.kv.stats().num_in_use == 0  # no page leaks: every request gave its pages back
    return outputs, engine


def greedy(**kw):
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **kw)


def token_ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_with_speculation_equals_without(tiny, name, verify_calls):
    path, prompts = tiny
    plain, _ = generate(path, prompts, greedy())
    assert not verify_calls
    spec, engine = generate(path, prompts, greedy(), CONFIGS[name])
    assert token_ids(spec) == token_ids(plain)
    stats = engine.speculator.stats
    assert verify_calls and stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    proposer = engine.speculator.proposer  # per-request state is dropped at finish (suffix keeps its shared trie)
    assert len(engine.speculator.controller.stats) == 0
    state = {"ngram": "_histories", "suffix": "_local"}.get(name.split("-")[0])
    assert state is None or not getattr(proposer, state)


@pytest.mark.parametrize("name", ["ngram-fixed3", "suffix-adaptive", "layer_skip-fixed3"])
def test_greedy_equal_under_chunking_preemption_n_and_stop_strings(tiny, name):
    path, prompts = tiny
    settings = {"max_num_batched_tokens": 16, "num_pages": 28}  # prompts in chunks; too few pages for all at once
    plain, plain_engine = generate(path, prompts, greedy(n=2), **settings)
    assert plain_engine.scheduler.stats.num_preemptions > 0 and plain_engine.scheduler.stats.prefix_hit_tokens > 0
    text = plain[1].outputs[0].text
    stop_text = text[len(text) // 2 : len(text) // 2 + 3]
    params = [greedy(n=2, stop=[stop_text]) if i == 1 else greedy(n=2) for i in range(len(prompts))]
    plain, _ = generate(path, prompts, params, **settings)
    spec, engine = generate(path, prompts, params, CONFIGS[name], **settings)
    assert [[c.text for c in o.outputs] for o in spec] == [[c.text for c in o.outputs] for o in plain]
    assert token_ids(spec) == token_ids(plain)
    assert spec[1].outputs[0].finish_reason == "stop"
    assert engine.scheduler.stats.num_preemptions > 0 and engine.speculator.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("backend, config", [("llguidance", "ngram-fixed3"), ("xgrammar", "ngram-fixed3"),
                                             ("llguidance", "layer_skip-fixed3"), ("xgrammar", "layer_skip-fixed3")])
def test_structured_output_drafts_are_cut_to_the_grammar_and_verified_under_its_mask(tiny, backend, config):
    """ngram's drafts are cut in the scheduler; a network's (layer_skip), made inside the runner, are verified under
    the grammar up to the first token it refuses. Either way the tokens are the unspeculated ones."""
    path, prompts = tiny
    vocab = LLM(str(path), block_size=4, num_threads=1, num_pages=64).tokenizer
    words = [vocab.decode([t]) for t in prompts[0][:9]]  # the prompts' own repeated phrase: something to copy
    alternatives = "|".join(sorted({w for w in words if w.strip() and w.isprintable()}, key=len)[:4])
    regex = f"(({alternatives}) ?){{6,20}}"
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, structured_outputs={"regex": regex}),
              greedy(), SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                       structured_outputs={"choice": ["yes please", "no thanks"]})]
    settings = {"structured_output_backend": backend}
    plain, _ = generate(path, prompts[:3], params, **settings)
    spec, engine = generate(path, prompts[:3], params, CONFIGS[config], **settings)
    assert token_ids(spec) == token_ids(plain)
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in plain]
    assert spec[2].outputs[0].text in ("yes please", "no thanks")
    constrained = spec[0].metrics
    assert constrained.spec_draft_tokens > 0  # drafted under the grammar, not skipped
    assert engine.speculator.stats.num_accepted_tokens > 0


def test_seeded_sampling_is_reproducible_and_samples_the_plain_tokens(tiny):
    path, prompts = tiny
    params = [SamplingParams(temperature=0.1, top_p=0.9, seed=7 + i, max_tokens=MAX_NEW, ignore_eos=True)
              for i in range(len(prompts))]
    config = CONFIGS["ngram-fixed3"]
    first, engine = generate(path, prompts, params, config)
    second, _ = generate(path, prompts, params, config)
    assert token_ids(first) == token_ids(second)
    assert engine.speculator.stats.num_drafts > 0
    plain, _ = generate(path, prompts, params)  # deterministic drafts: the plain sampler's own draws (verify.py)
    assert token_ids(first) == token_ids(plain)


def logprob_reports(outputs):
    """Per completion and position: the token ids reported (chosen and top) with their ranks and decoded text."""
    return [[sorted((t, lp.rank, lp.decoded_token) for t, lp in position.items()) for position in c.logprobs]
            for o in outputs for c in o.outputs]


def logprob_values(outputs):
    return [[lp.logprob for position in c.logprobs for _, lp in sorted(position.items())] for o in outputs
            for c in o.outputs]


def test_penalties_min_tokens_and_logprobs_are_verified_position_by_position(tiny, verify_calls):
    """Each verify row's processors see the drafts before it (penalties count them, min_tokens counts them as output)
    and the tokens it emits report the logprobs the plain sampler would: the same tokens and reports as without
    speculation, greedy and seeded sampled alike, with drafts made and accepted for every request.

    The drafts are the plain run's own tokens (penalised text rarely repeats, so a lookup would seldom draft what
    passes): a greedy request then keeps every one of them, which it does only if each row applies its penalties
    and min_tokens as the plain sampler did at that position."""
    path, prompts = tiny
    plain_text, _ = generate(path, prompts[:1], greedy())
    stop = plain_text[0].outputs[0].token_ids[3]  # a token the plain run emits early: min_tokens must hold it back
    params = [greedy(presence_penalty=0.5, frequency_penalty=0.3, logprobs=2),
              greedy(repetition_penalty=1.2, logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=12, stop_token_ids=[stop], logprobs=3),
              SamplingParams(temperature=0.7, seed=11, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.1,
                             frequency_penalty=0.2, logprobs=1)]
    plain, _ = generate(path, prompts[:4], params)
    assert not verify_calls
    plain_outputs = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts[:4], plain)}

    def plain_continuation(request_id, token_ids, max_k):
        for prompt, output in plain_outputs.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                return output[done : done + max_k], 0
        return [], 0

    spec, engine = generate(path, prompts[:4], params, CONFIGS["ngram-fixed3"], proposer=plain_continuation)
    assert token_ids(spec) == token_ids(plain)
    for out in spec[:3]:  # greedy: every draft passes
        assert 0 < out.metrics.spec_accepted_tokens == out.metrics.spec_draft_tokens
    assert len(plain[2].outputs[0].token_ids) >= 12  # min_tokens held the stop token back in both runs
    assert [c.cumulative_logprob for o in spec for c in o.outputs] == pytest.approx(
        [c.cumulative_logprob for o in plain for c in o.outputs], abs=1e-3)
    assert logprob_reports(spec) == logprob_reports(plain)
    for got, want in zip(logprob_values(spec), logprob_values(plain)):
        assert got == pytest.approx(want, abs=1e-4)
    assert all(o.metrics.spec_draft_tokens > 0 for o in spec) and verify_calls
    assert engine.speculator.stats.num_accepted_tokens > 0


def test_no_verifier_call_when_the_proposer_has_nothing(tiny, verify_calls, monkeypatch):
    path, prompts = tiny
    plain, off = generate(path, prompts, greedy())
    assert off.speculator is None and off.scheduler.speculator is None
    llm = LLM(str(path), block_size=4, num_threads=1, num_pages=256, speculative_config=CONFIGS["ngram-adaptive"])
    monkeypatch.setattr(llm.engine.speculator.proposer, "propose_with_evidence", lambda *args: ([], 0))
    spec = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert token_ids(spec) == token_ids(plain)
    assert not verify_calls and llm.engine.speculator.stats.num_drafts == 0


@pytest.mark.parametrize("config, field", [
    ({"method": "medusa"}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "suffix", "policy": "sometimes"}, "policy"),
    ({"method": "ngram", "k": 3}, "k"),
    ({"num_speculative_tokens": 3}, "method"),
    ({"method": "ngram", "quantization": "int4"}, "quantization"),
])
def test_bad_config_is_a_typed_error_naming_the_field(config, field):
    with pytest.raises(InvalidParameterError) as e:
        LLM("unused", speculative_config=config)
    assert e.value.param == field


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """Draft models for the tiny target: one layer with the target's tokenizer, and one with another vocabulary."""
    root = tmp_path_factory.mktemp("drafts")
    write_model_dir(root / "small", "llama", seed=5, num_hidden_layers=1)
    write_model_dir(root / "other_vocab", "llama", seed=5, num_hidden_layers=1, tool_template=True)
    return root


@pytest.mark.parametrize("draft", ["target", "small"])
def test_draft_model_greedy_equals_without_under_chunking_and_preemption(tiny, drafts, draft):
    path, prompts = tiny
    draft_path = path if draft == "target" else drafts / draft  # the target itself drafts: everything is accepted
    config = {"method": "draft_model", "model": str(draft_path), "num_speculative_tokens": 3, "policy": "fixed"}
    settings = {"max_num_batched_tokens": 16, "num_pages": 28}
    plain, _ = generate(path, prompts, greedy(n=2), **settings)
    spec, engine = generate(path, prompts, greedy(n=2), config, **settings)
    assert token_ids(spec) == token_ids(plain)
    stats = engine.speculator.stats
    assert engine.scheduler.stats.num_preemptions > 0 and stats.num_drafts > 0
    if draft == "target":  # the draft's own K/V caught up right through prefix hits, skips and preemptions
        assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_draft_model_with_another_vocabulary_is_refused_naming_model(tiny, drafts):
    path, _ = tiny
    for draft in (drafts / "other_vocab", drafts / "missing"):
        with pytest.raises(InvalidParameterError) as e:
            LLM(str(path), block_size=4, num_threads=1,
                speculative_config={"method": "draft_model", "model": str(draft)})
        assert e.value.param == "model"


def test_a_compact_copy_of_the_target_drafts_for_it_in_full_precision(tiny, verify_calls):
    """speculative_config's quantization loads the draft compact (int8) while the target stays float32: greedy
    tokens equal the float32 model's own, and the compact draft's are nearly always right. An unknown one is refused
    naming quantization."""
    path, prompts = tiny
    config = {"method": "draft_model", "model": str(path), "quantization": "int8", "num_speculative_tokens": 3,
              "policy": "fixed"}
    plain, _ = generate(path, prompts, greedy(), quantization="none")
    spec, engine = generate(path, prompts, greedy(), config, quantization="none")
    assert token_ids(spec) == token_ids(plain)
    draft_layers = {type(m).__name__ for m in engine.runner.drafter.model.modules()}
    target_layers = {type(m).__name__ for m in engine.runner.model.modules()}
    assert "QuantizedLinear" in draft_layers and "QuantizedLinear" not in target_layers
    stats = engine.speculator.stats
    assert verify_calls and stats.num_accepted_tokens >= 0.8 * stats.num_draft_tokens > 0
    with pytest.raises(InvalidParameterError) as e:
        LLM(str(path), block_size=4, num_threads=1, speculative_config={**config, "quantization": "int3"})
    assert e.value.param == "quantization"


def test_the_draft_models_kv_counts_in_the_pool(tiny):
    path, _ = tiny
    budget = {"block_size": 4, "num_threads": 1, "kv_cache_memory": 1 << 20}
    alone = LLM(str(path), **budget).engine.runner.num_pages
    llm = LLM(str(path), speculative_config={"method": "draft_model", "model": str(path)}, **budget)
    assert llm.engine.runner.num_pages == alone // 2  # the draft is the target's shape: half the pages each


def test_layer_skip_drafts_with_fewer_layers_than_the_target(tiny):
    path, _ = tiny  # two layers
    with pytest.raises(InvalidParameterError) as e:
        LLM(str(path), block_size=4, num_threads=1, speculative_config={"method": "layer_skip", "num_layers": 2})
    assert e.value.param == "num_layers" and "1 to 1" in str(e.value)


def test_the_step_time_model_learns_from_back_to_back_step_periods(tiny, monkeypatch):
    path, prompts = tiny
    llm = LLM(str(path), block_size=4, num_threads=1, num_pages=256, speculative_config=CONFIGS["ngram-adaptive"])
    assert llm.engine.speculator.controller.step_time.tokens[:3] == [1, 2, 3]  # measured at start-up
    seen = []
    monkeypatch.setattr(llm.engine.speculator, "observe_step", lambda *args: seen.append(args))
    steps = []
    monkeypatch.setattr(llm.engine, "before_step", [lambda e: steps.append(e.scheduler.has_unfinished_requests())])
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)  # ends first, whatever is accepted
    for run in (prompts[:2], prompts[2:4]):  # the pause between two runs is waiting, not a step's cost
        llm.generate([{"prompt_token_ids": p} for p in run], [greedy(), short], use_tqdm=False)
    assert len(seen) == sum(steps) - 2  # every step but each run's last
    assert all(tokens > 0 and seconds > 0 and draft_seconds == 0 for tokens, seconds, draft_seconds, _, _ in seen)  # no network
    assert {seqs for *_, seqs in seen} == {1, 2}  # each step's sequences: two requests, then one left


def test_layer_skip_measures_its_draft_cost_and_verifies_network_drafts(tiny, verify_calls):
    path, prompts = tiny
    outputs, engine = generate(path, prompts[:2], greedy(), CONFIGS["layer_skip-fixed3"])
    assert engine.speculator.controller.draft_seconds > 0  # measured at start-up, refreshed by every step
    stats = engine.speculator.stats
    assert 0 < stats.num_drafts <= stats.num_draft_tokens <= 3 * stats.num_drafts and verify_calls


def test_speculation_counters_add_up_per_request_and_per_position(tiny, monkeypatch, caplog):
    path, prompts = tiny
    monkeypatch.setattr(engine_module, "SPEC_LOG_INTERVAL", 0.0)
    with caplog.at_level(logging.INFO, logger=engine_module.__name__):
        outputs, engine = generate(path, prompts, greedy(), CONFIGS["ngram-fixed3"])
    assert any("acceptance per position [" in r.getMessage() for r in caplog.records)
    stats = engine.speculator.stats
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens <= 3 * stats.num_drafts
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert all(a >= b for a, b in zip(stats.accepted_per_pos, stats.accepted_per_pos[1:]))  # j + 1 needs j
    metrics = [o.metrics for o in outputs]
    assert all(m.spec_accepted_tokens <= m.spec_draft_tokens for m in metrics)
    assert sum(m.spec_draft_tokens for m in metrics) == stats.num_draft_tokens
    assert sum(m.spec_accepted_tokens for m in metrics) == stats.num_accepted_tokens
    snapshot = engine.stats()
    assert (snapshot.spec_num_drafts, snapshot.spec_num_accepted_tokens) == (stats.num_drafts, stats.num_accepted_tokens)
    assert snapshot.spec_accepted_per_pos == stats.accepted_per_pos


SPEC_METRICS = ("banyan:spec_decode_num_drafts", "banyan:spec_decode_num_draft_tokens",
                "banyan:spec_decode_num_accepted_tokens", "banyan:spec_decode_num_accepted_tokens_per_pos")


def test_metrics_endpoint_shows_the_speculation_counters(tiny):
    path, prompts = tiny
    server = start_server(path, "--speculative-config", json.dumps(CONFIGS["ngram-fixed3"]),
                          "--served-model-name", "tiny", "--kv-cache-memory", "16MiB", "--max-model-len", "128")
    try:
        body = {"model": "tiny", "prompt": prompts[0], "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).status_code == 200
        scored = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                            json=body | {"logprobs": 2, "frequency_penalty": 0.3}).json()  # drafted and verified too
        logprobs = scored["choices"][0]["logprobs"]
        assert len(logprobs["token_logprobs"]) == scored["usage"]["completion_tokens"] == MAX_NEW
        assert all(lp <= 0 for lp in logprobs["token_logprobs"]) and all(len(t) == 2 for t in logprobs["top_logprobs"])
        streamed = OpenAI(base_url=f"{server.base_url}/v1", api_key="-").completions.create(
            model="tiny", prompt=prompts[0], max_tokens=MAX_NEW, temperature=0, logprobs=2, frequency_penalty=0.3,
            stream=True, extra_body={"ignore_eos": True})  # verify steps emit several tokens: each keeps its report
        chunks = [c.choices[0] for c in streamed if c.choices]
        assert "".join(c.text for c in chunks) == scored["choices"][0]["text"]
        assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == logprobs["tokens"]
        assert [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs] == pytest.approx(
            logprobs["token_logprobs"], abs=1e-5)
        # The core sends its counters every STATS_INTERVAL, busy or idle, and these three requests may all run
        # within one interval: read until two reads a few intervals apart agree (the engine is idle by now).
        deadline, values = time.monotonic() + 10, {}
        while True:
            time.sleep(3 * STATS_INTERVAL)
            latest = spec_samples(httpx.get(f"{server.base_url}/metrics").text)
            if (latest == values and values.get("banyan:spec_decode_num_drafts_total")) or time.monotonic() > deadline:
                break
            values = latest
    finally:
        server.stop()
    drafts = values["banyan:spec_decode_num_drafts_total"]
    draft_tokens, accepted = values["banyan:spec_decode_num_draft_tokens_total"], values[
        "banyan:spec_decode_num_accepted_tokens_total"]
    per_pos = [values[f"banyan:spec_decode_num_accepted_tokens_per_pos_total/{j}"] for j in range(3)]
    assert drafts > 0 and 0 < accepted <= draft_tokens and sum(per_pos) == accepted


def spec_samples(text: str) -> dict[str, float]:
    """The speculation samples on /metrics by name (`name/position` for the per-position one)."""
    return {
        s.name + (f"/{s.labels['position']}" if "position" in s.labels else ""): s.value
        for family in text_string_to_metric_families(text) if family.name.startswith(SPEC_METRICS)
        for s in family.samples if s.name.endswith("_total")
    }
