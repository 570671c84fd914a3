"""ZeroCostRunner: a model runner double whose "model" costs nothing.

It returns the same fixed logits every step, so a benchmark through it measures everything
around the model: scheduler, KV cache manager, the real sampler, and the frontend's detokenizer.
Give it to the engine as `LLM.from_config(config, runner_factory=ZeroCostRunner)`.
"""

from __future__ import annotations

import torch

import time

from banyan.config import CacheConfig, ModelConfig, default_num_threads
from banyan.layers.sampler import Sampler
from banyan.runner.host_malloc import keep_freed_heap
from banyan.runner.weights import ModelSource
from banyan.scheduler.batch import Batch, SampledToken, StepResult

DEFAULT_NUM_PAGES = 1 << 15


class ZeroCostRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, source: ModelSource, limits=None):
        self.num_pages = cache_config.num_pages or DEFAULT_NUM_PAGES
        torch.set_num_threads(model_config.num_threads or default_num_threads())  # as the real runner does
        keep_freed_heap()
        self.dtype = torch.float32
        self.sampler = Sampler(source.arch.vocab_size, default_seed=model_config.seed)
        generator = torch.Generator().manual_seed(model_config.seed)
        self._vocab_size = source.arch.vocab_size
        self._logits = torch.randn(1, self._vocab_size, generator=generator)  # grown to the batch on demand
        self.sampler_seconds = 0.0  # time spent in the real sampler, to split it from the rest

    def use_grammar(self, backend) -> None:
        """Grammar masks are skipped here."""

    @torch.inference_mode()
    def execute(self, batch: Batch) -> StepResult:
        """One fixed logits row per sampling request; prompt logprobs and grammar masks are skipped."""
        requests = [item.request for item in batch.scheduled if item.samples]
        result = StepResult()
        if not requests:
            return result
        logits = self._rows(len(requests))
        start = time.perf_counter()
        out = self.sampler(logits, requests)
        self.sampler_seconds += time.perf_counter() - start
        for i, request in enumerate(requests):
            result.sampled[request.request_id] = SampledToken(out.token_ids[i], out.chosen_logprobs[i], out.logprobs[i])
        return result

    def _rows(self, count: int) -> torch.Tensor:
        if self._logits.shape[0] < count:
            # Rows differ (rolled) so that greedy requests pick different tokens.
            self._logits = torch.stack([self._logits[0].roll(i * 7919) for i in range(count)])
        return self._logits[:count]
