"""The engine end to end: greedy outputs equal transformers' token for token, however the batch is cut.

One tiny random Llama on disk (safetensors + tokenizer), loaded through banyan's real loader; the
reference is transformers recomputing each sequence from scratch.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from banyan import LLM, SamplingParams
from banyan.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from banyan.kernels import cpu_gemv
from banyan.runner.device import cpu_has_bf16_matmul
from tests.factories import reference_greedy, write_model_dir

MAX_NEW = 12
PROMPT_LENGTHS = [3, 7, 16, 17, 29, 40, 55, 64]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    model = write_model_dir(path, "llama", seed=1)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    # Prompts 5 and 6 share the first 32 tokens of prompt 7, so that they can hit the prefix cache.
    for i in (5, 6):
        prompts[i] = prompts[7][:32] + prompts[i][32:]
    expected = [reference_greedy(model, p, MAX_NEW) for p in prompts]
    return path, prompts, expected


def greedy(**kw):
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **kw)


def make_llm(path, **kw):
    kw.setdefault("num_threads", 1)
    return LLM(str(path), block_size=kw.pop("block_size", 4), **kw)


def test_batch_equals_transformers(tiny):
    path, prompts, expected = tiny
    llm = make_llm(path)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    llm.engine.kv.check_integrity()


def test_staggered_arrivals(tiny):
    path, prompts, expected = tiny
    llm = make_llm(path)
    engine = llm.engine
    got = {str(i): [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request every third step, while others decode
            i, p = pending.pop(0)
            engine.add_request(str(i), p, greedy())
        for delta in engine.step():
            got[delta.request_id] += delta.new_token_ids
        step += 1
    assert [got[str(i)] for i in range(len(prompts))] == expected
    engine.kv.check_integrity()


def test_small_budget_forces_chunked_prefill(tiny):
    path, prompts, expected = tiny
    llm = make_llm(path, max_num_batched_tokens=8)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_shared_prefixes_hit_the_cache(tiny):
    path, prompts, expected = tiny
    llm = make_llm(path)
    first = llm.generate([{"prompt_token_ids": prompts[7]}], greedy(), use_tqdm=False)[0]
    assert first.outputs[0].token_ids == expected[7]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[5:7]], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected[5:7]
    assert all(o.num_cached_tokens == 32 for o in outputs)


def test_tiny_page_pool_forces_preemption(tiny):
    path, prompts, expected = tiny
    # 20 pages of 4 tokens: the longest request alone needs 19 pages, so requests must take turns.
    llm = make_llm(path, num_pages=20)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.stats().num_in_use == 0


def _generate(llm, prompts, **params):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(**params), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


# on by default on x86 CPUs with AVX2 or AVX-512 and the kernels built, except with AMX (bf16 prefill copies there)
INVARIANT_BY_DEFAULT = cpu_gemv.vector_cpu() and cpu_gemv.load() is not None and not cpu_has_bf16_matmul()


@pytest.mark.parametrize("quantization, asked, kv_cache_dtype", [
    ("int8", True, "auto"), ("none", True, "auto"), ("int8", True, "float16"), ("int8", True, "fp8"),
    pytest.param("int4", None, "auto", marks=pytest.mark.skipif(not INVARIANT_BY_DEFAULT, reason="on by default on x86 CPUs with AVX2 or AVX-512 (not AMX) and the kernels built")),
])
def test_batch_invariant_mode_gives_each_request_its_solo_output(tiny, quantization, asked, kv_cache_dtype):
    """With batch_invariant (asked, or the default on an x86 CPU with AVX2 or AVX-512 and no AMX), a request's greedy tokens are its solo ones
    in a batch of 12 (more rows than the CPU kernel's 8), with its prompt cut into chunks and after a preemption,
    over a float32, float16 or fp8 KV cache.
    Without it int8 breaks this: decode steps of up to 8 rows multiply by x rounded to int8 (banyan's kernel), wider
    ones by dequantized weights; float32 rows move in their last bits with the row count (torch's GEMMs, SDPA), too
    little to flip this model's tokens."""
    path, prompts, _ = tiny
    rng = random.Random(1)
    prompts = prompts + [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 11, 23, 38)]
    config = EngineConfig(model=ModelConfig(str(path), num_threads=1, quantization=quantization, batch_invariant=asked),
                          cache=CacheConfig(block_size=4, kv_cache_dtype=kv_cache_dtype))
    llm = LLM.from_config(config)
    assert llm.engine.runner.batch_invariant
    solo = [_generate(llm, [p])[0] for p in prompts]
    assert _generate(llm, prompts) == solo
    crowded = LLM.from_config(dataclasses.replace(config, cache=CacheConfig(block_size=4, num_pages=40,
                                                                            kv_cache_dtype=kv_cache_dtype),
                                                  scheduler=SchedulerConfig(max_num_batched_tokens=16)))
    assert _generate(crowded, prompts) == solo
    assert crowded.engine.scheduler.stats.num_preemptions > 0
