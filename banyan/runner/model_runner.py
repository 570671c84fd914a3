"""ModelRunner: Batch -> ragged tensors -> model -> sampler -> StepResult.

It owns the device side: the model's weights, the paged KV cache tensors and the sampler. It
knows requests only through the Batch, which carries each request's page ids.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from banyan.config import CacheConfig, LoRAConfig, ModelConfig, default_num_threads
from banyan.distributed.pipeline import Pipeline
from banyan.distributed.tensor_parallel import TensorParallel
from banyan.errors import InvalidParameterError
from banyan.layers.attention.base import kv_torch_dtype
from banyan.layers.pooler import pool
from banyan.layers.sampler import Sampler, compute_prompt_logprobs
from banyan.lora.layers import LoRAGroups, LoRAModel
from banyan.models.registry import get_model_class
from banyan.quantization.formats import FP16
from banyan.quantization.linear import BF16_ROWS
from banyan.quantization import (FILE_METHODS, default_method, finish_loading, model_weight_bytes, plan_formats,
                                 quantize_linears, use_fixed_order, why_not_invariant_by_default)
from banyan.runner.cpu_step import CpuDecodeStep
from banyan.runner.device import (attention_backend, cpu_has_bf16_matmul, default_dtype, resolve_device, resolve_dtype,
                                  without_random_init)
from banyan.runner.cuda_graphs import DecodeGraphs, graph_buckets
from banyan.runner.drafter import NetworkDrafter
from banyan.runner.host_malloc import keep_freed_heap
from banyan.runner.host_reads import HostReads
from banyan.runner.logits_plan import LogitsPlan
from banyan.runner.overlap import KeepIds, LaunchedStep, PendingIds
from banyan.runner.piecewise_graphs import PiecewiseGraphs, piecewise_capable, token_buckets
from banyan.runner.verify_step import verify_drafts
from banyan.forward_batch import ForwardBatch, to_device
from banyan.runner.memory import (GiB, KVCapacity, cpu_kv_budget, lazily_zeroed, pages_for_budget, profile_batch,
                                  profile_cuda_forward)
from banyan.runner.weights import ModelSource
from banyan.scheduler.batch import Batch, SampledToken, StepResult
from banyan.structured import GrammarBackend, allocate_bitmask
from banyan.structured.bitmask import allow_token

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class RunnerLimits:
    """The largest step the scheduler hands the runner: what memory profiling and CUDA graphs are sized for."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, source: ModelSource, limits: RunnerLimits,
                 lora_config: LoRAConfig | None = None, parallel: TensorParallel | Pipeline | None = None,
                 draft_kv_bytes_per_token: int = 0, pools_on_host: int = 1):
        """parallel: this process's place in a tensor-parallel or pipeline group (runner/worker.py): it builds, loads
        and caches only its part (`local_arch`: its heads, KV heads, MLP and vocabulary rows, or its layers).
        draft_kv_bytes_per_token: what a draft model's K/V take per token beside this pool's (speculative
        draft_model): the pool is sized for both. pools_on_host: ParallelConfig.processes (runner/memory.py)."""
        self.draft_kv_bytes_per_token = draft_kv_bytes_per_token
        self.pools_on_host = pools_on_host
        self.arch = source.arch
        self.parallel = parallel
        self.shard = parallel.local_arch() if parallel is not None else source.arch
        self.limits = limits
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, source.arch.torch_dtype, self.device, source.path.is_file())
        self.kv_dtype = kv_torch_dtype(cache_config.kv_cache_dtype, self.dtype, self.device)
        self.page_size = cache_config.block_size
        if self.device.type == "cpu":
            torch.set_num_threads(model_config.num_threads or default_num_threads())
            keep_freed_heap()  # each step's logits and activations reuse freed memory (runner/host_malloc.py)
        self.attn = attention_backend(model_config.attention_backend, self.device, self.kv_dtype)
        self.lora_wanted = lora_config is not None
        self.batch_invariant = bool(model_config.batch_invariant)  # None (the default) is decided in _load_model
        self.model = self._load_model(source, model_config)
        self.lora = None if lora_config is None else LoRAModel.install(  # before the KV pool is sized: memory
            self.model, lora_config.max_loras, lora_config.max_lora_rank, self.dtype, self.device)
        self.capacity = self._kv_capacity(cache_config)
        logger.info("%s", self.capacity.describe())
        self.num_pages = self.capacity.num_pages
        self.reserved_page = self.num_pages  # one page past the pool: padding rows of graph batches write there
        self.kv_caches = [(self._kv_pages(self.num_pages + 1), self._kv_pages(self.num_pages + 1))
                          for _ in range(self.shard.num_hidden_layers)]
        self.decode_graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None  # mixed prefill + decode steps
        self.cpu_step = None if lora_config or parallel else CpuDecodeStep.build(self.model, self.attn, self.kv_caches)
        if self.device.type == "cuda" and not model_config.enforce_eager and parallel is None:
            self.start_decode_graphs(capture=True)
            self.start_piecewise_graphs(capture=True)
        self.sampler = Sampler(self.arch.vocab_size, default_seed=model_config.seed)
        self.to_host = HostReads()  # the step's device->host reads, counted (runner/host_reads.py)
        self.grammar: GrammarBackend | None = None  # fills the masks of rows with a matcher (structured output)
        self._bitmask: torch.Tensor | None = None  # grammar masks, grown on demand
        self.drafter: NetworkDrafter | None = None  # speculation by a network: drafts inside the step
        self._pinned: torch.Tensor | None = None  # async scheduling on CUDA: sampled ids land here (_pinned_ids)

    def _load_model(self, source: ModelSource, model_config: ModelConfig) -> torch.nn.Module:
        model_cls = get_model_class(self.arch.architecture)
        choice = default_method(model_config.quantization, self.device, self.dtype, source.arch.torch_dtype,
                                source.path.is_file(), source.quantization)
        method = choice.method
        amx = self.device.type == "cpu" and cpu_has_bf16_matmul()  # bf16 copies for prefill, unless batch-invariant
        started = time.perf_counter()
        with default_dtype(self.dtype), torch.device(self.device), without_random_init():
            model = model_cls(self.shard, self.attn)
            plan = {} if method is None else plan_formats(model, method, model_config.quantization_group_size,
                                                          source.compact_formats(), fill=FP16 if choice.mix_fp16 else None)
            if model_config.batch_invariant is None:
                blocker = why_not_invariant_by_default(model, self.device, self.dtype, plan, self.attn.name,
                                                       self.lora_wanted, self.parallel is not None, amx)
                self.batch_invariant = blocker is None
                logger.info("batch invariance %s", "on (the default here)" if blocker is None else f"off: {blocker}")
            if method is not None:
                quantize_linears(model, plan, wide_fp16=choice.mix_fp16, batch_invariant=self.batch_invariant,
                                 wide_bf16=amx and not self.batch_invariant)
        if amx and not self.batch_invariant and self.attn.name == "torch":
            self.attn.bf16_chunks = True  # wide prefill chunks attend in bf16 too (torch_backend.BF16_CHUNK_ROWS)
        compact = method in FILE_METHODS
        # Each tensor read straight onto the device in its stored dtype, copied into its parameter in the model's.
        if self.parallel is not None:
            model.load_weights(self.parallel.weights(source, compact))
        else:
            model.load_weights(source.iter_weights(compact, device=self.device))
        finish_loading(model)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # start-up, not a step: the load's time includes its copies
        self.load_seconds = time.perf_counter() - started
        if self.batch_invariant:
            if self.attn.name != "torch":
                raise InvalidParameterError("batch_invariant", f"needs the torch attention backend, not {self.attn.name}")
            self.attn.fixed_order = use_fixed_order(model)  # attention in a fixed order too
        if self.parallel is not None:  # the collectives, hooked on the final modules
            model = self.parallel.transform(model)
        copies = any(getattr(m, "wide", None) is not None for m in model.modules())  # float16 copies for wide calls
        bf16 = any(getattr(m, "bf16", None) is not None for m in model.modules())  # AMX: bf16 copies for prefill
        logger.info("weights: %.1f MiB (%s%s%s) loaded in %.2f s", model_weight_bytes(model) / 2**20, method or self.dtype,
                    ", float16 for the rest and for wide batches" if choice.mix_fp16 and copies else "",
                    f", bf16 copies for calls of {BF16_ROWS}+ rows (AMX)" if bf16 else "", self.load_seconds)
        return model.eval()

    def _kv_pages(self, num_pages: int) -> torch.Tensor:
        shape = (num_pages, self.page_size, self.shard.num_key_value_heads, self.arch.head_dim)
        if self.device.type == "cpu":
            return lazily_zeroed(shape, self.kv_dtype)
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def _kv_capacity(self, cache_config: CacheConfig) -> KVCapacity:
        per_token = self.shard.kv_bytes_per_token(self.kv_dtype.itemsize) + self.draft_kv_bytes_per_token
        if cache_config.num_pages is not None:
            num_pages, basis = cache_config.num_pages, "num_pages"
        else:
            budget, basis, param = self._kv_budget(cache_config, per_token)
            num_pages = pages_for_budget(budget, self.page_size, per_token)
            if num_pages < 2:
                raise InvalidParameterError(param, f"{basis}: fewer than 2 pages of {self.page_size * per_token} bytes")
        if self.parallel is not None:  # every rank holds the same pages
            num_pages = self.parallel.agree_min(num_pages)
        dtype = str(self.kv_dtype).removeprefix("torch.")
        return KVCapacity(num_pages, self.page_size, per_token, self.limits.max_model_len, dtype, basis)

    def _kv_budget(self, cache_config: CacheConfig, per_token: int) -> tuple[int, str, str]:
        """Bytes for the KV pool, where they come from, and the setting that decides them."""
        if cache_config.kv_cache_memory is not None:
            budget = cache_config.kv_cache_memory
            return budget, f"--kv-cache-memory {budget / GiB:.2f} GiB", "kv_cache_memory"
        if self.device.type == "cuda":
            util = cache_config.gpu_memory_utilization
            profile = profile_cuda_forward(self.profile_forward)
            return profile.kv_budget(util), f"--gpu-memory-utilization {profile.describe(util)}", "gpu_memory_utilization"
        budget, basis = cpu_kv_budget(self.shard, self.arch.vocab_size, self.limits, self.page_size, per_token,
                                      model_weight_bytes(self.model), self.pools_on_host)
        return budget, basis, "kv_cache_memory"

    @torch.inference_mode()
    def profile_forward(self) -> torch.Tensor:
        """The largest step the scheduler can hand out, through the model and the logits projection, over a
        one-page cache shared by every layer: activations at their peak, no KV pool needed."""
        limits = self.limits
        fb = profile_batch(limits.max_num_batched_tokens, limits.max_model_len, limits.max_num_seqs,
                           self.page_size, self.device)
        one_page = [(self._kv_pages(1), self._kv_pages(1))] * self.shard.num_hidden_layers
        hidden = self.model(fb, one_page)
        return self.model.compute_logits(hidden[fb.logits_indices])

    @torch.inference_mode()
    def time_forward(self, num_tokens: int, context_len: int = 256) -> float:
        """Seconds of one step's forward and logits over `num_tokens` query tokens of one sequence that has
        `context_len` tokens in all (a verify pass's shape; 1 token is a decode), through the kernels a real
        step takes. Every K/V slot is the reserved page, so the pool and the requests in it are untouched."""
        if not 1 <= num_tokens <= self.limits.max_model_len:
            raise ValueError(f"num_tokens must be in [1, max_model_len={self.limits.max_model_len}], got {num_tokens}")
        fb = self._reserved_page_batch(num_tokens, min(max(context_len, num_tokens), self.limits.max_model_len))
        started = time.perf_counter()
        hidden = self._forward(fb)
        self.model.compute_logits(hidden[fb.logits_indices])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def _reserved_page_batch(self, num_tokens: int, context_len: int) -> ForwardBatch:
        P, dev = self.page_size, self.device
        positions = list(range(context_len - num_tokens, context_len))
        width = -(-context_len // P)
        return ForwardBatch(
            input_ids=torch.zeros(num_tokens, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor([self.reserved_page * P + p % P for p in positions], dtype=torch.long, device=dev),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([context_len], dtype=torch.int32, device=dev),
            block_tables=torch.full((1, width), self.reserved_page, dtype=torch.int32, device=dev),
            logits_indices=torch.arange(num_tokens, device=dev),
            query_lens=[num_tokens],
            context_lens=[context_len],
            page_size=P,
        )

    def start_decode_graphs(self, capture: bool) -> None:
        """Decode steps through padded static buffers: replayed CUDA graphs, or (capture=False) run eagerly."""
        if capture and not self.attn.supports_cuda_graphs:
            logger.info("CUDA graphs off: the %r attention backend is not graph-safe; decode runs eagerly", self.attn.name)
            return
        buckets = graph_buckets(self.limits.max_num_seqs)
        max_pages = -(-self.limits.max_model_len // self.page_size)
        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, buckets=buckets, max_pages=max_pages,
                                          page_size=self.page_size, reserved_page=self.reserved_page,
                                          device=self.device, capture=capture)
        if capture:
            self.decode_graphs.capture_all()

    def start_piecewise_graphs(self, capture: bool, buckets: list[int] | None = None) -> None:
        """Steps of up to 512 tokens (any mix of prefill and decode) through dense pieces padded to a token bucket:
        replayed CUDA graphs with attention eager between them, or (capture=False) all eager."""
        if not piecewise_capable(self.model):
            logger.info("CUDA graphs for mixed steps off: %s is not a stack of decoder layers",
                        type(self.model).__name__)
            return
        buckets = buckets or token_buckets(self.limits.max_num_batched_tokens)
        self.piecewise = PiecewiseGraphs(self.model, self.kv_caches, buckets=buckets, device=self.device,
                                         capture=capture)
        if capture:
            self.piecewise.capture_all()

    def use_grammar(self, backend: GrammarBackend) -> None:
        """The grammar backend, given once, when the first constrained request builds it."""
        self.grammar = backend

    def use_layer_skip(self, num_layers: int) -> None:
        """Self-speculation: the first num_layers layers draft each step's placeholders (runner/drafter.py)."""
        total = self.arch.num_hidden_layers
        if not 1 <= num_layers < total:
            raise InvalidParameterError("num_layers", f"layer_skip drafts with 1 to {total - 1} of the target's "
                                                      f"{total} layers, got {num_layers}")
        self.drafter = NetworkDrafter(self.model, self.kv_caches, self.sampler.vocab_size, self.page_size,
                                      self.device, num_layers=num_layers)

    def use_draft_model(self, draft: ModelRunner) -> None:
        """A draft model's runner (its weights, and K/V tensors with as many pages as this pool) drafts each step's
        placeholders, catching up on what it has not seen (runner/drafter.py)."""
        vocab = min(self.sampler.vocab_size, draft.sampler.vocab_size)
        self.drafter = NetworkDrafter(draft.model, draft.kv_caches, vocab, self.page_size, self.device, own_cache=True,
                                      forward=draft._forward)

    def time_draft(self, context_len: int = 256) -> float:
        """Seconds of one draft position for one request (the drafter's forward), on the reserved page."""
        position = min(context_len, self.limits.max_model_len) - 1
        return self.drafter.time_position(position, [self.reserved_page] * (position // self.page_size + 1))

    # -- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: Batch) -> StepResult:
        return self.finish(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: Batch, previous: PendingIds | None = None) -> LaunchedStep:
        """The step queued on the device up to its logits, no read. previous: the step before, its sampled ids still
        on the device (async scheduling): the input rows of its placeholders take them there (runner/overlap.py)."""
        self.to_host.new_step()
        drafting = [item for item in batch.scheduled if item.draft_token_ids] if self.drafter is not None else []
        draft_seconds = self.drafter.draft(drafting) if drafting else 0.0  # placeholders -> the drafter's tokens
        lora = self.lora.prepare(batch) if self.lora is not None else None  # orders the requests by adapter
        fb, plan = self._prepare(batch)
        if previous is not None:
            previous.fill(fb.input_ids, batch)
        hidden = self._forward(fb, lora)  # [num_tokens, hidden]
        logits = self.model.compute_logits(hidden[fb.logits_indices])  # [num_logits, vocab] fp32
        return LaunchedStep(plan, hidden, logits, drafting, draft_seconds)

    @torch.inference_mode()
    def finish(self, step: LaunchedStep, keep_ids: bool = False) -> StepResult | PendingIds:
        """Sample the launched step (rows of requests that ended since it was launched left out). keep_ids: leave the
        ids on the device and return them pending (the step must have no logprobs, prompt logprobs, drafts or
        pooling); a step that samples nothing returns its result anyway."""
        plan = step.plan
        plan.drop_finished()
        masks = self._grammar_masks(plan)  # on a GPU, filled on the CPU while the forward runs
        kept = KeepIds() if keep_ids else None
        result = self._sample(step.logits, plan, masks, kept or self.to_host)
        if kept is not None and kept.tensor is not None:
            return PendingIds(kept.tensor, result, self._pinned_ids(kept.tensor.shape[0]))
        if plan.pool:  # embedding requests: pooled hidden states instead of a token
            result.pooled = pool(step.hidden, plan.pool)
        if step.drafting:
            self.drafter.verified(step.drafting, result.verified)
        result.draft_seconds = step.draft_seconds
        return result

    def _pinned_ids(self, rows: int) -> torch.Tensor | None:
        """On CUDA, the pinned host buffer sampled ids are copied into without a wait (one: a step's ids are read
        before the next step's are copied); None on a CPU."""
        if self.device.type != "cuda":
            return None
        if self._pinned is None or self._pinned.shape[0] < rows:
            self._pinned = torch.empty(max(rows, self.limits.max_num_seqs), dtype=torch.long, pin_memory=True)
        return self._pinned

    def _forward(self, fb: ForwardBatch, lora: LoRAGroups | None = None) -> torch.Tensor:
        """lora: the rows that run LoRA adapters this step (None: every row runs the base model)."""
        if lora is not None:
            with self.lora.bound(lora):
                return self.model(fb, self.kv_caches)
        # CUDA graphs (decode-only steps whole, others piecewise); on a CPU, a few rows' layers in one C call
        for fast in (self.decode_graphs, self.piecewise, self.cpu_step):
            if fast is not None and fast.fits(fb):
                return fast.run(fb)
        return self.model(fb, self.kv_caches)

    def _grammar_masks(self, plan: LogitsPlan) -> tuple[torch.Tensor, list[int]] | None:
        """(bitmask, sampler rows): bitmask row j masks sampler row rows[j]. None when no row is constrained."""
        rows = [i for i, request in enumerate(plan.sample_requests) if request.grammar_active]
        if not rows:
            return None
        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            self._bitmask = allocate_bitmask(max(16, 2 * len(rows)), self.arch.vocab_size)
        self.grammar.fill_bitmasks(self._bitmask, [(j, plan.sample_requests[i].matcher) for j, i in enumerate(rows)])
        for j, i in enumerate(rows):  # reasoning: the first token may open a thinking instead (text/reasoning.py)
            if plan.sample_requests[i].reasoning_may_open is not None:
                allow_token(self._bitmask, j, plan.sample_requests[i].reasoning_may_open[0])
        return self._bitmask, rows

    def _prepare(self, batch: Batch) -> tuple[ForwardBatch, LogitsPlan]:
        P = self.page_size
        ids, positions, slots, query_start, context_lens, tables = [], [], [], [0], [], []
        plan = LogitsPlan()
        for item in batch.scheduled:
            request, start, end, pages = item.request, item.start, item.end, item.page_ids
            row0 = len(ids)
            ids.extend(item.token_ids)
            positions.extend(range(start, end))
            slots.extend(pages[p // P] * P + p % P for p in range(start, end))
            query_start.append(len(ids))
            context_lens.append(end)
            tables.append(pages)
            plan.add_prompt_rows(item, row0)
            if request.pooling_params is not None:
                plan.add_pool_rows(item, row0)
            elif item.samples and item.draft_token_ids:
                last = row0 + item.num_new_tokens - len(item.draft_token_ids) - 1  # the last verified token's row
                plan.add_verify_rows(request, item.draft_token_ids, last)
            elif item.samples:
                plan.add_sample_row(request, row0 + item.num_new_tokens - 1)
        width = max(len(t) for t in tables)
        dev = self.device
        fb = ForwardBatch(
            input_ids=to_device(ids, torch.long, dev),
            positions=to_device(positions, torch.long, dev),
            slot_mapping=to_device(slots, torch.long, dev),
            query_start_loc=to_device(query_start, torch.int32, dev),
            seq_lens=to_device(context_lens, torch.int32, dev),
            block_tables=to_device([list(t) + [0] * (width - len(t)) for t in tables], torch.int32, dev),
            logits_indices=to_device(plan.rows, torch.long, dev),
            query_lens=[item.num_new_tokens for item in batch.scheduled],
            context_lens=context_lens,
            page_size=P,
        )
        return fb, plan

    def _sample(self, logits: torch.Tensor, plan: LogitsPlan, masks, to_host) -> StepResult:
        """The step's tokens, read first through to_host (the one host wait every sampling step makes); prompt
        logprobs, which only the user reads, after them."""
        result = StepResult()
        if plan.sample_requests:
            out = self.sampler(_sample_rows(logits, plan.sample_logit_rows), plan.sample_requests, masks, to_host)
            for i, request in enumerate(plan.sample_requests):
                result.sampled[request.request_id] = SampledToken(out.token_ids[i], out.chosen_logprobs[i], out.logprobs[i])
        if plan.verify:
            result.verified = verify_drafts(logits, plan.verify, self.sampler, self.arch.vocab_size, self.to_host)
        for request, first, count, targets in plan.prompt:
            k = request.sampling_params.prompt_logprobs
            target_ids = to_device(targets, torch.long, logits.device)
            result.prompt_logprobs[request.request_id] = compute_prompt_logprobs(
                logits[first : first + count], target_ids, k, self.to_host)
        return result



def _sample_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows]; logits itself when the step samples every row (a decode step: rows are increasing, so as many of
    them as logits rows are 0..N-1): gathering would copy them all, 50 MB at batch 256 with a 49k vocabulary into
    freshly page-faulted memory (on a 2-vCPU EPYC, greedy at batch 256: gather and sample 56.5 ms, sample 3.3 ms)."""
    if len(rows) == logits.shape[0]:
        return logits
    return logits[to_device(rows, torch.long, logits.device)]  # queued: no wait for the forward
