"""Request: the one record of one generation, from arrival to finish.

The scheduler moves `num_computed_tokens` towards `num_tokens` (prompt + output so far); whatever
the step was (prefill chunk, decode, recompute after preemption), it is "catching up".
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from banyan.errors import ErrorInfo
from banyan.pooling_params import PoolingParams
from banyan.sampling_params import SamplingParams

if TYPE_CHECKING:
    from banyan.structured import GrammarMatcher


class Slo(msgspec.Struct, frozen=True):
    """A request's latency targets (the body's `slo`, or the server's defaults) and whose request it is; the slo
    scheduling policy orders and refuses by them (scheduler/policy.py)."""

    ttft_ms: float | None = None
    """Time to first token, from arrival."""
    tpot_ms: float | None = None
    """Time per output token after the first."""
    tenant: str | None = None
    """Fairness is per tenant (the API key); None: the anonymous tenant."""


PENDING_TOKEN = -1
"""Async scheduling: an output token sampled on the device but not yet read (scheduler/overlap.py). The next step's
input row for it is filled on the device; it never reaches a delta, a stop check or the prefix cache."""


class RequestStatus(enum.IntEnum):
    """Ordered so that `status > PREEMPTED` means finished."""

    WAITING_FOR_GRAMMAR = 0  # a structured-output request whose grammar is compiling
    WAITING = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self > _LAST_UNFINISHED


_LAST_UNFINISHED = int(RequestStatus.PREEMPTED)  # a plain int: reading an enum member costs more than the compare

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of one request's milestones, None until reached; and its counts."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    spec_draft_tokens: int = 0  # draft tokens verified for this request (speculative decoding)
    spec_accepted_tokens: int = 0  # of those, accepted
    slo_forecast: tuple[float, float] | None = None  # slo policy: (when, the first-token wait estimated then)


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token's, and the top ones (id -> logprob, rank order)."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float] = field(default_factory=dict)

    def keep_top(self, n: int) -> TokenLogprobs:
        """Only the n most likely of `top` (a batch's table holds its widest request's), in place; returns self."""
        self.top = dict(list(self.top.items())[:n])
        return self


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: Sequence[int] = (),
        max_tokens: int,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
    ):
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.priority = priority
        self.cache_salt = cache_salt
        self.seq_no = 0  # arrival order in the scheduler, breaks time ties
        self.max_tokens = max_tokens  # resolved against max_model_len by the engine
        self.eos_token_ids = frozenset(() if sampling_params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self._all_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first schedule
        self.num_reported_tokens = 0  # output tokens already sent in a RequestDelta
        constrained = sampling_params.structured_outputs is not None
        self.status = RequestStatus.WAITING_FOR_GRAMMAR if constrained else RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: ErrorInfo | None = None  # why it ended with FINISHED_ERROR
        self.grammar: Future[GrammarMatcher] | None = None  # set by the engine while WAITING_FOR_GRAMMAR
        self.matcher: GrammarMatcher | None = None  # the grammar's position; advances with each output token
        self.grammar_gate: int | None = None  # reasoning: the grammar waits for this token (the end of thinking)
        self.reasoning_may_open: tuple[int, int] | None = None  # (start, end): the first token may open a reasoning
        self.cumulative_logprob = 0.0
        self.logprobs: list[TokenLogprobs] | None = [] if sampling_params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None
        )
        self.metrics = RequestMetrics(arrival_time=time.time() if arrival_time is None else arrival_time)
        self.generator: Any = None  # per-request torch.Generator, made by the sampler when seeded
        self.slo: Slo | None = None  # latency targets, set by the engine
        self.lora_id = 0  # the LoRA adapter it runs with (lora_int_id; 0: the base model), set by the engine
        self.lora_namespace: Any = None  # that adapter's identity, joined to cache_salt in the prefix cache
        self.pooling_params = pooling_params  # set: an embedding request (prefill only, never sampled)
        self.pool_state: Any = None  # the runner's running sum of hidden states over the prefill chunks (mean)
        self.embedding: list[float] | None = None  # a pooling request's result, set the step its prompt completes

    # -- tokens -------------------------------------------------------------------------------
    @property
    def all_token_ids(self) -> Sequence[int]:
        return self._all_token_ids

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self._all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self._all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._all_token_ids) - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self._all_token_ids.append(token_id)

    def pop_token(self) -> int:
        """Take back the last token: async scheduling's placeholder, before the sampled token replaces it."""
        return self._all_token_ids.pop()

    # -- state --------------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status > _LAST_UNFINISHED  # status.is_finished, read every step for every request

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def grammar_active(self) -> bool:
        """A structured-output request whose grammar constrains the next token (not while it still reasons)."""
        return self.matcher is not None and self.grammar_gate is None

    @property
    def pools_every_token(self) -> bool:
        """An embedding whose pooling reads every prompt position: cached positions would be missing."""
        return self.pooling_params is not None and self.pooling_params.pooling_type == "mean"

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def fail(self, message: str | ErrorInfo, param: str | None = None) -> None:
        """End with finish_reason "error": a 400 invalid_request_error about `param` with the message for the
        client, or the ErrorInfo given."""
        self.status = RequestStatus.FINISHED_ERROR
        self.error = message if isinstance(message, ErrorInfo) else ErrorInfo(message, param=param)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, prompt={self.num_prompt_tokens})"
        )


@dataclass
class RequestDelta:
    """What one step changed for one request: new tokens, and how it ended if it did (finish_reason
    "error": `error` says why)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    cumulative_logprob: float
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # whole list, once, with the first delta
    queue_time: float | None = None  # seconds from arrival to first schedule, with the first delta
    error: ErrorInfo | None = None
    embedding: list[float] | None = None  # a pooling request's one result, with its only delta

    @classmethod
    def failed(cls, request_id: str, error: ErrorInfo) -> RequestDelta:
        """The only delta of a request that failed before it ran."""
        return cls(request_id, [], None, 0.0, "error", None, 0, error=error)
