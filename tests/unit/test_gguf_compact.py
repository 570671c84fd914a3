"""GGUF Q4_0/Q4_1/Q8_0 tensors kept compact (`--quantization gguf`) instead of dequantized to fp32."""

from __future__ import annotations

import gguf
import pytest
import torch

from banyan import LLM, SamplingParams
from banyan.config import EngineConfig, ModelConfig
from banyan.kernels import cpu_argmax, cpu_decode, cpu_gemv
from banyan.quantization.formats import INT8, Int4Weight, Int8Weight, WeightFormat
from banyan.runner.weights import open_model
from tests.unit.test_quantization import needs_gemv
from tests.unit.test_weights import make_gguf

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_q4_blocks_are_int4_groups_with_the_same_values(tmp_path, qtype):
    """Q/K rows un-permuted with their scales; every value exactly as gguf dequantizes it."""
    path, _ = make_gguf(tmp_path, qtype=qtype)
    source = open_model(str(path))
    floats, compact = dict(source.iter_weights()), dict(source.iter_weights(compact=True))
    assert set(source.compact_formats().values()) == {WeightFormat("int4", 32)}
    for name, w in compact.items():
        if isinstance(w, Int4Weight):
            assert torch.equal(w.dequantize(), floats[name]), name
        else:
            assert w.dim() == 1 and torch.equal(w, floats[name]), name  # norms and biases stay float


def test_q4_1_values_through_the_packed_kernel_are_exact(tmp_path):
    """torch's CPU int4 kernel reads Q4_1's d, m as s = d, z = m + 8d to the last bit: x = I gives W^T."""
    path, _ = make_gguf(tmp_path, qtype=Q.Q4_1)
    source = open_model(str(path))
    name = "model.layers.0.mlp.down_proj.weight"
    w = dict(source.iter_weights(compact=True))[name]
    packed = torch._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 1)
    scale_zeros = torch.stack([w.scale.t(), w.zero.t()], dim=-1).contiguous()
    identity = torch.eye(w.q.shape[1])
    assert torch.equal(torch._weight_int4pack_mm_for_cpu(identity, packed, 32, scale_zeros).t(), dict(source.iter_weights())[name])


def test_q8_0_is_requantized_per_row_with_a_small_error(tmp_path):
    path, _ = make_gguf(tmp_path, qtype=Q.Q8_0)
    source = open_model(str(path))
    assert set(source.compact_formats().values()) == {INT8}
    floats = dict(source.iter_weights())
    for name, w in source.iter_weights(compact=True):
        if isinstance(w, Int8Weight):
            error = (w.dequantize() - floats[name]).norm() / floats[name].norm()
            assert error < 0.01, name  # one scale per row instead of one per 32 values


def greedy_tokens(path, quantization, prompts):
    # float32 compute (the default on a CPU without AMX; with AMX a GGUF file would run in bf16)
    llm = LLM.from_config(EngineConfig(model=ModelConfig(str(path), num_threads=1, quantization=quantization,
                                                         dtype="float32")))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.fixture
def without_cpu_kernels(monkeypatch):
    """Layers dequantize per matmul: banyan's AVX2 kernel (which rounds x to int8) is switched off. Every binding
    over its library forgets it before and after (else the attention, SiLU and argmax kernels stayed off for the
    tests that followed in the same process, and a bf16 MLP test failed after this one)."""
    monkeypatch.setenv("BANYAN_DISABLE_CPU_KERNELS", "1")
    _forget_kernels()
    yield
    monkeypatch.delenv("BANYAN_DISABLE_CPU_KERNELS")
    _forget_kernels()


def _forget_kernels() -> None:
    for binding in (cpu_gemv.load, cpu_decode._load, cpu_argmax._load):
        binding.cache_clear()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_compact_q4_model_generates_what_the_dequantized_one_does(tmp_path, qtype, without_cpu_kernels):
    path, _ = make_gguf(tmp_path, qtype=qtype)  # untied: every matrix, lm_head too, stays int4 with its values
    prompts = [[5, 9, 17, 33], [40, 41, 42, 43, 44, 45, 46], [100] * 5]
    assert greedy_tokens(path, "gguf", prompts) == greedy_tokens(path, "none", prompts)  # none: dequantized, float32


@needs_gemv
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_compact_q4_model_through_the_kernel_starts_as_the_dequantized_one(tmp_path, qtype):
    """The same values, but banyan's AVX2 kernel rounds x to int8 per block of 32 (as llama.cpp does): on this
    random model the greedy tokens part after 4 to 10 tokens (measured), so only the first two are promised."""
    path, _ = make_gguf(tmp_path, qtype=qtype)
    prompts = [[5, 9, 17, 33], [40, 41, 42, 43, 44, 45, 46], [100] * 5]
    got, want = greedy_tokens(path, "gguf", prompts), greedy_tokens(path, "none", prompts)
    assert [t[:2] for t in got] == [t[:2] for t in want]
