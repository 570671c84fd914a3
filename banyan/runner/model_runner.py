"""ModelRunner: Batch -> ragged tensors -> model -> sampler -> StepResult.

It owns the device side: the model's weights, the paged KV cache tensors and the sampler. It
knows requests only through the Batch and the page tables the KV manager hands it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence

import torch

from banyan.config import CacheConfig, ModelConfig, default_num_threads
from banyan.errors import InvalidParameterError
from banyan.layers.attention import AttentionBackend, get_attention_backend
from banyan.layers.sampler import Sampler, compute_prompt_logprobs
from banyan.models.registry import get_model_class
from banyan.runner.forward_batch import ForwardBatch
from banyan.runner.weights import ModelSource
from banyan.scheduler.batch import Batch, SampledToken, ScheduledRequest, StepResult
from banyan.structured import GrammarBackend, allocate_bitmask

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_BYTES = 1 << 30

PageTables = Callable[[str], Sequence[int]]


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, source: ModelSource):
        self.arch = source.arch
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, source.arch.torch_dtype, self.device)
        self.page_size = cache_config.block_size
        if self.device.type == "cpu":
            torch.set_num_threads(model_config.num_threads or default_num_threads())
        self.model = self._load_model(model_config, source)
        self.num_pages = self._num_pages(cache_config)
        shape = (self.num_pages, self.page_size, self.arch.num_key_value_heads, self.arch.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.arch.num_hidden_layers)
        ]
        self.sampler = Sampler(self.arch.vocab_size, default_seed=model_config.seed)
        self._bitmask: torch.Tensor | None = None  # grammar masks, grown on demand

    def _load_model(self, model_config: ModelConfig, source: ModelSource) -> torch.nn.Module:
        model_cls = get_model_class(self.arch.architecture)
        attn = _attention_backend(model_config.attention_backend, self.device)
        with _default_dtype(self.dtype), torch.device(self.device):
            model = model_cls(self.arch, attn)
        model.load_weights(source.iter_weights())
        return model.eval()

    def _num_pages(self, cache_config: CacheConfig) -> int:
        if cache_config.num_pages is not None:
            return cache_config.num_pages
        per_page = self.page_size * self.arch.kv_bytes_per_token(self.dtype.itemsize)
        budget = cache_config.kv_cache_memory
        if budget is None:
            budget = DEFAULT_CPU_KV_BYTES if self.device.type != "cuda" else _cuda_kv_budget(cache_config)
        num_pages = budget // per_page
        if num_pages < 2:
            raise InvalidParameterError("kv_cache_memory", f"{budget} bytes hold fewer than 2 pages of {per_page} bytes")
        return num_pages

    # -- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: Batch, page_tables: PageTables, grammar: GrammarBackend | None = None) -> StepResult:
        """grammar: the backend that fills the masks of requests with a matcher (structured output)."""
        fb, plan = self._prepare(batch, page_tables)
        hidden = self.model(fb, self.kv_caches)  # [num_tokens, hidden]
        masks = self._grammar_masks(plan, grammar)  # on a GPU, filled on the CPU while the forward runs
        logits = self.model.compute_logits(hidden[fb.logits_indices])  # [num_logits, vocab] fp32
        return self._sample(logits, plan, masks)

    def _grammar_masks(self, plan: _LogitsPlan, grammar: GrammarBackend | None) -> tuple[torch.Tensor, list[int]] | None:
        """(bitmask, sampler rows): bitmask row j masks sampler row rows[j]. None when no row is constrained."""
        rows = [i for i, request in enumerate(plan.sample_requests) if request.matcher is not None]
        if not rows:
            return None
        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            self._bitmask = allocate_bitmask(max(16, 2 * len(rows)), self.arch.vocab_size)
        grammar.fill_bitmasks(self._bitmask, [(j, plan.sample_requests[i].matcher) for j, i in enumerate(rows)])
        return self._bitmask, rows

    def _prepare(self, batch: Batch, page_tables: PageTables) -> tuple[ForwardBatch, _LogitsPlan]:
        P = self.page_size
        ids, positions, slots, query_start, context_lens, tables = [], [], [], [0], [], []
        plan = _LogitsPlan()
        for item in batch.scheduled:
            request, start, end = item.request, item.start, item.end
            pages = page_tables(request.request_id)[: -(-end // P)]
            row0 = len(ids)
            ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(pages[p // P] * P + p % P for p in range(start, end))
            query_start.append(len(ids))
            context_lens.append(end)
            tables.append(pages)
            plan.add_prompt_rows(item, row0)
            if item.samples:
                plan.add_sample_row(request, row0 + item.num_new_tokens - 1)
        width = max(len(t) for t in tables)
        dev = self.device
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            logits_indices=torch.tensor(plan.rows, dtype=torch.long, device=dev),
            query_lens=[item.num_new_tokens for item in batch.scheduled],
            context_lens=context_lens,
            page_size=P,
        )
        return fb, plan

    def _sample(self, logits: torch.Tensor, plan: _LogitsPlan, masks=None) -> StepResult:
        result = StepResult()
        for request, first, count, targets in plan.prompt:
            k = request.sampling_params.prompt_logprobs
            target_ids = torch.tensor(targets, dtype=torch.long, device=logits.device)
            result.prompt_logprobs[request.request_id] = compute_prompt_logprobs(logits[first : first + count], target_ids, k)
        if plan.sample_requests:
            rows = torch.tensor(plan.sample_logit_rows, dtype=torch.long, device=logits.device)
            out = self.sampler(logits[rows], plan.sample_requests, masks)
            for i, request in enumerate(plan.sample_requests):
                result.sampled[request.request_id] = SampledToken(out.token_ids[i], out.chosen_logprobs[i], out.logprobs[i])
        return result


class _LogitsPlan:
    """Which hidden rows become logits, and what each logits row is for.

    rows:     hidden-state rows to project, in logits order
    prompt:   (request, first logits row, count, next-token targets) for prompt logprobs
    sample:   one logits row per request that samples this step
    """

    def __init__(self):
        self.rows: list[int] = []
        self.prompt: list[tuple] = []
        self.sample_requests: list = []
        self.sample_logit_rows: list[int] = []

    def add_prompt_rows(self, item: ScheduledRequest, row0: int) -> None:
        request = item.request
        if request.prompt_logprobs is None:
            return
        # Position p predicts prompt token p + 1. Positions whose logprobs are already known
        # (computed before a preemption) are skipped, so recompute never duplicates them.
        first = max(item.start, len(request.prompt_logprobs) - 1)
        last = min(item.end, request.num_prompt_tokens - 1)
        if first >= last:
            return
        self.prompt.append((request, len(self.rows), last - first, list(request.all_token_ids[first + 1 : last + 1])))
        self.rows.extend(range(row0 + first - item.start, row0 + last - item.start))

    def add_sample_row(self, request, row: int) -> None:
        self.sample_requests.append(request)
        self.sample_logit_rows.append(len(self.rows))
        self.rows.append(row)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidParameterError("device", "CUDA was asked for but torch sees no CUDA device")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise InvalidParameterError("device", f"must be cpu, cuda or auto, got {name!r}")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32  # exact and portable; bf16 on CPU is a per-machine speed choice
        return DTYPES.get(checkpoint_dtype or "", torch.bfloat16) if checkpoint_dtype != "float32" else torch.bfloat16
    if name not in DTYPES:
        raise InvalidParameterError("dtype", f"must be auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def _attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend asked for; on a GPU without triton installed, `torch` with a warning."""
    if name == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise InvalidParameterError("attention_backend", "'triton' needs a CUDA device (on CPU: 'torch')")
    try:
        return get_attention_backend(name)
    except InvalidParameterError as e:
        if name != "triton" or device.type != "cuda":
            raise
        logger.warning("%s; falling back to the 'torch' attention backend", e)
        return get_attention_backend("torch")


def _cuda_kv_budget(cache_config: CacheConfig) -> int:
    free, total = torch.cuda.mem_get_info()
    used = total - free
    return max(0, int(total * cache_config.gpu_memory_utilization) - used - (512 << 20))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
