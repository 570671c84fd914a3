"""Steps of a few rows with every decoder layer in one C call (banyan/runner/cpu_step.py) give the module path's
bits: the same greedy tokens and the same logprobs, on tiny models written to disk and loaded for real; where it
does not apply the runner keeps the module path (cpu_step is None)."""

from __future__ import annotations

import random

import pytest
import torch

from banyan import LLM, SamplingParams
from banyan.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from banyan.forward_batch import ForwardBatch
from banyan.kernels import cpu_decode_layers
from banyan.quantization.linear import BF16_ROWS
from banyan.runner.cpu_step import WIDE_ROWS
from banyan.runner.device import cpu_has_bf16_matmul
from tests.factories import write_model_dir

needs_kernels = pytest.mark.skipif(cpu_decode_layers.load() is None, reason="needs an x86 CPU with AVX2 and a C compiler")

MAX_NEW = 10


def make_llm(path, quantization, kv_cache_dtype="auto", max_num_batched_tokens=2048, **model):
    config = EngineConfig(model=ModelConfig(str(path), num_threads=1, quantization=quantization, **model),
                          cache=CacheConfig(block_size=4, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype),
                          scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens))
    return LLM.from_config(config)


def outputs(llm, prompts):
    """Each prompt's greedy tokens and top-3 logprobs: the prompts together (decode steps of several rows; the short
    prompts' prefills fit in a step too), then each alone (batch 1)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    alone = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in [*together, *alone]]


def prompts_for(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (2, 5, 8, 19, 37)]


@needs_kernels
@pytest.mark.parametrize("arch, quantization, overrides, model", [
    ("llama", "int4", {"tie_word_embeddings": True}, {}),
    ("llama", "int8", {}, {}),
    ("mistral", "int8", {"sliding_window": 6}, {}),  # the window, in every layer
    ("qwen2", "int4", {}, {}),  # q/k/v biases
    ("llama", "fp16", {}, {"batch_invariant": True}),  # every row of every matmul through banyan's kernels
    ("llama", "int4", {}, {"kv_cache_dtype": "float16"}),  # K/V stored and read as float16
    ("llama", "int4", {}, {"kv_cache_dtype": "fp8"}),  # and as fp8 (e4m3, rounded as torch rounds)
])
def test_one_call_gives_the_module_paths_bits(tmp_path, arch, quantization, overrides, model):
    hf = write_model_dir(tmp_path, arch, seed=3, **overrides)
    llm = make_llm(tmp_path, quantization, **model)
    runner = llm.engine.runner
    assert runner.cpu_step is not None
    prompts = prompts_for(hf.config.vocab_size)
    fused = outputs(llm, prompts)
    step, runner.cpu_step = runner.cpu_step, None
    assert outputs(llm, prompts) == fused
    runner.cpu_step = step


@needs_kernels
@pytest.mark.parametrize("invariant", [False, True])
def test_wide_steps_take_the_one_call_where_every_layer_takes_the_kernel(tmp_path, invariant):
    """20 requests at once: decode steps of 20 rows and whole 12-token prompts in one C call, with the module path's
    bits. int4 layers take the kernel at any width, up to the rows from which an AMX CPU's bf16 copies serve."""
    hf = write_model_dir(tmp_path, "llama", seed=3)
    llm = make_llm(tmp_path, "int4", max_num_batched_tokens=32, batch_invariant=invariant)
    step = llm.engine.runner.cpu_step
    bf16_copies = any(getattr(m, "bf16", None) is not None for m in llm.engine.runner.model.modules())
    assert bf16_copies == (not invariant and cpu_has_bf16_matmul())
    assert step.max_rows == (BF16_ROWS - 1 if bf16_copies else WIDE_ROWS)
    seen = []
    run = step.run
    step.run = lambda fb: seen.append((fb.num_tokens, max(fb.query_lens))) or run(fb)
    prompts = [[random.Random(i).randrange(3, hf.config.vocab_size) for _ in range(12)] for i in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)  # all 20 decode at once
    fused = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert 20 in [rows for rows, query in seen if query == 1]
    assert max(query for _, query in seen) == 12
    llm.engine.runner.cpu_step = None
    modules = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in fused] == \
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in modules]


@pytest.mark.parametrize("arch, quantization, why", [
    ("llama", "none", "float32 linear layers run torch's GEMM, not a narrow kernel"),
    ("qwen3", "int8", "q/k norms"),
])
def test_other_models_keep_the_module_path(tmp_path, arch, quantization, why):
    write_model_dir(tmp_path, arch, seed=3, qwen3=arch == "qwen3")
    assert make_llm(tmp_path, quantization).engine.runner.cpu_step is None, why


def test_fused_decode_turned_off_keeps_the_module_path(tmp_path, monkeypatch):
    monkeypatch.setenv("BANYAN_DISABLE_FUSED_DECODE", "1")
    hf = write_model_dir(tmp_path, "llama", seed=3)
    llm = make_llm(tmp_path, "int8")
    assert llm.engine.runner.cpu_step is None
    assert all(len(tokens) == MAX_NEW for tokens, _ in outputs(llm, prompts_for(hf.config.vocab_size)[:2]))


def decode_batch(tables: list[list[int]], positions: list[int], page_size: int) -> ForwardBatch:
    """One decode row per request, at `positions` (its context: that many tokens before it), its K/V stored there."""
    width = max(len(t) for t in tables)
    slots = [t[p // page_size] * page_size + p % page_size for t, p in zip(tables, positions)]
    n = len(positions)
    return ForwardBatch(input_ids=torch.arange(5, 5 + n), positions=torch.tensor(positions),
                        slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                        seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32),
                        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
                        logits_indices=torch.arange(n), query_lens=[1] * n, context_lens=[p + 1 for p in positions],
                        page_size=page_size)


@needs_kernels
def test_a_step_leaves_the_same_hidden_states_and_cache_as_the_modules(tmp_path):
    write_model_dir(tmp_path, "llama", seed=3)
    runner = make_llm(tmp_path, "int4").engine.runner
    fb = decode_batch([[3, 7], [1], [9, 2, 4]], [5, 1, 10], runner.page_size)  # pages 4 tokens: page edges crossed
    caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    with torch.inference_mode():
        hidden = runner.cpu_step.run(fb)
        want = runner.model(fb, caches)
    assert torch.equal(hidden, want)
    assert all(torch.equal(a, b) for pair, other in zip(runner.kv_caches, caches) for a, b in zip(pair, other))


@needs_kernels
def test_decode_rows_over_a_shared_prompts_pages_give_the_modules_bits(tmp_path):
    """Decode rows whose tables begin with the same pages (a shared prompt's, 3 pages): the one call and the modules
    give the same hidden states. Where the CPU has AMX-BF16 tiles and batch invariance is off (bf16 chunks), both
    attend those pages on the tiles (head_dim 32 here), near the float kernel's states (bf16's rounding, grown through
    two layers of a tiny random model's large weights: 2% here)."""
    write_model_dir(tmp_path, "llama", seed=3, hidden_size=128)  # 4 heads of 32
    runner = make_llm(tmp_path, "int4").engine.runner
    gen = torch.Generator().manual_seed(4)
    for k, v in runner.kv_caches:  # the pages' keys and values: noise
        k.copy_(torch.randn(k.shape, generator=gen)), v.copy_(torch.randn(v.shape, generator=gen))
    fb = decode_batch([[3, 7, 8, 11], [3, 7, 8, 2], [3, 7, 8, 9, 4]], [13, 14, 17], runner.page_size)
    caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    with torch.inference_mode():
        hidden = runner.cpu_step.run(fb)
        want = runner.model(fb, caches)
    assert torch.equal(hidden, want)
    tiles = runner.attn.amx_tiles(runner.kv_caches[0][0], None)
    assert tiles == (runner.attn.kernels.amx_bf16 and not runner.batch_invariant)
    assert runner.cpu_step.step.bf16_tiles == tiles
    if tiles:
        runner.cpu_step.step.bf16_tiles = 0
        with torch.inference_mode():
            plain = runner.cpu_step.run(fb)
        runner.cpu_step.step.bf16_tiles = 1
        assert not torch.equal(plain, hidden)
        assert (plain - hidden).norm() / plain.norm() < 5e-2


@needs_kernels
def test_a_position_past_the_rotary_table_is_a_value_error_as_in_the_modules(tmp_path):
    write_model_dir(tmp_path, "llama", seed=3)
    runner = make_llm(tmp_path, "int8").engine.runner
    past = runner.model.model.layers[0].self_attn.rotary_emb.cos.shape[0] + 3
    fb = decode_batch([[1] * (past // runner.page_size + 1)], [past], runner.page_size)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="rotary table"):
            runner.cpu_step.run(fb)
        with pytest.raises(ValueError, match="rotary table"):
            runner.model(fb, runner.kv_caches)
