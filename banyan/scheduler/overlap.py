"""The scheduler of async scheduling: it schedules step N+1 while step N's sampled tokens are still on the device.

Step N is *in flight* once the engine launched it and left its sampled ids unread (engine/overlap.py). The next
schedule() first takes N as done: each request's `num_computed_tokens` moves to what N computes, its completed
pages go to the prefix cache (their tokens are known), and a request that samples at N gets a placeholder,
PENDING_TOKEN, as its next token. Then scheduling is the plain catch-up: the placeholder is one more token to
compute, so the request decodes it in N+1 at a known position, slot and page; only its id is missing, and the
runner fills it on the device from N's sampled ids.

    all_token_ids:  [ prompt ... | out_0 ... out_k-1 | PENDING ]       schedule N+1 runs the PENDING position
                                                      ^ num_computed_tokens after N
    settle(N):      [ prompt ... | out_0 ... out_k-1 | out_k ]         stop checks as in the plain update

settle() then replaces each placeholder with the sampled token and runs the plain update. A request that ended at N
(EOS, a stop token) was given one token too many in N+1: the engine drops its row from N+1's sampling, and its
pages, that extra one included, are freed here as for any finished request. A request that certainly ends at N (its
length) is left out of N+1. One that N+1's schedule preempted keeps its token and waits (or ends) as if the plain
update had run before the preemption. An abort between steps comes before the placeholders, which exist only
inside one engine step: from schedule() to settle().
"""

from __future__ import annotations

import logging
import time

from banyan.config import EngineConfig
from banyan.request import PENDING_TOKEN, Request, RequestStatus
from banyan.scheduler.batch import Batch, StepResult
from banyan.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def async_scheduling(config: EngineConfig) -> bool:
    """Asked for, and possible here (else a warning says why, once)."""
    if not config.scheduler.async_scheduling:
        return False
    reason = None
    if config.speculative is not None:
        reason = "speculative decoding verifies each step's drafts on the host"
    elif config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size > 1:
        reason = "tensor/pipeline-parallel workers get each step's input ids from the host"
    if reason is not None:
        logger.warning("async scheduling is off: %s", reason)
    return reason is None


def stays_in_flight(request: Request) -> bool:
    """Whether the request can leave its sampled token on the device until the next step is scheduled: not with
    structured output (the next mask and jump-forward need it), logprobs or prompt logprobs (more reads), nor an
    embedding. Stop strings can: the frontend's abort drops the token in flight with the pages."""
    return (request.matcher is None and request.sampling_params.structured_outputs is None
            and request.logprobs is None and request.prompt_logprobs is None and request.pooling_params is None)


class OverlapScheduler(Scheduler):
    """A Scheduler whose schedule() may run while the step before is in flight (launched(), then settle())."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.in_flight: Batch | None = None  # launched, its sampled tokens not read yet
        self._placeholders: list[Request] = []  # requests given a PENDING_TOKEN by the last schedule()

    def launched(self, batch: Batch) -> None:
        """`batch` runs on while the next step is scheduled; its result comes to settle()."""
        self.in_flight = batch

    def schedule(self) -> Batch:
        if self.in_flight is None:
            return super().schedule()
        self._assume_done(self.in_flight)
        ending = [r for r in self._placeholders if r.status == RequestStatus.RUNNING and self._ends_by_length(r)]
        if ending:  # nothing more to compute: no row in the next step
            skip = set(ending)
            self.running = [r for r in self.running if r not in skip]
        try:
            return super().schedule()
        finally:
            self.running.extend(ending)  # until settle() ends them

    def settle(self, result: StepResult) -> list[Request]:
        """The step in flight's tokens in place of its placeholders, then the plain update; returns the requests that
        got a token (the plain update's, and those preempted since, whose token still counts)."""
        batch, self.in_flight = self.in_flight, None
        for request in self._placeholders:
            if request.all_token_ids[-1] == PENDING_TOKEN:
                request.pop_token()
        self._placeholders = []
        preempted = [item for item in batch.scheduled if item.request.status == RequestStatus.PREEMPTED]
        running = Batch(scheduled=[item for item in batch.scheduled if item.request.status != RequestStatus.PREEMPTED])
        return self.update(running, result) + self._settle_preempted(preempted, result)

    def _assume_done(self, batch: Batch) -> None:
        """What update() would do before the tokens are known (see the module docstring)."""
        self._placeholders = []
        caching = self.kv.enable_prefix_caching
        for item in batch.scheduled:
            request, end = item.request, item.end
            if request.is_finished:  # aborted since it was launched
                continue
            request.num_computed_tokens = end
            if caching:
                self.kv.cache_completed_pages(request.request_id, request.all_token_ids, end, self._namespace(request))
            if end == request.num_tokens:  # it samples at this step
                request.append_token(PENDING_TOKEN)
                self._placeholders.append(request)

    def _ends_by_length(self, request: Request) -> bool:
        """Whatever its pending token is, the request ends with it (max_tokens, or the context is full)."""
        return request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len

    def _settle_preempted(self, items: list, result: StepResult) -> list[Request]:
        """Requests the last schedule preempted while their token was in flight: appended as the plain update would
        have before the preemption; one that token ends leaves the waiting queue."""
        advanced, now = [], time.time()
        for item in items:
            request, sampled = item.request, result.sampled.get(item.request.request_id)
            if sampled is None:  # a prefill chunk: recomputed from the cache after readmission
                continue
            self._append_sampled(request, sampled, now)
            advanced.append(request)
            if request.is_finished:
                self.waiting.remove(request)
                self._release(request)
        return advanced
