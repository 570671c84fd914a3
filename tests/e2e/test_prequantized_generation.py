"""An AWQ, GPTQ (act-order) and compressed-tensors W8A8 checkpoint, as their tools write them, generates through
LLM.generate what transformers generates from the float weights they stand for."""

from __future__ import annotations

import pytest

from banyan import LLM, SamplingParams
from banyan.config import EngineConfig, ModelConfig
from tests.factories import reference_greedy
from tests.prequantized_factories import LAYOUTS, write_prequantized
from tests.unit.test_gguf_compact import without_cpu_kernels  # noqa: F401 (a fixture)
from tests.unit.test_quantization import needs_gemv

PROMPTS = [[5, 9, 17, 33], [40, 41, 42, 43, 44, 45, 46], [100] * 5]
MAX_NEW = 8


def generate(path, quantization=None):
    llm = LLM.from_config(EngineConfig(model=ModelConfig(str(path), num_threads=1, dtype="float32",
                                                         quantization=quantization)))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    reference = write_prequantized(path, request.param)
    return path, request.param, [reference_greedy(reference, p, MAX_NEW) for p in PROMPTS]


def test_greedy_tokens_are_the_references(checkpoint, without_cpu_kernels):  # noqa: F811
    """The file's method asked for by name, every matmul over the file's exact values: transformers' tokens."""
    path, name, want = checkpoint
    assert generate(path, LAYOUTS[name].method) == want


@needs_gemv
def test_by_default_the_compact_layers_generate_the_references_start(checkpoint):
    """Unasked, on an AVX2 CPU, as for a GGUF file: the prefill through float16 copies of the file's values, decode
    through banyan's kernel, which rounds x to int8 per block of 32 as llama.cpp does (tests/unit/test_prequantized.py
    bounds the error). On these random tiny models greedy texts may then part: measured over the five layouts and
    two seeds, 22 of 30 prompts gave the reference's 8 tokens, the others parted after 1 to 7; the first is promised."""
    path, _, want = checkpoint
    got = generate(path)
    assert [t[:1] for t in got] == [t[:1] for t in want]
    assert all(len(tokens) == MAX_NEW for tokens in got)
