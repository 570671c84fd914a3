"""--attention-backend auto: triton on a GPU where its kernels can run, torch everywhere else.

choose_attention_backend is pure (device type, compute capability, why triton does not import, KV dtype), so
every case is checked here without a GPU; tests/kernels/test_triton_backend.py checks the runner's probing."""

import pytest
import torch

from banyan.config import ModelConfig
from banyan.layers.attention import choose_attention_backend
from banyan.layers.attention.base import FP8

NOT_INSTALLED = "backend 'triton' needs the 'triton' package: pip install 'banyan[gpu]'"
BROKEN = "triton fails to import (libcuda.so.1: cannot open shared object file)"
H200, A100, L4, T4 = (9, 0), (8, 0), (8, 9), (7, 5)


def test_auto_is_the_default():
    assert ModelConfig().attention_backend == "auto"


@pytest.mark.parametrize("asked, device, capability, problem, kv_dtype, expected", [
    # a CPU: torch, with nothing to warn about (explicit triton goes on to the registry, which says why not)
    ("auto", "cpu", None, None, torch.float32, ("torch", None)),
    ("auto", "cpu", None, NOT_INSTALLED, FP8, ("torch", None)),
    ("torch", "cpu", None, None, None, ("torch", None)),
    ("triton", "cpu", None, None, None, ("triton", None)),
    # a GPU where triton runs
    ("auto", "cuda", H200, None, torch.bfloat16, ("triton", None)),
    ("auto", "cuda", H200, None, FP8, ("triton", None)),
    ("auto", "cuda", A100, None, torch.bfloat16, ("triton", None)),
    ("auto", "cuda", L4, None, FP8, ("triton", None)),
    ("triton", "cuda", H200, None, FP8, ("triton", None)),
    # a GPU where it does not: torch, with the reason
    ("auto", "cuda", H200, NOT_INSTALLED, torch.bfloat16, ("torch", NOT_INSTALLED)),
    ("auto", "cuda", H200, BROKEN, torch.bfloat16, ("torch", BROKEN)),
    ("triton", "cuda", H200, BROKEN, torch.bfloat16, ("torch", BROKEN)),
    ("auto", "cuda", T4, None, torch.float16, ("torch", "triton needs compute capability 8.0 or newer; this GPU has 7.5")),
    ("auto", "cuda", A100, None, FP8,
     ("torch", "triton's fp8 KV cache needs compute capability 8.9 or newer; this GPU has 8.0")),
    # explicit torch wins, whatever the GPU
    ("torch", "cuda", H200, None, torch.bfloat16, ("torch", None)),
    ("torch", "cuda", T4, NOT_INSTALLED, FP8, ("torch", None)),
])
def test_choice(asked, device, capability, problem, kv_dtype, expected):
    assert choose_attention_backend(asked, device, capability, problem, kv_dtype) == expected


def test_an_unknown_name_goes_to_the_registry_unchanged():
    assert choose_attention_backend("flash", "cuda", H200, None, None) == ("flash", None)
