"""EngineSnapshot: what `Engine.stats()` reports (a msgspec struct, so the core sends it as is)."""

from __future__ import annotations

import msgspec


class EngineSnapshot(msgspec.Struct, kw_only=True):
    """The engine's load now, and its counters since start-up."""

    num_running: int
    num_waiting: int  # queued or preempted (not those whose grammar is compiling)
    kv_usage: float  # pages held by requests / all pages
    num_pages: int
    num_free_pages: int
    prefix_query_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int  # of those, tokens found there
    num_preemptions: int
    num_evicted_pages: int = 0  # cached pages evicted for room since start-up (the data-parallel router learns it)
    grammar_cache_entries: int = 0  # compiled grammars held (bounded: RELIABILITY C4 G5)
    grammar_cache_bytes: int = 0
    grammar_cache_evictions: int = 0
    lora_resident_adapters: int = 0  # LoRA adapters holding a weight slot now
    lora_adapter_loads: int = 0  # adapters copied into a slot since start-up (first loads, and reloads after eviction)
    # speculation (zero without it): the Speculator's SpecStats, vLLM's spec_decode_* counters
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = msgspec.field(default_factory=list)  # [j]: draft j + 1 accepted
    # the slo policy's measurements (zero under the others): the server refuses early from these
    slo_step_seconds: float = 0.0  # the step time planned with (scheduler/policy.py Deadlines)
    slo_prefill_per_step: float = 0.0  # prompt tokens computed per step while requests queue
    slo_admitted_per_step: float = 0.0  # admissions per step while requests queue
    slo_queue_tokens: int = 0  # prompt tokens still to compute, running and waiting
    slo_queue_requests: int = 0  # requests waiting
    slo_wait_bias: float = 1.0  # the wait estimate's learned error: measured / estimated first-token waits


class KvCensus(msgspec.Struct, kw_only=True):
    """The KV pages counted one by one, after `check_integrity` ran (GET /admin/kv).

    num_pages == num_free + num_in_use + num_cached; num_locked of the in-use pages are radix-tree pages a
    request holds. Idle (nothing running or waiting) num_in_use is 0: any other value is a leaked page."""

    num_pages: int
    num_free: int
    num_in_use: int  # held by at least one request (running, or preempted mid-way: none after free)
    num_cached: int  # in the radix tree, held by no request (evictable)
    num_locked: int  # in the radix tree and held by a request
    num_running: int
    num_waiting: int
    integrity_error: str | None = None  # None: check_integrity passed
