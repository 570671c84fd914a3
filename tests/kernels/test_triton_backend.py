"""The triton backend behind the AttentionBackend contract, its registry entry and fallbacks, and the
engine end to end with it: greedy outputs equal the torch backend's."""

from __future__ import annotations

import gc
import importlib.util
import logging
import random

import pytest
import torch

from banyan import LLM, SamplingParams
from banyan.errors import InvalidParameterError
from banyan.layers.attention import attention_backend_names, get_attention_backend
from banyan.layers.attention.base import FP8, to_cache_dtype
from banyan.layers.attention.torch_backend import TorchAttentionBackend
from banyan.layers.attention.triton_backend import TritonAttentionBackend
from banyan.runner import device
from tests.factories import write_model_dir
from tests.kernels.paged_batches import DEVICE, INTERPRET, assert_matches, gpu, make_batch, reference_attention


@pytest.mark.parametrize(
    "specs, sliding_window",
    [
        ([(12, 1), (0, 9), (30, 1), (5, 17)], None),  # mixed: decode rows and prefill chunks in one step
        ([(12, 1), (0, 1), (70, 1)], None),  # decode only
        ([(40, 6), (3, 1), (0, 20)], 8),
    ],
)
def test_forward_matches_torch_backend(specs, sliding_window):
    batch, q, k, v, k_cache, v_cache = make_batch(specs, page_size=4, num_kv_heads=2, group=2, head_dim=16)
    expected, k_ref, v_ref = reference_attention(q, k, v, k_cache, v_cache, batch, 0.25, sliding_window)
    out = get_attention_backend("triton").forward(q, k, v, k_cache, v_cache, batch, 0.25, sliding_window)
    assert_matches(out, expected)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


FP8_TOLERANCE = dict(atol=0.1, rtol=0.1)  # vs fp32 K/V: e4m3 keeps 3 mantissa bits (2^-4 relative)


@pytest.mark.parametrize("specs", [[(12, 1), (0, 9), (30, 1), (5, 17)], [(12, 1), (0, 1), (70, 1)]],
                         ids=["mixed", "decode"])
@pytest.mark.parametrize("kv_scale", [1.0, 0.25])
def test_fp8_cache(specs, kv_scale):
    """An fp8 cache: what the torch backend computes over the same fp8 cache, and the fp32 reference
    within fp8's precision."""
    batch, q, k, v, k_cache, v_cache = make_batch(specs, page_size=4, num_kv_heads=2, group=2, head_dim=16)
    exact, _, _ = reference_attention(q, k, v, k_cache, v_cache, batch, 0.25)
    k8, v8 = to_cache_dtype(k_cache, FP8, kv_scale), to_cache_dtype(v_cache, FP8, kv_scale)
    k_ref, v_ref = k8.clone(), v8.clone()
    expected = TorchAttentionBackend(kv_scale).forward(q, k, v, k_ref, v_ref, batch, 0.25)
    out = TritonAttentionBackend(kv_scale).forward(q, k, v, k8, v8, batch, 0.25)
    assert not out.isnan().any()
    # the interpreter truncates new rows below fp8's normal range (kernels/kv_store.py): 2^-9 at most
    torch.testing.assert_close(out, expected, atol=2e-3 if INTERPRET else 2e-5, rtol=1e-3 if INTERPRET else 1e-4)
    torch.testing.assert_close(out, exact, **FP8_TOLERANCE)


@pytest.fixture
def no_triton(monkeypatch):
    """As if the triton package were not installed."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name, *a))


def test_registry_without_triton(no_triton):
    assert "triton" in attention_backend_names()
    with pytest.raises(InvalidParameterError, match="pip install"):
        get_attention_backend("triton")


@pytest.fixture
def hopper(monkeypatch):
    """As if torch saw an H200 (compute capability 9.0); no GPU is touched."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


@pytest.mark.parametrize("asked", ["auto", "triton"])
def test_gpu_without_triton_falls_back_to_torch(no_triton, hopper, caplog, asked):
    with caplog.at_level(logging.WARNING, logger=device.__name__):
        backend = device.attention_backend(asked, torch.device("cuda"))
    assert backend.name == "torch"
    assert "pip install" in caplog.text and "using the 'torch' backend" in caplog.text


def test_gpu_where_triton_fails_to_import_falls_back_to_torch(monkeypatch, hopper, caplog):
    import_module = importlib.import_module

    def broken(name, *args):
        if name == "banyan.kernels.decode_attention":
            raise ImportError("libcuda.so.1: cannot open shared object file")
        return import_module(name, *args)

    monkeypatch.setattr(importlib, "import_module", broken)
    with caplog.at_level(logging.WARNING, logger=device.__name__):
        backend = device.attention_backend("auto", torch.device("cuda"))
    assert backend.name == "torch"
    assert "libcuda" in caplog.text and "using the 'torch' backend" in caplog.text


@pytest.mark.parametrize(
    "capability, kv_dtype, expected",
    [((7, 5), torch.bfloat16, "torch"), ((8, 6), FP8, "torch"), ((8, 6), torch.bfloat16, "triton"), ((9, 0), FP8, "triton")],
)
@pytest.mark.parametrize("asked", ["auto", "triton"])
def test_gpu_too_old_for_triton_falls_back_to_torch(monkeypatch, caplog, capability, kv_dtype, expected, asked):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    with caplog.at_level(logging.WARNING, logger=device.__name__):
        backend = device.attention_backend(asked, torch.device("cuda"), kv_dtype)
    assert backend.name == expected
    assert ("compute capability" in caplog.text) == (expected == "torch")


def test_explicit_torch_wins_on_a_gpu(hopper, caplog):
    with caplog.at_level(logging.WARNING, logger=device.__name__):
        assert device.attention_backend("torch", torch.device("cuda")).name == "torch"
    assert not caplog.text


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InvalidParameterError, match="CUDA"):
        device.attention_backend("triton", torch.device("cpu"))
    assert device.attention_backend("auto", torch.device("cpu")).name == "torch"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    vocab = write_model_dir(path, "llama", seed=3).config.vocab_size
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 11, 26, 30)]
    prompts[3] = prompts[2][:16] + prompts[3][16:]  # a 16-token shared prefix: a prefix-cache hit
    return path, prompts


def test_engine_greedy_equals_torch_backend(tiny):
    path, prompts = tiny
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        # small pages and a small token budget: chunked prefill steps that mix prefill and decode rows
        llm = LLM(str(path), attention_backend=backend, device=DEVICE, dtype="float32", block_size=4, num_pages=48,
                  max_num_batched_tokens=16, num_threads=1)
        first = llm.generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[:2] + prompts[3:]], params, use_tqdm=False)
        assert rest[-1].num_cached_tokens == 16
        outputs[backend] = [o.outputs[0].token_ids for o in first + rest]
    assert outputs["triton"] == outputs["torch"]
    gc.unfreeze()  # the engine froze triton's objects; let them be freed at exit like any others


def test_padded_decode_path_equals_eager(tiny):
    """The CUDA-graph decode path without capture: static buffers as wide as max_model_len, 3 requests in a
    bucket of 4 whose padding row writes the reserved page; greedy equal to the torch backend run eagerly."""
    path, prompts = tiny
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(path), attention_backend=backend, device=DEVICE, dtype="float32", block_size=4, num_pages=48,
                  max_num_seqs=4, max_model_len=64, num_threads=1)
        if backend == "triton":
            llm.engine.runner.start_decode_graphs(capture=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params, use_tqdm=False)
        outputs[backend] = [o.outputs[0].token_ids for o in outs]
    assert outputs["triton"] == outputs["torch"]
    gc.unfreeze()


@gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_cuda_graphs_equal_eager(tiny, kv_cache_dtype):
    """Captured decode graphs replay what eager steps compute; the pool is sized by the profiling forward."""
    path, prompts = tiny
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for eager in (True, False):
        llm = LLM(str(path), attention_backend="triton", device="cuda", dtype="float32", block_size=4,
                  gpu_memory_utilization=0.05, max_num_seqs=4, enforce_eager=eager, kv_cache_dtype=kv_cache_dtype)
        runner = llm.engine.runner
        assert "activation peak" in runner.capacity.budget
        assert runner.decode_graphs is None if eager else sorted(runner.decode_graphs.graphs) == [1, 2, 4]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params, use_tqdm=False)
        outputs[eager] = [o.outputs[0].token_ids for o in outs]
        del llm, runner
        gc.unfreeze()
        gc.collect()
    assert outputs[False] == outputs[True]
