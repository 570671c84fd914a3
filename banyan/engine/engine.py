"""Engine: the core loop. `step()` is the table of contents: schedule, execute, update.

The engine speaks token ids. Text (tokenizing prompts, detokenizing, stop strings) belongs to
the frontends: `LLM` in-process, the API server across a socket; both hand the engine the same
validated requests and read the same `RequestDelta`s back.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Callable, Iterable, Sequence

from banyan.checkpoint.pooling import model_pooling
from banyan.config import EngineConfig
from banyan.engine.grammar import Grammars
from banyan.engine.overlap import Overlap
from banyan.engine.speculation import draft_runner_kwargs, open_draft, start_speculation
from banyan.engine.stats import EngineSnapshot, KvCensus
from banyan.errors import CacheCapacityError, ContextLengthExceededError, InvalidParameterError, LoRAAdapterError
from banyan.kv_cache import KVCacheIntegrityError, KVCacheManager
from banyan.lora.request import LoRARequest
from banyan.lora.resident import ResidentAdapters
from banyan.lora.weights import load_adapter_weights
from banyan.models.registry import get_model_class
from banyan.pooling_params import PoolingParams
from banyan.text.reasoning import REASONING_PARSERS, GrammarGate
from banyan.request import Request, RequestDelta, RequestStatus, Slo
from banyan.runner.memory import fitting_context
from banyan.runner.model_runner import ModelRunner, RunnerLimits
from banyan.runner.worker import runner_factory as parallel_runner_factory
from banyan.runner.weights import open_model
from banyan.sampling_params import SamplingParams
from banyan.scheduler import Scheduler
from banyan.scheduler.overlap import OverlapScheduler, async_scheduling
from banyan.scheduler.policy import with_defaults
from banyan.spec.speculator import Speculator

logger = logging.getLogger(__name__)
SPEC_LOG_INTERVAL = 5.0
"""Seconds between two log lines of speculation's acceptance (each covers the drafts since the one before)."""


class Engine:
    def __init__(self, config: EngineConfig, runner_factory: Callable[..., ModelRunner] = ModelRunner):
        """runner_factory(model_config, cache_config, source, limits): the model runner (benchmarks swap in a
        double). The runner sizes the KV pool and logs what it holds."""
        self.config = config
        source = open_model(config.model.model, config.model.trust_remote_code, config.model.tokenizer)
        self.arch = source.arch
        self.tokenizer = source.tokenizer
        self.max_model_len = resolve_max_model_len(config, source.arch)
        self.eos_token_ids = eos_token_ids(source)
        self.pooling = model_pooling(source.path, config.model.pooling)  # how embedding requests pool
        self.grammar_gate = reasoning_grammar_gate(config.model.reasoning_parser, self.tokenizer)
        sched = config.scheduler
        limits = RunnerLimits(sched.max_num_seqs, sched.max_num_batched_tokens, self.max_model_len)
        lora = config.lora if config.lora.enable_lora else None
        if lora and config.parallel.tensor_parallel_size > 1:  # the slots would need sharding like the layers
            raise InvalidParameterError("enable_lora", "LoRA adapters are not supported with tensor parallelism yet")
        runner_factory = parallel_runner_factory(config.parallel, runner_factory)  # tensor parallel: workers
        draft = open_draft(config, source)  # speculative draft_model: its K/V count in the pool
        runner_kwargs = ({"lora_config": lora} if lora else {}) | draft_runner_kwargs(config, draft)
        if config.parallel.processes > 1:  # replicas and ranks on this host size their pools at once: each its share
            runner_kwargs["pools_on_host"] = config.parallel.pools_on_host()
        self.runner = runner_factory(config.model, config.cache, source, limits, **runner_kwargs)
        if config.model.max_model_len == "auto":  # sized from the model's limit; now from what the pool holds
            self.max_model_len = fitting_context(self.max_model_len, self.runner.num_pages * config.cache.block_size)
        self.adapters = None if lora is None else ResidentAdapters(  # LoRA: which adapters hold the weight slots
            lora.max_loras, lora.max_lora_rank, self.arch, functools.partial(load_adapter_weights, dtype=self.runner.dtype))
        self.kv = KVCacheManager(self.runner.num_pages, config.cache.block_size, config.cache.enable_prefix_caching)
        self.speculator = Speculator(config.speculative) if config.speculative is not None else None
        if self.speculator is not None:
            start_speculation(self.speculator, self.runner, config, limits, draft)
        overlap = async_scheduling(config)
        self.scheduler = (OverlapScheduler if overlap else Scheduler)(
            config.scheduler, self.kv, self.max_model_len, self.speculator, self.adapters)
        self.overlap = Overlap(self.scheduler, self.runner) if overlap else None  # async scheduling (overlap.py)
        self._spec_logged = (time.monotonic(), self.speculator.stats.copy() if self.speculator is not None else None)
        self._stepped = (0.0, 0, 0.0, 0, 0)  # the last step's start, tokens, drafting seconds, drafts, sequences
        self.grammars = Grammars(
            config.model.structured_output_backend, self.tokenizer, self.arch.vocab_size, self.eos_token_ids,
            cache_size=config.model.structured_output_cache_size, options=config.model.structured_outputs_config,
            on_build=self.runner.use_grammar,
        )
        self.before_step: list[Callable[[Engine], None]] = []  # test hooks (engine/faults.py); empty otherwise
        gc.collect()
        gc.freeze()  # start-up objects never need collecting: keeps GC pauses out of the step loop

    # -- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        slo: Slo | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Validate and queue one sequence (n > 1 is fanned out by the frontend). With `pooling_params`, an
        embedding request: prefill only, its `sampling_params` unused (pooling_params.py)."""
        if request_id in self.scheduler.requests:
            raise InvalidParameterError("request_id", f"request {request_id!r} is already running")
        self.check_prompt(prompt_token_ids, generates=pooling_params is None)
        sampling_params.verify_for_model(self.arch.vocab_size)
        room = self.max_model_len - len(prompt_token_ids)
        if pooling_params is not None:
            pooling_params, room = self.resolve_pooling(pooling_params), 0
        request = Request(
            request_id,
            prompt_token_ids,
            sampling_params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=min(sampling_params.max_tokens or room, room),
            arrival_time=arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            pooling_params=pooling_params,
        )
        # first: a backend that fails to load queues nothing
        if sampling_params.structured_outputs is not None and pooling_params is None:
            if self.grammar_gate is not None:  # a reasoning model: the grammar starts after the thinking
                request.grammar_gate, request.reasoning_may_open = self.grammar_gate.for_prompt(prompt_token_ids)
            self.grammars.start(request)
        sched = self.config.scheduler
        request.slo = with_defaults(slo, sched.default_ttft_slo_ms, sched.default_tpot_slo_ms)
        if self.scheduler.policy.deadlines is not None:  # slo: refused now rather than late
            self.scheduler.policy.deadlines.check_new(request, self.scheduler.running, self.scheduler.waiting)
        if lora_request is not None:
            self._use_adapter(request, lora_request)
        try:
            self.scheduler.add_request(request)
        except CacheCapacityError:
            if request.lora_id:
                self.adapters.forget(request)
            raise
        return request

    def _use_adapter(self, request: Request, lora_request: LoRARequest) -> None:
        """The request runs with this LoRA adapter: checked now (LoRAAdapterError), its tensors read off the loop."""
        if self.adapters is None:
            raise LoRAAdapterError("LoRA is not enabled on this engine (enable_lora=True, --enable-lora)")
        self.adapters.track(request, lora_request)

    def resolve_pooling(self, params: PoolingParams) -> PoolingParams:
        """The request's pooling with the model's type filled in; InvalidParameterError for dimensions the model
        does not allow (or a model pooling banyan does not implement)."""
        self.pooling.check_dimensions(params.dimensions, self.arch.hidden_size)
        return dataclasses.replace(params, pooling_type=self.pooling.require_type())

    def check_prompt(self, prompt_token_ids: Sequence[int], generates: bool = True) -> None:
        """Raise a typed error for an empty, out-of-vocabulary or too long prompt (one that fills the whole
        context is too long only when it `generates`)."""
        if len(prompt_token_ids) == 0:
            raise InvalidParameterError("prompt", "the prompt is empty")
        vocab = self.arch.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParameterError("prompt", f"token id {bad!r} is outside the vocabulary (size {vocab})")
        if len(prompt_token_ids) > self.max_model_len - generates:
            raise ContextLengthExceededError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's maximum context length is "
                f"{self.max_model_len}, which leaves no room to generate"
            )

    def abort_requests(
        self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[RequestDelta]:
        """End requests now (client gone, stop string seen); their pages are freed at once. Returns the
        last delta of each that was still running (unknown or finished ids are skipped)."""
        return [make_delta(request) for request in self.scheduler.finish_requests(request_ids, status)]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def unfinished_request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    # -- state --------------------------------------------------------------------------------
    def stats(self) -> EngineSnapshot:
        """Load and counters. O(cached pages): for a few times a second, not for every step."""
        kv, sched, grammars = self.kv.stats(), self.scheduler, self.grammars.stats()
        return EngineSnapshot(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            kv_usage=kv.usage,
            num_pages=kv.num_pages,
            num_free_pages=kv.num_free,
            prefix_query_tokens=sched.stats.prefix_query_tokens,
            prefix_hit_tokens=sched.stats.prefix_hit_tokens,
            num_preemptions=sched.stats.num_preemptions,
            num_evicted_pages=self.kv.num_evicted_pages,
            **self._slo_stats(),
            grammar_cache_entries=grammars.get("entries", 0),
            grammar_cache_bytes=grammars.get("bytes", 0),
            grammar_cache_evictions=grammars.get("evictions", 0),
            lora_resident_adapters=len(self.adapters.slot_of) if self.adapters is not None else 0,
            lora_adapter_loads=self.adapters.num_loads if self.adapters is not None else 0,
            **self._spec_stats(),
        )

    def kv_census(self) -> KvCensus:
        """Run the cache's integrity check and count its pages (for GET /admin/kv; O(pages))."""
        try:
            self.kv.check_integrity()
            error = None
        except KVCacheIntegrityError as e:
            error = str(e)
        kv, sched = self.kv.stats(), self.scheduler
        return KvCensus(num_pages=kv.num_pages, num_free=kv.num_free, num_in_use=kv.num_in_use,
                        num_cached=kv.num_cached, num_locked=self.kv.num_locked_pages(),
                        num_running=len(sched.running), num_waiting=len(sched.waiting) + len(sched.waiting_for_grammar),
                        integrity_error=error)

    def _slo_stats(self) -> dict:
        """Under the slo policy, what the server's admission check reads (EngineSnapshot's slo_* fields)."""
        sched = self.scheduler
        return {} if sched.policy.deadlines is None else sched.policy.deadlines.snapshot(sched.running, sched.waiting)

    def _spec_stats(self) -> dict:
        """SpecStats as the snapshot's spec_* fields (none without speculation: they stay zero)."""
        if self.speculator is None:
            return {}
        return {f"spec_{name}": value for name, value in dataclasses.asdict(self.speculator.stats).items()}

    @property
    def num_pages(self) -> int:
        return self.kv.num_pages

    @property
    def device(self) -> str:
        return str(self.runner.device)

    @property
    def dtype(self) -> str:
        return str(self.runner.dtype).removeprefix("torch.")

    def close(self) -> None:
        """Stop the grammar compile threads and the LoRA loader (queued work is cancelled). Idempotent."""
        self.grammars.close()
        if self.adapters is not None:
            self.adapters.close()
        if hasattr(self.runner, "close"):  # tensor parallel: the workers
            self.runner.close()

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        for hook in self.before_step:
            hook(self)
        self._time_steps()
        batch = self.scheduler.schedule()  # async scheduling: the step in flight taken as done
        ended = [make_delta(request) for request in batch.finished]  # never ran
        if self.overlap is not None and (self.overlap.pending is not None or not batch.is_empty):
            return ended + [make_delta(request) for request in self.overlap.run(batch)]
        if batch.is_empty:
            if not ended:  # only grammars compiling or adapters loading: wait for one rather than spin
                self.grammars.wait(self.scheduler.waiting_for_grammar, timeout=0.01)
                if self.adapters is not None:
                    self.adapters.wait(timeout=0.01)
            return ended
        result = self.runner.execute(batch)
        advanced = self.scheduler.update(batch, result)
        if self.speculator is not None:
            if self.scheduler.has_unfinished_requests():  # a next step follows at once: its start ends this period
                drafts = sum(len(item.draft_token_ids) for item in batch.scheduled)
                self._stepped = (self._stepped[0], batch.num_tokens, result.draft_seconds, drafts, len(batch.scheduled))
            self._log_spec()
        return ended + [make_delta(request) for request in advanced]

    def _time_steps(self) -> None:
        """With speculation on: the controller's step-time model learns from each step's period, start to next
        start, so what a step costs besides the forward (scheduling, proposing, verifying, the frontend's
        output processing) counts too. Only back-to-back steps are measured: a step after which nothing was left
        to run, or that ran nothing, is followed by waiting (for requests, a grammar), not by work."""
        if self.speculator is None:
            return
        now = time.perf_counter()
        started, num_tokens, draft_seconds, drafts, seqs = self._stepped
        if num_tokens:
            self.speculator.observe_step(num_tokens, now - started, draft_seconds, drafts, seqs)
        self._stepped = (now, 0, 0.0, 0, 0)

    def _log_spec(self) -> None:
        """At most every SPEC_LOG_INTERVAL seconds, and only when something was drafted: the acceptance since."""
        logged_at, before = self._spec_logged
        now = time.monotonic()
        if now - logged_at < SPEC_LOG_INTERVAL:
            return
        stats = self.speculator.stats
        if stats.num_drafts > before.num_drafts:
            logger.info(stats.since(before).summary())
        self._spec_logged = (now, stats.copy())


def make_delta(request: Request) -> RequestDelta:
    """The request's output tokens not yet reported: one per step, more where the grammar forced
    some (jump-forward). A request that failed (finish_reason "error") sends no token, and its
    `error`. Marks the tokens as reported."""
    failed = request.status == RequestStatus.FINISHED_ERROR
    start, request.num_reported_tokens = request.num_reported_tokens, request.num_output_tokens
    new_token_ids = [] if failed else request.all_token_ids[request.num_prompt_tokens + start :]  # a slice: a copy
    new_logprobs = None if request.logprobs is None else [] if failed else request.logprobs[start:]
    # Positional, the rare fields set after: one of these is built per request per step.
    delta = RequestDelta(request.request_id, new_token_ids, new_logprobs, request.cumulative_logprob,
                         request.finish_reason, request.stop_reason, request.num_cached_tokens)
    if start == 0 and not failed:  # the first delta: the prompt's logprobs, the time queued
        if request.prompt_logprobs is not None:
            delta.prompt_logprobs = list(request.prompt_logprobs)
        scheduled = request.metrics.first_scheduled_time  # None: the grammar forced the whole output
        if scheduled is not None:
            delta.queue_time = scheduled - request.metrics.arrival_time
    delta.error, delta.embedding = request.error, request.embedding
    return delta


def resolve_max_model_len(config: EngineConfig, arch) -> int:
    """The user's max_model_len, checked against what the model supports."""
    limit = arch.max_position_embeddings
    if arch.sliding_window and arch.sliding_window < limit and not get_model_class(arch.architecture).supports_sliding_window:
        # Without the window in attention, stay where attending to everything equals the model.
        logger.warning("capping the context at the model's sliding window of %d tokens", arch.sliding_window)
        limit = arch.sliding_window
    wanted = None if config.model.max_model_len == "auto" else config.model.max_model_len  # auto: see Engine
    if wanted is not None and wanted > limit:
        raise InvalidParameterError("max_model_len", f"{wanted} exceeds the model's context length of {limit}")
    max_model_len = wanted or limit
    sched = config.scheduler
    if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_model_len:
        raise InvalidParameterError(
            "max_num_batched_tokens",
            f"without chunked prefill it must be >= max_model_len ({max_model_len}), got {sched.max_num_batched_tokens}",
        )
    return max_model_len


def reasoning_grammar_gate(parser: str | None, tokenizer) -> GrammarGate | None:
    """With a reasoning parser whose markers are single tokens: what holds a grammar back until the thinking ends
    (without one, a grammar applies from the first token, thinking included, and a warning says so)."""
    if parser is None:
        return None
    fmt = REASONING_PARSERS.get(parser)
    gate = fmt.grammar_gate(tokenizer)
    if gate is None:
        logger.warning("reasoning parser %s: %s or %s is not one token of this vocabulary; structured output and "
                       "tools constrain the reasoning too", parser, fmt.start, fmt.end)
    return gate


def eos_token_ids(source) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config's, else config.json's, else the tokenizer's."""
    eos = source.generation_config.get("eos_token_id")
    if eos is None:
        eos = list(source.arch.eos_token_ids) or source.tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
