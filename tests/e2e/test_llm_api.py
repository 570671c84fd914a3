"""The offline API as users call it: vLLM's LLM / SamplingParams / RequestOutput shapes."""

from __future__ import annotations

import math
import time

import pytest
import torch

from banyan import LLM, SamplingParams
from banyan.errors import CacheCapacityError, ContextLengthExceededError, InvalidParameterError
from banyan.text.chat_template import DEFAULT_RENDER_TIMEOUT, ChatTemplateError
from tests.factories import write_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_api")
    write_model_dir(path, "llama", seed=2)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    # float32 K/V pages (a CPU's default for a float32 model is float16): logprobs are compared with transformers'
    return LLM(str(model_dir), block_size=4, num_threads=1, max_model_len=256, kv_cache_dtype="float32")


def test_text_and_token_prompts_come_back_in_order(llm):
    prompts = ["The quick brown fox", [5, 6, 7, 8, 9], {"prompt": "Paged attention"}, {"prompt_token_ids": [10, 11]}]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outputs] == ["The quick brown fox", None, "Paged attention", None]
    assert outputs[0].prompt_token_ids == llm.get_tokenizer().encode("The quick brown fox")
    assert outputs[1].prompt_token_ids == [5, 6, 7, 8, 9]
    for out in outputs:
        (completion,) = out.outputs
        assert out.finished and completion.finish_reason == "length" and len(completion.token_ids) == 5
        assert completion.text == llm.get_tokenizer().decode(completion.token_ids)
        assert out.metrics.first_token_time >= out.metrics.arrival_time
        assert out.metrics.finished_time >= out.metrics.first_token_time


def test_per_prompt_sampling_params(llm):
    outputs = llm.generate(
        ["a", "b"], [SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=4, ignore_eos=True)], use_tqdm=False
    )
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 4]
    with pytest.raises(InvalidParameterError):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_seeded_sampling_is_independent_of_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["The quick brown fox"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    mixed = llm.generate(["Radix", "The quick brown fox", "def add"], [others, seeded, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone


def test_n_sequences_share_the_prompt_pages(llm):
    prompt = list(range(3, 3 + 41))
    out = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # each sequence samples its own tokens
    assert llm.engine.scheduler.stats.prefix_hit_tokens >= 2 * 40  # siblings reused the prompt's pages
    llm.engine.kv.check_integrity()


def test_stop_strings_never_leak(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate(["The quick brown fox"], params, use_tqdm=False)[0].outputs[0].text
    assert len(full) > 6
    stop = full[3:6]
    out = llm.generate(["The quick brown fox"], params.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == full[: full.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    inclusive = llm.generate(["The quick brown fox"], params.clone(stop=[stop], include_stop_str_in_output=True), use_tqdm=False)
    assert inclusive[0].outputs[0].text == full[: full.index(stop) + len(stop)]
    assert llm.engine.kv.stats().num_in_use == 0  # the stop aborted the engine request and freed its pages


def test_logprobs_are_the_models_log_softmax(llm):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    total = 0.0
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        chosen = position[token_id]
        assert chosen.rank == 1  # greedy picks the most likely token
        assert len(position) == 3 and all(lp.logprob <= 0 for lp in position.values())
        total += chosen.logprob
    assert math.isclose(completion.cumulative_logprob, total, rel_tol=1e-5)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 5
    assert all(6 + i in out.prompt_logprobs[1 + i] for i in range(4))


def test_prompt_logprobs_match_a_direct_forward(llm, model_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = [5, 6, 7, 8, 9, 10]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for i in range(1, len(prompt)):
        assert out.prompt_logprobs[i][prompt[i]].logprob == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)


def test_chat_renders_the_template(llm):
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    batch = llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], use_tqdm=False)
    assert len(batch) == 2


def test_chat_stops_a_runaway_template_at_the_render_cap(llm):
    runaway = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    cpu, wall = time.thread_time(), time.monotonic()  # offline, the render runs in the caller's thread
    with pytest.raises(ChatTemplateError, match=f"ran for more than {DEFAULT_RENDER_TIMEOUT:g} s"):
        llm.chat([{"role": "user", "content": "hi"}], chat_template=runaway, use_tqdm=False)
    assert time.monotonic() - wall < DEFAULT_RENDER_TIMEOUT + 2
    assert time.thread_time() - cpu < DEFAULT_RENDER_TIMEOUT + 2
    assert llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False)


def test_stream_yields_the_same_text(llm):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    pieces = list(llm.stream("The quick brown fox", params))
    assert "".join(pieces) == llm.generate(["The quick brown fox"], params, use_tqdm=False)[0].outputs[0].text
    assert not llm.engine.has_unfinished_requests()


def test_bad_input_raises_typed_errors_and_leaks_nothing(llm):
    with pytest.raises(InvalidParameterError, match="prompt"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="vocabulary"):
        llm.generate([[1, 10**6]], use_tqdm=False)
    with pytest.raises(ContextLengthExceededError):
        llm.generate([[5] * 300], use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidParameterError, match="logit_bias"):
        llm.generate(["x"], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.stats().num_in_use == 0


def test_request_larger_than_the_cache_is_refused(model_dir):
    small = LLM(str(model_dir), block_size=4, num_pages=8, num_threads=1)
    with pytest.raises(CacheCapacityError):
        small.generate([[5] * 20], SamplingParams(max_tokens=20), use_tqdm=False)
    assert not small.engine.has_unfinished_requests()
