"""Multi-LoRA in the engine: logits equal peft's (and the merged model's), one batch mixes adapters and the base model
exactly as if each request ran alone, the prefix cache never crosses adapters, and more adapters than slots
take turns (LRU) without changing an output."""

from __future__ import annotations

import random

import pytest
import torch

from banyan import LLM, LoRARequest, SamplingParams
from banyan.errors import LoRAAdapterError
from tests.factories import write_model_dir
from tests.lora_factories import write_adapter, write_merged_model

ADAPTERS = {  # name -> options: full targets, attention only with rsLoRA, MLP + o_proj at the maximum rank
    "all": dict(rank=8, alpha=16, seed=1),
    "qv-rs": dict(rank=4, alpha=8, targets=["q_proj", "v_proj"], rslora=True, seed=2),
    "mlp": dict(rank=16, alpha=8, targets=["o_proj", "gate_proj", "up_proj", "down_proj"], seed=3),
}
MAX_NEW = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_engine")
    base = write_model_dir(root / "model", "llama", seed=1)
    peft = {name: write_adapter(root / name, base, **options) for name, options in ADAPTERS.items()}
    requests = {name: LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate(ADAPTERS)}
    return root, base, peft, requests


def make_llm(root, **kw):
    # float32 K/V pages (float16 is a CPU's default): logits are compared with transformers + peft's
    options = dict(block_size=4, num_threads=1, enable_lora=True, max_loras=3, max_lora_rank=16, kv_cache_dtype="float32") | kw
    return LLM(str(root / "model"), **options)


def greedy(**kw):
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **kw)


def prompts(n, seed=0, length=(5, 30)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(rng.randint(*length))] for _ in range(n)]


def capture_logits(llm) -> list[torch.Tensor]:
    """Record every logits tensor the runner computes (the model's own compute_logits, observed)."""
    seen, model = [], llm.engine.runner.model
    compute = model.compute_logits
    model.compute_logits = lambda hidden: seen.append(compute(hidden)) or seen[-1]
    return seen


def test_logits_equal_peft_for_every_adapter_in_one_batch(tiny):
    """Base and three adapters' prompts in one step: every prompt position's logits as transformers + peft give."""
    root, base, peft, requests = tiny
    llm = make_llm(root)
    adapters = [None, requests["all"], requests["qv-rs"], requests["mlp"]]
    llm.generate([{"prompt_token_ids": [3]}] * 4, greedy(), use_tqdm=False, lora_request=adapters)  # all resident now
    seen = capture_logits(llm)
    ids = prompts(4, seed=1)
    llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(max_tokens=1, prompt_logprobs=1),
                 use_tqdm=False, lora_request=adapters)
    rows = seen[0].split([len(p) for p in ids])  # prompt positions, then the sampled row: len(p) rows each
    references = [base] + [peft[name] for name in ADAPTERS]
    with torch.no_grad():
        for got, prompt, reference in zip(rows, ids, references, strict=True):
            torch.testing.assert_close(got, reference(torch.tensor([prompt])).logits[0], atol=2e-5, rtol=1e-5)
    with torch.no_grad():  # the adapters do change the logits
        assert (peft["all"](torch.tensor([ids[1]])).logits - base(torch.tensor([ids[1]])).logits).abs().max() > 0.5


def test_greedy_output_equals_the_merged_model(tiny, tmp_path):
    """W + scale * B @ A written into a plain checkpoint gives the adapter's tokens (the merge done by peft)."""
    root, _, peft, requests = tiny
    write_merged_model(tmp_path / "merged", peft["qv-rs"], root / "model")
    ids = [{"prompt_token_ids": p} for p in prompts(3, seed=2)]
    merged = LLM(str(tmp_path / "merged"), block_size=4, num_threads=1).generate(ids, greedy(), use_tqdm=False)
    lora = make_llm(root).generate(ids, greedy(), use_tqdm=False, lora_request=requests["qv-rs"])
    assert [o.outputs[0].token_ids for o in lora] == [o.outputs[0].token_ids for o in merged]


def test_a_mixed_batch_equals_each_request_alone(tiny):
    """Prompts of every adapter and the base model, batched with chunked prefill, give each one's solo tokens."""
    root, _, _, requests = tiny
    ids = prompts(8, seed=3, length=(3, 40))
    choice = [None, *requests.values()] * 2
    llm = make_llm(root, max_num_batched_tokens=48)
    together = llm.generate([{"prompt_token_ids": p} for p in ids], greedy(), use_tqdm=False, lora_request=choice)
    solo = make_llm(root, enable_prefix_caching=False)
    alone = [solo.generate({"prompt_token_ids": p}, greedy(), use_tqdm=False, lora_request=lora)[0]
             for p, lora in zip(ids, choice)]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    llm.engine.kv.check_integrity()


def test_the_prefix_cache_never_crosses_adapters(tiny):
    root, _, _, requests = tiny
    llm = make_llm(root)
    prompt = {"prompt_token_ids": prompts(1, seed=4, length=(33, 33))[0]}
    one = SamplingParams(max_tokens=1)

    def cached(lora):
        return llm.generate(prompt, one, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(requests["all"]) == 0
    assert cached(requests["qv-rs"]) == 0  # same tokens, another adapter: no hit
    assert cached(None) == 0  # nor the base model
    assert cached(requests["all"]) == 32  # within one adapter the prefix is reused
    assert cached(requests["qv-rs"]) == 32
    assert cached(None) == 32
    llm.engine.kv.check_integrity()


def test_more_adapters_than_slots_take_turns(tiny):
    """max_loras=1: three adapters in one generate run one after another, each swapped in (LRU), outputs unchanged."""
    root, _, _, requests = tiny
    ids = prompts(6, seed=5)
    choice = [requests[name] for name in ADAPTERS] * 2
    expected = make_llm(root).generate([{"prompt_token_ids": p} for p in ids], greedy(), use_tqdm=False,
                                       lora_request=choice)
    llm = make_llm(root, max_loras=1)
    got = llm.generate([{"prompt_token_ids": p} for p in ids], greedy(), use_tqdm=False, lora_request=choice)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    adapters = llm.engine.adapters
    assert 3 <= adapters.num_loads < len(ids)  # each adapter came in at least once, never once per request
    assert len(adapters.slot_of) == 1
    assert not adapters.pinned and not adapters.needed and not adapters.loading
    assert set(adapters.specs) == set(adapters.paths) == set(adapters.slot_of)  # nothing kept of evicted ones


def test_least_recently_used_adapter_is_evicted(tiny):
    root, _, _, requests = tiny
    llm = make_llm(root, max_loras=2)
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    for name in ("all", "qv-rs", "all", "mlp"):  # "qv-rs" is the least recently used when "mlp" arrives
        llm.generate(prompt, greedy(), use_tqdm=False, lora_request=requests[name])
    resident = llm.engine.adapters.slot_of
    assert set(resident) == {requests["all"].lora_int_id, requests["mlp"].lora_int_id}


def test_bad_adapters_are_refused_and_leave_nothing_behind(tiny, tmp_path):
    root, _, _, requests = tiny
    llm = make_llm(root, max_lora_rank=4)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(LoRAAdapterError, match="rank 8 exceeds --max-lora-rank 4"):
        llm.generate(prompt, greedy(), use_tqdm=False, lora_request=requests["all"])
    (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(LoRAAdapterError, match="a pickle file"):
        llm.generate(prompt, greedy(), use_tqdm=False, lora_request=LoRARequest("p", 9, str(tmp_path)))
    with pytest.raises(LoRAAdapterError, match="lora_int_id must be a positive integer"):
        llm.generate(prompt, greedy(), use_tqdm=False, lora_request=LoRARequest("z", 0, str(root / "qv-rs")))
    assert not llm.engine.has_unfinished_requests() and not llm.engine.adapters.needed
    assert llm.generate(prompt, greedy(), use_tqdm=False, lora_request=requests["qv-rs"])[0].outputs[0].token_ids
    with pytest.raises(LoRAAdapterError, match="already loaded from"):
        llm.generate(prompt, greedy(), use_tqdm=False, lora_request=LoRARequest("x", 2, str(root / "all")))


def test_lora_needs_enable_lora(tiny):
    root, _, _, requests = tiny
    llm = LLM(str(root / "model"), block_size=4, num_threads=1)
    assert llm.engine.adapters is None and llm.engine.runner.lora is None  # the base path is untouched
    with pytest.raises(LoRAAdapterError, match="LoRA is not enabled"):
        llm.generate({"prompt_token_ids": [5, 6]}, greedy(), use_tqdm=False, lora_request=requests["all"])
    assert not llm.engine.has_unfinished_requests()


def test_an_adapter_waiting_for_a_slot_is_not_starved_by_steady_traffic(tiny):
    """max_loras=1 and a new request on the resident adapter every step: the other adapter's request still runs
    (new pins stop until its slot drains), long before that traffic ends."""
    root, _, _, requests = tiny
    engine = make_llm(root, max_loras=1).engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first_token_step: dict[str, int] = {}
    for step in range(60):
        if step < 40:
            engine.add_request(f"a{step}", [5, 6, 7], params, lora_request=requests["all"])
        if step == 3:
            engine.add_request("x", [5, 6, 7], params, lora_request=requests["mlp"])
        for delta in engine.step():
            first_token_step.setdefault(delta.request_id, step)
    while engine.has_unfinished_requests():
        engine.step()
    assert first_token_step["x"] < first_token_step["a39"]
    assert not engine.adapters.pinned and not engine.adapters.starved


def test_chat_takes_a_lora_request(tiny):
    root, _, _, requests = tiny
    llm = make_llm(root)
    messages = [{"role": "user", "content": "The quick brown fox"}]
    base = llm.chat(messages, greedy(), use_tqdm=False)[0]
    tuned = llm.chat(messages, greedy(), use_tqdm=False, lora_request=requests["all"])[0]
    alone = llm.generate({"prompt_token_ids": tuned.prompt_token_ids}, greedy(), use_tqdm=False,
                         lora_request=requests["all"])[0]
    assert tuned.outputs[0].token_ids == alone.outputs[0].token_ids != base.outputs[0].token_ids
