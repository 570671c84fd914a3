"""Speculation's start-up in the engine: the draft model opened and checked before the KV pool is sized (its K/V
share the pool's accounting), the runner's drafter set up, then the step-time measurement.

    draft = open_draft(config, source)                 # draft_model: None for the other methods
    runner = runner_factory(..., **draft_runner_kwargs(config, draft))
    start_speculation(speculator, runner, config, limits, draft)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from banyan.config import EngineConfig
from banyan.errors import InvalidParameterError
from banyan.layers.attention.base import kv_torch_dtype
from banyan.runner.device import resolve_device, resolve_dtype
from banyan.runner.model_runner import ModelRunner, RunnerLimits
from banyan.runner.weights import ModelSource, open_model
from banyan.spec.speculator import NETWORK_METHODS, Speculator


def open_draft(config: EngineConfig, target: ModelSource) -> ModelSource | None:
    """The draft model's checkpoint for method draft_model, checked: a typed error naming `model` when it cannot
    be opened or its tokenizer is not the target's (the same token ids must mean the same text)."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return None
    try:
        draft = open_model(spec.model, config.model.trust_remote_code)
    except Exception as e:  # a missing or malformed checkpoint: the config's fault, said at start-up
        raise InvalidParameterError("model", f"cannot open the draft model {spec.model!r}: {e}") from e
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise InvalidParameterError("model", f"the draft model {spec.model!r} has another tokenizer or vocabulary "
                                             f"than the target ({len(draft.tokenizer)} vs {len(target.tokenizer)} "
                                             "tokens, or the same count mapped differently)")
    return draft


def draft_runner_kwargs(config: EngineConfig, draft: ModelSource | None) -> dict[str, Any]:
    """What the target's runner needs to know of a draft model: the bytes its K/V take per token in the pool."""
    if draft is None:
        return {}
    if config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size > 1:
        raise InvalidParameterError("method", "draft_model needs the model in one process (tensor and pipeline "
                                              "parallel size 1)")
    model = config.model
    device = resolve_device(model.device)
    dtype = resolve_dtype(model.dtype, draft.arch.torch_dtype, device, draft.path.is_file())
    itemsize = kv_torch_dtype(config.cache.kv_cache_dtype, dtype, device).itemsize
    return {"draft_kv_bytes_per_token": draft.arch.kv_bytes_per_token(itemsize)}


def start_speculation(speculator: Speculator, runner, config: EngineConfig, limits: RunnerLimits,
                      draft: ModelSource | None) -> None:
    """A network proposer's drafter in the runner (layer_skip, draft_model), then the step-time measurement."""
    spec = config.speculative
    time_draft = None
    if spec.method in NETWORK_METHODS:
        if not hasattr(runner, "use_layer_skip"):
            raise InvalidParameterError("method", f"{spec.method} needs the model in this process (not with "
                                                  "tensor-parallel workers)")
        if draft is not None:  # its own K/V tensors, as many pages as the target's pool
            cache = dataclasses.replace(config.cache, num_pages=runner.num_pages, kv_cache_memory=None)
            runner.use_draft_model(ModelRunner(spec.draft_settings(config.model), cache, draft, limits))
        else:
            runner.use_layer_skip(spec.num_layers or max(1, runner.arch.num_hidden_layers // 2))
        time_draft = runner.time_draft
    if hasattr(runner, "time_forward"):
        speculator.calibrate(runner.time_forward, min(limits.max_num_batched_tokens, limits.max_model_len),
                             time_draft=time_draft)
