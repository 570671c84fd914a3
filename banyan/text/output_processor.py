"""OutputProcessor: the frontend half of a request, shared by `LLM` and the API server.

The engine sends token deltas; this turns them into text (incremental detokenizer), applies
stop strings (asking the caller to abort the engine request when one matches), and gathers the
n sequences of one prompt into a RequestOutput.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from banyan.errors import ErrorInfo
from banyan.request import RequestDelta, RequestMetrics, TokenLogprobs
from banyan.sampling_params import SamplingParams
from banyan.text.detokenizer import IncrementalDetokenizer, StopStringMatcher
from banyan.text.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput

T = TypeVar("T")


class SequenceState:
    """Text and tokens of one of a prompt's n sequences."""

    def __init__(self, index: int, params: SamplingParams, tokenizer, prompt_token_ids: Sequence[int]):
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
        )
        self.stop = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: ErrorInfo | None = None  # finish_reason "error": why

    def apply(self, delta: RequestDelta) -> tuple[str, bool]:
        """Take one delta; returns (new text, whether a stop string ended the sequence here).

        A delta of several tokens (accepted drafts, tokens a grammar forced) is read token by token when there are
        stop strings: the sequence ends at the token that completed one, as it would one token a step."""
        self.cumulative_logprob = delta.cumulative_logprob
        ids, logprobs = delta.new_token_ids, delta.new_logprobs or []
        if self.stop is None or len(ids) <= 1:
            return self._take(ids, logprobs, delta)
        new_text = ""
        for i, token_id in enumerate(ids):
            text, stopped = self._take([token_id], logprobs[i : i + 1], delta if i == len(ids) - 1 else None)
            new_text += text
            if stopped:
                return new_text, True
        return new_text, False

    def _take(self, ids: Sequence[int], logprobs: Sequence[TokenLogprobs], delta: RequestDelta | None) -> tuple[str, bool]:
        """Tokens of a delta; `delta` given with its last ones (its finish reason applies after them)."""
        finishing = delta is not None and delta.finish_reason is not None
        self.token_ids.extend(ids)
        if self.logprobs is not None and logprobs:
            self.logprobs.extend(to_position_logprobs(lp, self.tokenizer) for lp in logprobs)
        new_text = self.detokenizer.add(ids)
        if finishing:
            new_text += self.detokenizer.flush()
        stopped_on = None
        if self.stop is not None:
            new_text, stopped_on = self.stop.feed(new_text)
            if stopped_on is None and finishing:
                new_text += self.stop.flush()
        self.text += new_text
        if stopped_on is not None:
            self.finish_reason, self.stop_reason = "stop", stopped_on
            return new_text, True
        if finishing:
            self.finish_reason, self.stop_reason, self.error = delta.finish_reason, delta.stop_reason, delta.error
        return new_text, False

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,  # as vLLM
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
        )


@dataclass
class PromptState:
    """One user request: its prompt and its n sequences (engine requests as frontend/prepare.py names them)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def output(self) -> RequestOutput:
        kept = best_of(self.sequences, self.sequences[0].params.n, key=lambda s: s.cumulative_logprob)
        outputs = [s.output() for s in kept]
        for rank, out in enumerate(outputs):
            out.index = rank
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
        )


def best_of(candidates: list[T], n: int, key: Callable[[T], float]) -> list[T]:
    """The n candidates with the highest cumulative log-probability `key`, best first (OpenAI's best_of);
    all of them, in their order, when there are no more than n."""
    if len(candidates) <= n:
        return list(candidates)
    return sorted(candidates, key=key, reverse=True)[:n]


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prompts: dict[str, PromptState] = {}
        self._sequence_of: dict[str, tuple[PromptState, SequenceState]] = {}
        self._finished: list[str] = []  # prompts that finished since the last pop_finished()

    def add(self, state: PromptState, request_ids: Sequence[str]) -> None:
        """Track a prompt whose sequences run as the engine requests `request_ids` (one each, in order)."""
        self.prompts[state.request_id] = state
        for request_id, seq in zip(request_ids, state.sequences, strict=True):
            self._sequence_of[request_id] = (state, seq)

    def process(self, deltas: Sequence[RequestDelta]) -> list[str]:
        """Apply a step's deltas; returns engine request ids to abort (their stop string matched)."""
        to_abort = []
        for delta in deltas:
            entry = self._sequence_of.get(delta.request_id)
            if entry is None:
                continue  # aborted meanwhile
            prompt, seq = entry
            if delta.prompt_logprobs is not None and prompt.prompt_logprobs is None:
                prompt.prompt_logprobs = [
                    None if lp is None else to_position_logprobs(lp, self.tokenizer) for lp in delta.prompt_logprobs
                ]
            if len(seq.token_ids) == 0:
                prompt.num_cached_tokens = max(prompt.num_cached_tokens, delta.num_cached_tokens)
            _, stopped = seq.apply(delta)
            if stopped:
                to_abort.append(delta.request_id)
            if seq.finish_reason is not None:
                del self._sequence_of[delta.request_id]
                if prompt.finished:
                    self._finished.append(prompt.request_id)
        return to_abort

    def pop_finished(self) -> list[str]:
        """Prompts whose every sequence ended since the last call."""
        finished, self._finished = self._finished, []
        return finished

    def unfinished_request_ids(self) -> list[str]:
        """Engine request ids of every sequence still running."""
        return list(self._sequence_of)

    def pop(self, request_id: str) -> RequestOutput:
        return self.prompts.pop(request_id).output()


def to_position_logprobs(lp: TokenLogprobs, tokenizer) -> PositionLogprobs:
    """vLLM's shape: token id -> Logprob, the chosen token first, then the top ones by rank."""
    out = {lp.token_id: Logprob(lp.logprob, lp.rank, tokenizer.decode([lp.token_id]))}
    for rank, (token_id, logprob) in enumerate(lp.top.items(), start=1):
        if token_id not in out:
            out[token_id] = Logprob(logprob, rank, tokenizer.decode([token_id]))
    return out
