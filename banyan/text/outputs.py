"""What users get back: RequestOutput and CompletionOutput, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from banyan.errors import ErrorInfo
from banyan.request import RequestMetrics

if TYPE_CHECKING:
    from banyan.tools import ToolCall


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's log-probabilities: token id -> Logprob (the chosen token and the top ones).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: ErrorInfo | None = None  # finish_reason "error": why (OpenAI's error fields; banyan/errors.py)
    # LLM.chat with tools: the reply read back as text before the calls, and the calls (complete or not)
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None  # LLM.chat with a reasoning_parser: the thinking ("" when the reply did not think)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]
    """The pooled, normalised hidden state (docs/embeddings.md)."""


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt (vLLM's shape: `output.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
