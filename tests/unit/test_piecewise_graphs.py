"""Piecewise CUDA graphs for mixed prefill + decode steps (runner/piecewise_graphs.py), run eagerly on a CPU:
the dense pieces padded to a token bucket, attention between them over the real rows, give the plain forward's
logits and greedy tokens, with chunked prefill and prefix hits, fp8 weights and an fp8 KV cache. On a GPU the same
pieces are captured and replayed (scripts/gpu_check.sh measures graphs == eager there)."""

from __future__ import annotations

import random

import pytest
import torch

from banyan.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from banyan.engine.engine import Engine
from banyan.runner.piecewise_graphs import token_buckets
from banyan.sampling_params import SamplingParams
from tests.factories import write_model_dir

BUCKETS = [8, 16, 32]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    vocab = write_model_dir(path, "llama", seed=4).config.vocab_size
    rng = random.Random(2)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (36, 3, 11, 26, 19)]
    prompts[3] = prompts[0][:16] + prompts[3][16:]  # 16 tokens shared with the first prompt: a prefix-cache hit
    return path, prompts


def make_engine(path, quantization: str | None, kv_cache_dtype: str) -> Engine:
    return Engine(EngineConfig(
        model=ModelConfig(model=str(path), device="cpu", dtype="float32", quantization=quantization or "none"),
        cache=CacheConfig(num_pages=96, block_size=4, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24),  # chunked prefill beside decode rows
    ))


def generate(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """The first prompt alone (it fills the prefix cache), then the rest at once: mixed steps, one prefix hit."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for wave in ([0], range(1, len(prompts))):
        for i in wave:
            engine.add_request(str(i), prompts[i], params)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return [tokens[str(i)] for i in range(len(prompts))]


class Compared:
    """Runs the plain forward first, then the piecewise one (whose K/V stay in the cache), and keeps how far apart
    their logits are, step by step: (tokens, prefill rows too?, bucket, max |difference|, argmax equal)."""

    def __init__(self, runner):
        self.runner, self.piecewise_run = runner, runner.piecewise.run
        self.steps: list[tuple[int, bool, int, float, bool]] = []
        runner.piecewise.run = self.run

    def run(self, fb):
        logits = self.runner.model.compute_logits
        plain = logits(self.runner.model(fb, self.runner.kv_caches)[fb.logits_indices])
        hidden = self.piecewise_run(fb)
        pieces = logits(hidden[fb.logits_indices])
        diff = (plain - pieces).abs().max().item() if plain.numel() else 0.0
        equal = torch.equal(plain.argmax(-1), pieces.argmax(-1))
        self.steps.append((fb.num_tokens, not fb.is_decode_only, self.runner.piecewise.bucket(fb.num_tokens), diff,
                           equal))
        return hidden


@pytest.mark.parametrize("quantization, kv_cache_dtype, tolerance", [
    (None, "auto", 1e-4),
    ("fp8", "auto", 1e-3),  # torch._scaled_mm on the CPU, inputs quantized per row: padding rows change nothing
    (None, "fp8", 1e-4),
    ("fp8", "fp8", 1e-3),
])
def test_padded_pieces_give_the_plain_forwards_logits_and_tokens(tiny, quantization, kv_cache_dtype, tolerance):
    path, prompts = tiny
    expected = generate(make_engine(path, quantization, kv_cache_dtype), prompts)
    engine = make_engine(path, quantization, kv_cache_dtype)
    engine.runner.start_piecewise_graphs(capture=False, buckets=BUCKETS)
    compared = Compared(engine.runner)
    assert generate(engine, prompts) == expected
    mixed = [step for step in compared.steps if step[1] and step[0] > 1]
    assert len(mixed) >= 3, "the workload must hold mixed prefill + decode steps"
    assert {bucket for _, _, bucket, _, _ in compared.steps} == set(BUCKETS)
    assert all(equal for *_, equal in compared.steps)
    assert max(diff for _, _, _, diff, _ in compared.steps) < tolerance


def test_token_buckets():
    assert token_buckets(8192) == [8, 16, 32, 64, 128, 256, 512]
    assert token_buckets(100) == [8, 16, 32, 64, 100]
    assert token_buckets(8) == [8]
    assert token_buckets(5) == [5]
