"""--kv-cache-dtype end to end on a tiny float32 model: fp8 (the torch backend over an fp8 pool), float16 (auto's
choice on a CPU) and bfloat16 (K/V in half the bytes; on a CPU banyan's attention kernels read float16 pages
directly), each against the float32 pool.

Greedy continuations of a random tiny model sit on near-ties, so one flipped token changes everything
after it; the measure is teacher-forced: the top-1 next token at every prompt position (prefill chunks
read the earlier chunks' K/V back from the pages). Measured: 338/354 (95%) for fp8 KV, against
343/354 for the whole model in bf16; free-running greedy keeps 85/128 tokens before the first flip. float16 KV
354/354, bfloat16 KV 352/354.
"""

from __future__ import annotations

import random

import pytest
import torch

from banyan import LLM, SamplingParams
from banyan.cli import build_parser, engine_config
from banyan.errors import InvalidParameterError
from banyan.layers.attention.base import FP8, to_cache_dtype, write_kv_cache
from banyan.layers.attention.torch_backend import TorchAttentionBackend
from tests.factories import write_model_dir
from tests.unit.test_cuda_graphs import decode_batch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_kv")
    vocab = write_model_dir(path, "llama", seed=1).config.vocab_size
    rng = random.Random(0)
    return path, [[rng.randrange(3, vocab) for _ in range(n)] for n in (33, 47, 56, 64, 70, 90)]


def top1_per_position(path, prompts, **kw):
    """(the top-1 token at every prompt position, the runner)."""
    llm = LLM(str(path), device="cpu", block_size=4, num_threads=1, kv_cache_memory=1 << 22,
              max_num_batched_tokens=16, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[max(d, key=lambda t: d[t].logprob) for d in o.prompt_logprobs[1:]] for o in outputs], llm.engine.runner


@pytest.mark.parametrize("kv_cache_dtype, dtype, agree, tokens_per_fp32", [
    ("fp8", FP8, 0.9, 4), ("float16", torch.float16, 0.99, 2), ("bfloat16", torch.bfloat16, 0.97, 2),
    ("auto", torch.float16, 0.99, 2),  # a float32 model on a CPU keeps float16 pages unless told otherwise
])
def test_a_narrower_cache_keeps_the_top1_and_holds_more_tokens(tiny, kv_cache_dtype, dtype, agree, tokens_per_fp32):
    path, prompts = tiny
    fp32, full = top1_per_position(path, prompts, kv_cache_dtype="float32")
    narrow, runner = top1_per_position(path, prompts, kv_cache_dtype=kv_cache_dtype)
    assert full.kv_caches[0][0].dtype == torch.float32
    assert runner.kv_caches[0][0].dtype == dtype
    assert runner.num_pages >= tokens_per_fp32 * full.num_pages - 1  # the same kv_cache_memory
    same = sum(a == b for x, y in zip(fp32, narrow) for a, b in zip(x, y))
    assert same >= agree * sum(map(len, fp32)), (same, sum(map(len, fp32)))


def test_fp8_store_rounds_scales_and_clamps():
    k = torch.tensor([[[0.49, -3.3, 1000.0, 1e-3]]])
    k_cache = torch.zeros(1, 2, 1, 4, dtype=FP8)
    write_kv_cache(k, k, k_cache, torch.zeros_like(k_cache), torch.tensor([1]), kv_scale=0.5)
    assert k_cache[0, 1, 0].float().tolist() == [1.0, -6.5, 448.0, 0.001953125]  # x / 0.5 on e4m3's grid
    assert torch.equal(k_cache.view(torch.uint8)[0, 0], torch.zeros(1, 4, dtype=torch.uint8))  # other slots untouched


def test_torch_backend_dequantizes_with_the_scale():
    """Attention over an fp8 cache holding K/V / s equals attention over the dequantized fp32 cache."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(3, 4, 1, 8, generator=gen), torch.randn(3, 4, 1, 8, generator=gen)
    q, k, v = torch.randn(1, 2, 8, generator=gen), torch.randn(1, 1, 8, generator=gen), torch.randn(1, 1, 8, generator=gen)
    batch = decode_batch([[2, 0]], [7], page_size=4)
    k8, v8 = to_cache_dtype(k_cache, FP8, 0.25), to_cache_dtype(v_cache, FP8, 0.25)
    out = TorchAttentionBackend(kv_scale=0.25).forward(q, k, v, k8, v8, batch, 0.3)
    def dequantized(x):  # what the fp8 cache holds (or will), in fp32
        return to_cache_dtype(x, FP8, 0.25).float() * 0.25

    expected = TorchAttentionBackend().forward(q, dequantized(k), dequantized(v), dequantized(k_cache),
                                               dequantized(v_cache), batch, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_flags():
    args = build_parser().parse_args(["generate", "--kv-cache-dtype", "fp8", "--enforce-eager"])
    config = engine_config(args)
    assert config.cache.kv_cache_dtype == "fp8" and config.model.enforce_eager
    assert engine_config(build_parser().parse_args(["generate", "--kv-cache-dtype", "float16"])).cache.kv_cache_dtype == "float16"
    for bad in ("int8", "half"):
        with pytest.raises(InvalidParameterError, match="kv_cache_dtype"):
            LLM("unused", kv_cache_dtype=bad)
