"""Weights load straight into their final dtype: a bf16 checkpoint loaded as bf16 never passes through a float32
copy of any weight (on a GPU: read by safetensors onto the device, docs/gpu.md), and lands bit for bit. Nothing is
drawn at random on the way: the checkpoint fills every parameter."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from banyan.config import CacheConfig, EngineConfig, ModelConfig
from banyan.engine.engine import Engine
from tests.factories import write_model_dir


class RandomFills(TorchDispatchMode):
    """The random fills (aten uniform_ / normal_) any torch op makes while active."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.uniform_, torch.ops.aten.normal_):
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


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


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_loading_draws_no_random_weights_the_checkpoint_then_overwrites(bf16_dir, quantization):
    """torch.nn's layers fill their weights at random when built (nn.Linear's kaiming_uniform_, nn.Embedding's
    normal_); the runner builds its model without those fills (runner/device.py's without_random_init): the default
    model's had cost 0.5-0.7 s of its start-up. The checkpoint still fills every parameter (load_weights refuses one
    it lacks; a norm weight checked bit for bit here)."""
    config = EngineConfig(model=ModelConfig(model=str(bf16_dir), device="cpu", dtype="bfloat16", quantization=quantization),
                          cache=CacheConfig(num_pages=16, block_size=16))
    with RandomFills() as fills:
        runner = Engine(config).runner
    assert fills.calls == []
    stored = load_file(str(bf16_dir / "model.safetensors"))
    assert torch.equal(dict(runner.model.named_parameters())["model.norm.weight"], stored["model.norm.weight"])
    assert torch.nn.Linear(4, 4).weight.abs().sum() > 0  # torch's own init is back outside the runner
