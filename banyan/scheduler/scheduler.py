"""The phase-free scheduler.

There are no prefill and decode phases. Every request has `num_computed_tokens` (KV in the cache)
and `num_tokens` (prompt + output so far); each step hands out token counts under one budget so
that requests catch up:

    running requests first, in policy order: decode (1 token) or the next prefill chunk
    then waiting requests, in policy order: from their cached prefix, as much as the budget allows

A prompt longer than the budget is spread over steps (chunked prefill); a request readmitted
after preemption recomputes from its cached prefix the same way. When pages run out, the request
that would be served last is preempted (its pages freed, recomputed later).
New requests that share a prefix nobody has cached yet compute it once: the first admitted computes it, the others
wait in the queue until its pages are in the radix tree, then start from the cache hit (scheduler/prefix.py).

A structured-output request first waits for its grammar (WAITING_FOR_GRAMMAR, compiled off this
thread) and joins the waiting queue when it is ready; a failed compile ends it alone. After each
sampled token its matcher advances; a preempted request keeps its tokens and so its matcher.

Speculation is catch up too: a decoding request's step may also feed k draft tokens (a proposer's guesses,
k chosen per request by the controller, banyan/spec/speculator.py), with pages for all 1 + k. The runner
verifies them; `update()` appends the accepted ones and the target's own token, rewinds
`num_computed_tokens` to what was verified and gives back the pages only rejected drafts filled. Drafts
never join the request's tokens before they are accepted, so they never reach the radix tree. Without a
speculator, or with k = 0, a step is the plain one.

Jump-forward: where the grammar forces the next tokens (a JSON key, a closing brace), they are
appended at once, right after the sampled token (or before the prompt's first step). They are
then just more tokens to catch up on: the next step computes them together as one extend and
samples from the last position, so k forced tokens cost one forward pass instead of k.

    all_token_ids:  [ ... computed | sampled | forced ... forced ]
                                   ^ the next step runs these k + 1 positions, samples after the last
"""

from __future__ import annotations

import bisect
import functools
import itertools
import time
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

from banyan.config import SchedulerConfig
from banyan.errors import CacheCapacityError, error_info
from banyan.kv_cache import KVCacheManager
from banyan.request import Request, RequestStatus, TokenLogprobs
from banyan.scheduler.batch import Batch, SampledToken, ScheduledRequest, StepResult
from banyan.scheduler.policy import SchedulingPolicy
from banyan.scheduler.prefix import PrefixLeaders, matchable_tokens
from banyan.structured.backend import guarded

if TYPE_CHECKING:
    from banyan.lora.resident import ResidentAdapters
    from banyan.spec.speculator import Speculator


class SchedulerStats:
    """Counters since start-up (the server's metrics read them)."""

    def __init__(self):
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_preemptions = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 speculator: Speculator | None = None, adapters: ResidentAdapters | None = None):
        self.config = config
        self.adapters = adapters  # None: LoRA off; else a request runs once its adapter holds a slot
        self.speculator = speculator  # None: speculation off
        self.kv = kv
        self.max_model_len = max_model_len
        self.policy = SchedulingPolicy(config.policy)
        self.waiting: list[Request] = []  # sorted by policy key
        self.running: list[Request] = []
        self.waiting_for_grammar: list[Request] = []  # arrival order; their grammar is compiling
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._seq = itertools.count()

    # -- requests in and out ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; raises CacheCapacityError if even an empty cache could not hold it."""
        longest = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        if -(-longest // self.kv.page_size) > self.kv.num_pages:
            raise CacheCapacityError(
                f"request needs up to {longest} tokens of KV cache but the whole cache holds "
                f"{self.kv.num_pages * self.kv.page_size}; lower max_tokens or raise the KV cache memory"
            )
        request.seq_no = next(self._seq)
        self.requests[request.request_id] = request
        if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
            self.waiting_for_grammar.append(request)
        else:
            self._enqueue(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, stop string): frees their pages now."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                self.waiting_for_grammar.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_grammar)

    def _refuse_unattainable(self, batch: Batch) -> None:
        """Waiting requests that can no longer meet their TTFT deadline end now, never run (503 slo_unattainable)."""
        order = self.policy.admission_order(self.waiting)
        for request, error in self.policy.deadlines.unattainable(self.running, order):
            self.waiting.remove(request)
            request.fail(error_info(error))
            self._release(request)
            batch.finished.append(request)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> Batch:
        batch = Batch()
        if self.waiting_for_grammar:
            self._check_grammars(batch)
        if self.policy.deadlines is not None:
            self._refuse_unattainable(batch)
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=self.policy.key)
        drafts = self._drafts() if self.speculator is not None else {}
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            draft = drafts.get(request.request_id)
            draft = self._allocate_drafts(request, num_new, draft[: budget - num_new]) if draft else []
            if not draft and not self._allocate_or_preempt(request, num_new, batch):
                break  # the request itself was the last in line and got preempted
            batch.scheduled.append(self._scheduled(request, num_new, draft))
            budget -= num_new + len(draft)
            i += 1
        if not batch.preempted:  # short of pages: admitting more would only thrash
            self._admit_waiting(batch, budget)
        if self.policy.deadlines is not None:  # this step's work, timed by the next call
            self.policy.deadlines.observe_schedule(batch.scheduled, bool(self.waiting))
        if self.adapters is not None and batch.scheduled:  # loads wait for a step that runs
            batch.lora_slots, batch.lora_loads = dict(self.adapters.slot_of), self.adapters.take_loads()
        return batch

    def update(self, batch: Batch, result: StepResult) -> list[Request]:
        """Advance the scheduled requests by what the step computed; returns those that got a token."""
        advanced = []
        now = time.time()
        for item in batch.scheduled:
            request = item.request
            if request.is_finished:
                continue
            request.num_computed_tokens = item.end
            if request.prompt_logprobs is not None:
                request.prompt_logprobs.extend(result.prompt_logprobs.get(request.request_id, ()))
            sampled = result.sampled.get(request.request_id)
            if sampled is not None:
                self._append_sampled(request, sampled, now)
                advanced.append(request)
            elif request.request_id in result.verified:
                self._append_verified(item, result.verified[request.request_id], now)
                advanced.append(request)
            elif request.request_id in result.pooled:  # an embedding: done with its prompt, never sampled
                request.embedding = result.pooled[request.request_id]
                request.status = RequestStatus.FINISHED_STOPPED
                advanced.append(request)
            self.kv.cache_completed_pages(
                request.request_id, request.all_token_ids, request.num_computed_tokens, self._namespace(request)
            )
            if request.is_finished:
                self.running.remove(request)
                self._release(request)
        return advanced

    # -- helpers ------------------------------------------------------------------------------
    def _check_grammars(self, batch: Batch) -> None:
        """Requests whose grammar is ready join the waiting queue; a failed compile ends its request."""
        for request in [r for r in self.waiting_for_grammar if r.grammar is not None and r.grammar.done()]:
            self.waiting_for_grammar.remove(request)
            self._take_matcher(request)
            if request.is_finished:  # a failed compile, or a grammar that forced the whole output
                self._release(request)
                batch.finished.append(request)
            else:
                self._enqueue(request)

    def _take_matcher(self, request: Request) -> None:
        """The compiled grammar's matcher, and the tokens it forces first (they join the first step)."""
        try:
            request.matcher = request.grammar.result()
        except Exception as e:  # StructuredOutputError, or a library failure: this request only
            request.fail(getattr(e, "message", str(e)), getattr(e, "param", None))
            return
        request.status = RequestStatus.WAITING
        self._jump_forward(request)

    def _admit_waiting(self, batch: Batch, budget: int) -> None:
        if not self.waiting:  # the usual decode step: no walk over the running requests for leaders
            return
        leaders = self._prefix_leaders()
        for request in self.policy.admission_order(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            namespace, matchable = self._namespace(request), matchable_tokens(request)
            if leaders is not None and leaders.leader_of(request, namespace, matchable) is not None:
                continue  # another request is computing pages of its prompt: reuse them once cached (prefix.py)
            if request.lora_id and not self._admit_adapter(request, batch):
                continue  # its adapter is loading, or every slot is pinned: later requests may go ahead
            prefix = self.kv.match_prefix(request.all_token_ids[:matchable], namespace)
            num_new = request.num_tokens - prefix.num_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    return
                num_new = budget
            if not self.kv.allocate_slots(request.request_id, prefix.num_tokens + num_new, prefix):
                if request.lora_id:
                    self.adapters.unpin(request)
                return  # head-of-line: later requests wait too, so none overtakes it
            self._start(request, prefix.num_tokens)
            batch.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            if leaders is not None:
                leaders.add(request, namespace)

    def _prefix_leaders(self) -> PrefixLeaders | None:
        """The running requests still computing their prompt, as leaders of the shared-prefix wait; None when the
        wait is off (or there is no prefix cache to wait for)."""
        if not (self.config.shared_prefix_wait_tokens and self.kv.enable_prefix_caching):
            return None
        leaders = PrefixLeaders(self.kv.page_size, self.config.shared_prefix_wait_tokens)
        for request in self.running:
            if not request.is_prefill_done:
                leaders.add(request, self._namespace(request))
        return leaders

    def _admit_adapter(self, request: Request, batch: Batch) -> bool:
        """Pin the request's LoRA adapter in a slot; an adapter that failed to load ends the request."""
        if self.adapters.admit(request):
            return True
        if request.is_finished:
            self.waiting.remove(request)
            self._release(request)
            batch.finished.append(request)
        return False

    def _scheduled(self, request: Request, num_new: int, draft: list[int] | None = None) -> ScheduledRequest:
        """The request's share of this step (its drafts last), with the pages of its tokens [0, end) (allocated
        by now)."""
        start, num_new = request.num_computed_tokens, num_new + len(draft or ())
        num_pages = -(-(start + num_new) // self.kv.page_size)
        pages = self.kv.page_table(request.request_id)[:num_pages]
        return ScheduledRequest(request, start, num_new, pages, draft or ())

    # -- speculation ---------------------------------------------------------------------------
    def _drafts(self) -> dict[str, list[int]]:
        """Draft tokens for the running requests that decode this step, by request id (absent: k = 0)."""
        candidates, base_tokens = [], 0
        for request in self.running:
            behind = request.num_tokens - request.num_computed_tokens
            room = self._draft_room(request) if behind == 1 else 0
            if room > 0:
                candidates.append((request.request_id, request.all_token_ids, room))
            else:
                base_tokens += behind
        if not candidates:
            return {}
        others = len(self.running) - len(candidates)  # each a sequence of the step, expected to emit a token
        drafts = self.speculator.drafts(candidates, base_tokens, others, self.config.max_num_batched_tokens, others)
        for request_id, draft in list(drafts.items()):  # structured output: cut at the first token the grammar refuses
            matcher = self.requests[request_id].matcher  # (a network's placeholders are checked in the verify pass)
            if matcher is not None and not self.speculator.drafts_in_runner:
                drafts[request_id] = draft[: guarded(matcher, functools.partial(matcher.valid_prefix, draft), 0)]
        return {request_id: draft for request_id, draft in drafts.items() if draft}

    def _draft_room(self, request: Request) -> int:
        """Most drafts the request may verify: none for a grammar that is not yet constraining (a reasoning model
        thinking); else its tokens left less the one the target always adds. (Penalties, min_tokens and logprobs are
        verified position by position: spec/verify.py's AfterDrafts; a network's drafts, made inside the runner, are
        verified under the grammar up to the first it refuses: structured/bitmask.py's draft_bitmask.)"""
        if request.matcher is not None and (not request.grammar_active or request.reasoning_may_open is not None):
            return 0
        return min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1

    def _allocate_drafts(self, request: Request, num_new: int, draft: list[int]) -> list[int]:
        """Pages for the request's next num_new tokens and its drafts: the drafts when it got them, else [] (then
        the pages of the plain step are the caller's to find). Drafts never preempt a request."""
        if draft and self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new + len(draft)):
            return draft
        return []

    def _append_verified(self, item: ScheduledRequest, tokens: list[SampledToken], now: float) -> None:
        """The verifier's a accepted drafts and its own token, appended one by one (each checked for stops);
        what was computed rewinds to the verified tokens, and pages only rejected drafts filled go back.

            fed:       [ last | d_1 .. d_a | d_a+1 .. d_k ]
                       start               ^ end - (k - a): num_computed_tokens after (KV of rejects is stale)
        """
        request, drafted, accepted = item.request, len(item.draft_token_ids), len(tokens) - 1
        request.num_computed_tokens = item.end - (drafted - accepted)
        self.speculator.observe(request.request_id, drafted, accepted)
        request.metrics.spec_draft_tokens += drafted
        request.metrics.spec_accepted_tokens += accepted
        for sampled in tokens:
            self._append_sampled(request, sampled, now)
            if request.is_finished:
                return
        self.kv.trim(request.request_id, request.num_computed_tokens)

    def _start(self, request: Request, num_cached: int) -> None:
        self.waiting.remove(request)
        if request.status == RequestStatus.WAITING:  # first admission, not a readmission
            request.num_cached_tokens = num_cached
            request.metrics.first_scheduled_time = time.time()
            self.stats.prefix_query_tokens += request.num_prompt_tokens
            self.stats.prefix_hit_tokens += num_cached
        request.num_computed_tokens = num_cached
        if request.prompt_logprobs is not None and len(request.prompt_logprobs) <= num_cached:
            # positions served by the cache lie before prompt_logprobs_start: reported as None
            request.prompt_logprobs.extend([None] * (num_cached + 1 - len(request.prompt_logprobs)))
        request.status = RequestStatus.RUNNING
        if self.policy.deadlines is not None:
            self.policy.deadlines.admitted(request)
        self.running.append(request)

    def _allocate_or_preempt(self, request: Request, num_new: int, batch: Batch) -> bool:
        """Get pages for the request's next tokens, preempting from the back of the line."""
        while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
            victim = self.policy.pick_victim(self.running)
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        if request.lora_id:
            self.adapters.unpin(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.metrics.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self.policy.key)

    def _append_sampled(self, request: Request, sampled, now: float) -> None:
        if sampled.logprob is not None:  # None unless the request asked for logprobs
            request.cumulative_logprob += sampled.logprob
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
            if self.policy.deadlines is not None:
                self.policy.deadlines.first_token(request)
        request.metrics.last_token_time = now
        logprobs = sampled.logprobs
        if logprobs is None and request.logprobs is not None:
            logprobs = TokenLogprobs(sampled.token_id, sampled.logprob, 0)
        self._append(request, sampled.token_id, logprobs)
        self._jump_forward(request)

    def _append(self, request: Request, token_id: int, logprobs: TokenLogprobs | None) -> None:
        """One output token (logprobs None where the request keeps none), then what it ends: grammar, stop, length."""
        request.append_token(token_id)
        if request.logprobs is not None:
            request.logprobs.append(logprobs)
        if request.reasoning_may_open is not None:  # the first token: does it open a reasoning (text/reasoning.py)?
            start, end = request.reasoning_may_open
            request.reasoning_may_open = None
            request.grammar_gate = end if token_id == start else None
        if request.grammar_gate is not None:
            if token_id == request.grammar_gate:
                request.grammar_gate = None  # the reasoning ended: the grammar constrains what follows
        elif request.grammar_active and self._check_grammar(request):
            return
        self._check_stop(request)

    def _jump_forward(self, request: Request) -> None:
        """Append the tokens the grammar forces next, each checked like a sampled one (so max_tokens,
        stop tokens and the grammar's end still apply). A forced token's logprob is 0.0: under the
        grammar it was the only choice (its raw logit is never computed)."""
        if (not request.grammar_active or request.reasoning_may_open is not None or request.is_finished
                or not self.config.enable_jump_forward):
            return
        for token_id in guarded(request.matcher, request.matcher.forced_tokens, []):
            self._append(request, token_id, TokenLogprobs(token_id, 0.0, 1))
            if request.is_finished:
                return

    def _check_grammar(self, request: Request) -> bool:
        """Advance the matcher with the new token; True when that ended the request. A matcher that
        failed (a library limit or exception, here or while filling its mask) ends its request only."""
        matcher, token_id = request.matcher, request.all_token_ids[-1]
        accepted = not matcher.error and guarded(matcher, lambda: matcher.accept_token(token_id), False)
        if accepted and guarded(matcher, matcher.is_terminated, False):  # EOS, or nothing else allowed (wins over min_tokens)
            request.status = RequestStatus.FINISHED_STOPPED
        if not accepted or matcher.error:
            request.fail(f"the grammar rejected the output: {matcher.error}", "structured_outputs")
        return request.is_finished

    def _check_stop(self, request: Request) -> None:
        token, num_output = request.all_token_ids[-1], request.num_output_tokens
        # The sampler masks stop tokens while fewer than min_tokens were out, so this is a backstop.
        if num_output > request.sampling_params.min_tokens:
            if token in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if token in request.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
                return
        if num_output >= request.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH

    def _release(self, request: Request) -> None:
        self.kv.free(request.request_id)
        if self.speculator is not None:
            self.speculator.finish(request.request_id, request.output_token_ids)
        if request.lora_id:
            self.adapters.forget(request)
        request.metrics.finished_time = time.time()
        del self.requests[request.request_id]

    @staticmethod
    def _namespace(request: Request) -> Hashable:
        """The request's prefix-cache namespace: its cache salt (tenant), and its LoRA adapter's identity (the same
        tokens under another adapter have other KV)."""
        if request.lora_namespace is None:
            return request.cache_salt
        return request.cache_salt, request.lora_namespace
