"""Tensor and pipeline parallel on CPU (gloo over loopback, one thread per rank): the same tokens and the same
logits as one process, with prefix hits, chunked prefill and preemption in one run (faults:
test_tensor_parallel_faults.py)."""

from __future__ import annotations

import random

import pytest

from banyan import LLM, SamplingParams
from banyan.errors import InvalidParameterError
from tests.factories import write_model_dir

pytestmark = pytest.mark.slow

MAX_NEW = 10
PROMPT_LENGTHS = [5, 17, 29, 40, 55]
LOGPROB_TOLERANCE = 1e-4  # float32: the all-reduce sums partial products in another order


def workload(vocab: int) -> list[list[int]]:
    """Prompts 1-3 share the first 24 tokens of prompt 4 (prefix hits once it has run)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    for i in (1, 2, 3):
        prompts[i] = prompts[4][:24] + prompts[i][24:]
    return prompts


def make_llm(path, tp: int = 1, pp: int = 1, **kw) -> LLM:
    # 20 pages of 4 tokens: the longest request needs 17 alone, the batch after it preempts; a budget of 8 tokens a
    # step cuts every prompt into chunks.
    # float32 K/V pages (a CPU's default for a float32 model is float16, whose rounding of K/V would magnify the
    # all-reduce's last-bit differences past the tolerance)
    kw = dict(num_threads=1, block_size=4, num_pages=20, max_num_batched_tokens=8, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, kv_cache_dtype="float32") | kw
    return LLM(str(path), **kw)


def run(llm: LLM, prompts):
    """(tokens, top-5 logprobs per token, prompt logprobs) of every prompt, the longest first on its own (with
    its prompt's logprobs, which read every prompt row: no prefix hit for it)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    first = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": prompts[4]}], first, use_tqdm=False)
    outputs += llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs or [None]) for o in outputs]


def assert_same(got, want):
    for (tokens, logprobs, prompt_lp), (want_tokens, want_logprobs, want_prompt_lp) in zip(got, want, strict=True):
        assert tokens == want_tokens
        for step, want_step in zip(logprobs + prompt_lp[1:], want_logprobs + want_prompt_lp[1:], strict=True):
            assert step.keys() == want_step.keys()
            for token, lp in step.items():
                assert lp.logprob == pytest.approx(want_step[token].logprob, abs=LOGPROB_TOLERANCE)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """4 query heads, 2 KV heads: TP=2 splits the KV heads, TP=4 replicates each on two ranks."""
    path = tmp_path_factory.mktemp("tp_llama")
    model = write_model_dir(path, "llama", seed=3)
    prompts = workload(model.config.vocab_size)
    llm = make_llm(path)
    return path, prompts, run(llm, prompts)


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_same_tokens_and_logits_as_one_process(tiny_llama, tp):
    path, prompts, want = tiny_llama
    llm = make_llm(path, tp)
    assert_same(run(llm, prompts), want)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens >= 2 * 24  # prompts 1-3 hit prompt 4's pages
    llm.engine.kv.check_integrity()
    llm.engine.close()


@pytest.mark.parametrize("micro_batches", [2, 1, 3])
def test_pipeline_stages_give_the_same_tokens_and_logits(tiny_llama, micro_batches):
    """Two stages of one layer each; micro-batches of whole requests pass through them: one per stage (stage 1 runs
    micro-batch m while stage 0 runs m+1), the whole batch at once, or more than stages. (By default, steps this
    small, 8 tokens, would go through whole: micro_batch_count.)"""
    path, prompts, want = tiny_llama
    llm = make_llm(path, pp=2, pipeline_micro_batches=micro_batches)
    assert_same(run(llm, prompts), want)
    assert llm.engine.stats().num_preemptions > 0
    llm.engine.kv.check_integrity()
    llm.engine.close()


def test_tensor_parallel_inside_pipeline_stages(tiny_llama):
    """TP=2 x PP=2: four processes, each stage's two ranks split its layer (a KV head each)."""
    path, prompts, want = tiny_llama
    llm = make_llm(path, tp=2, pp=2)
    assert_same(run(llm, prompts), want)
    llm.engine.kv.check_integrity()
    llm.engine.close()


def test_three_uneven_stages(tmp_path):
    """5 layers over 3 stages: 2, 2 and 1."""
    model = write_model_dir(tmp_path, "llama", seed=7, num_hidden_layers=5)
    prompts = workload(model.config.vocab_size)
    want = run(make_llm(tmp_path), prompts)
    llm = make_llm(tmp_path, pp=3)
    assert_same(run(llm, prompts), want)
    llm.engine.close()


def test_qwen2_biases_split_the_same_way(tmp_path):
    """q/k/v biases are column-parallel like their weights; the tied embeddings and lm_head share a vocabulary
    shard."""
    model = write_model_dir(tmp_path, "qwen2", seed=4, tie_word_embeddings=True)
    prompts = workload(model.config.vocab_size)
    want = run(make_llm(tmp_path), prompts)
    llm = make_llm(tmp_path, 2)
    assert_same(run(llm, prompts), want)
    llm.engine.close()


def test_a_size_that_does_not_divide_the_heads_is_refused(tmp_path):
    write_model_dir(tmp_path, "llama", num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(InvalidParameterError, match="tensor_parallel_size: 3 does not divide the model's 4 attention"):
        make_llm(tmp_path, 3)
