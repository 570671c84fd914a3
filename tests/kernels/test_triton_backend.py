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
from banyan.runner import model_runner
from tests.factories import write_model_dir
from tests.kernels.paged_batches import DEVICE, assert_matches, make_batch, reference_attention


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


@pytest.fixture
def no_triton(monkeypatch):
    """As if the triton package were not installed."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name, *a))


def test_registry_without_triton(no_triton):
    assert "triton" in attention_backend_names()
    with pytest.raises(InvalidParameterError, match="pip install"):
        get_attention_backend("triton")


def test_gpu_without_triton_falls_back_to_torch(no_triton, caplog):
    with caplog.at_level(logging.WARNING, logger=model_runner.__name__):
        backend = model_runner._attention_backend("triton", torch.device("cuda"))
    assert backend.name == "torch"
    assert "falling back" in caplog.text


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InvalidParameterError, match="CUDA"):
        model_runner._attention_backend("triton", torch.device("cpu"))


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
