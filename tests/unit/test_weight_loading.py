"""Weights load straight into their final dtype: a bf16 checkpoint loaded as bf16 never passes through a float32
copy of any weight (on a GPU: read by safetensors onto the device, docs/gpu.md), and lands bit for bit."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from banyan.config import CacheConfig, EngineConfig, ModelConfig
from banyan.engine.engine import Engine
from tests.factories import write_model_dir


class Float32Outputs(TorchDispatchMode):
    """The shapes of every float32 tensor any torch op makes while active."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.shapes.append(tuple(t.shape))
        return out


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16_llama")
    write_model_dir(path, "llama", seed=5).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def test_a_bf16_checkpoint_loads_as_bf16_without_a_float32_copy(bf16_dir, caplog):
    stored = load_file(str(bf16_dir / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    weight_shapes = {tuple(t.shape) for t in stored.values() if t.dim() == 2}
    config = EngineConfig(model=ModelConfig(model=str(bf16_dir), device="cpu", dtype="bfloat16", quantization="none"),
                          cache=CacheConfig(num_pages=16, block_size=16))
    with caplog.at_level(logging.INFO, logger="banyan.runner.model_runner"), Float32Outputs() as seen:
        runner = Engine(config).runner
    assert weight_shapes.isdisjoint(seen.shapes), "a float32 tensor of a weight's shape was made while loading"
    params = dict(runner.model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.o_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.norm.weight"):
        assert torch.equal(params[name], stored[name]), name
    q, k, v = (stored[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(params["model.layers.0.self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
    assert runner.load_seconds > 0 and "loaded in" in caplog.text
