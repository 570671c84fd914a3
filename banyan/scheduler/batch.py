"""Batch: what one step runs, handed from the scheduler to the model runner and back; self-contained
(tokens, positions and page ids), so a runner needs nothing else from the scheduler or the cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from banyan.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step: its next `num_new_tokens` tokens starting at `start`, and the
    pages its tokens [0, end) live in (so the runner never asks the cache).

        all_token_ids:  [ computed (KV in cache) | new this step | not yet ]
                        0                  start      start + num_new_tokens = end
        page_ids:       [ p0 | p1 | ... ]  ceil(end / page_size) pages, token t in page_ids[t // page_size]
    A request samples a token when the step brings it level with all its tokens.

    Speculation: a decoding request's step runs its last token and k draft tokens, which are not (yet) its
    tokens; the verifier keeps a prefix of them and adds one of its own (k = 0: the plain decode).

        tokens fed:     [ last token | d_1 ... d_k ]      num_new_tokens = 1 + k
                        start = num_tokens - 1          end = num_tokens + k
    """

    request: Request
    start: int
    num_new_tokens: int
    page_ids: Sequence[int] = ()
    draft_token_ids: Sequence[int] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        return self.end - len(self.draft_token_ids) == self.request.num_tokens

    @property
    def token_ids(self) -> Sequence[int]:
        """The tokens this step feeds: the request's [start, end), its drafts last."""
        tokens = self.request.all_token_ids[self.start : self.end - len(self.draft_token_ids)]
        return list(tokens) + list(self.draft_token_ids) if self.draft_token_ids else tokens


@dataclass
class Batch:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    """Ended before running (a grammar that failed to compile, or forced the whole output): reported, never run."""
    lora_slots: dict[int, int] = field(default_factory=dict)
    """LoRA: adapter id -> the weight slot it sits in (every scheduled request's adapter is there)."""
    lora_loads: list[tuple[int, Any]] = field(default_factory=list)
    """LoRA: (slot, adapter tensors) to copy in before this step's forward (read from disk off the step loop)."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class SampledToken:
    """The runner's result for one sampling request (logprobs only when it asked for them)."""

    token_id: int
    logprob: float | None  # None unless the request asked for logprobs
    logprobs: object | None = None  # TokenLogprobs


@dataclass
class StepResult:
    """Per request id: the token sampled this step, and prompt logprobs computed this step; for a request that
    verified drafts, the tokens it gains instead (its accepted drafts, then the target's token); for a pooling
    request, its embedding instead of a token."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    verified: dict[str, list[SampledToken]] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)
    """The embedding of each pooling request whose prompt this step completed."""
    draft_seconds: float = 0.0
    """Time the runner spent drafting with a network this step (layer_skip), for the controller's cost model."""
