"""Prompt log-probabilities with a prefix-cache hit (what select scores options with): SamplingParams'
prompt_logprobs_start lets the cache serve the positions before it; the positions from it on are exact
(against transformers on the same weights), the ones the cache served are None. Without a start, a
prompt_logprobs request skips the cache and every position is computed."""

from __future__ import annotations

import pytest
import torch

from banyan import LLM, SamplingParams
from banyan.errors import InvalidParameterError
from tests.factories import write_model_dir

PREFIX = list(range(5, 5 + 21))  # 21 tokens: five whole pages of 4 and one more
SUFFIX = [40, 41, 42, 43, 44]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_lang_logprobs")
    write_model_dir(path, "llama", seed=3)
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = PREFIX + SUFFIX
    with torch.no_grad():
        return ids, torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.fixture
def llm(model_dir):
    # float32 K/V pages (a CPU's default for a float32 model is float16): logprobs are compared with a forward's
    return LLM(str(model_dir), block_size=4, num_threads=1, max_model_len=256, kv_cache_dtype="float32")


def _warm(llm):
    llm.generate([PREFIX], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)


def test_positions_from_the_start_are_exact_after_a_cache_hit(llm, reference):
    ids, ref = reference
    _warm(llm)
    start = len(PREFIX)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=start)
    out = llm.generate([ids], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 20  # whole pages before position start - 1
    assert len(out.prompt_logprobs) == len(ids)
    assert all(lp is None for lp in out.prompt_logprobs[: out.num_cached_tokens + 1])
    for i in range(start, len(ids)):
        assert out.prompt_logprobs[i][ids[i]].logprob == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4)


def test_without_a_start_the_cache_is_skipped_and_every_position_is_exact(llm, reference):
    ids, ref = reference
    _warm(llm)
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        assert out.prompt_logprobs[i][ids[i]].logprob == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4)


def test_a_start_past_the_cached_pages_computes_the_rest(llm, reference):
    """Start in the middle of the cached prefix: the cache serves only the pages before start - 1."""
    ids, ref = reference
    _warm(llm)
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=10),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 8
    for i in range(10, len(ids)):
        assert out.prompt_logprobs[i][ids[i]].logprob == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4)


def test_a_negative_start_is_refused():
    with pytest.raises(InvalidParameterError, match="prompt_logprobs_start"):
        SamplingParams(prompt_logprobs=0, prompt_logprobs_start=-1)
