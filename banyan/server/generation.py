"""Generation: the choices of one HTTP request running in the core, merged into one event stream.

One HTTP request holds P prompts x n choices; each choice is one engine request. The engine client
hands each choice's deltas to this Generation as they arrive (`EngineClient.open`, a sink per choice),
which turns them into text (detokenizer, stop strings: SequenceState, shared with the offline API)
and appends events to one list; the reader of the stream wakes once per engine step and takes every
event of that step at once (`batches`), so streaming and non-streaming responses read the same events:

    choice index = prompt index * n + j            (OpenAI's numbering for several prompts)
    engine id    = f"{http request id}.{serial}-{prompt index}-{j}"   (frontend.prepare.fan_out, key f"{...}-{p}")

The HTTP request id (the client's X-Request-Id, if sane) is a label for logs: two requests may carry
the same one, so a per-process serial keeps the engine ids unique.

Closing the Generation (client gone, error, shutdown) closes the choices still running: the engine
client aborts their requests in the core, which frees their pages within one step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from banyan.frontend.prepare import fan_out
from banyan.ipc.client import EngineClient
from banyan.ipc.messages import AddRequest
from banyan.lora.request import LoRARequest
from banyan.request import RequestDelta, Slo
from banyan.sampling_params import SamplingParams
from banyan.text.output_processor import SequenceState, best_of, to_position_logprobs
from banyan.text.outputs import PositionLogprobs

logger = logging.getLogger("banyan.server")

MAX_BUFFERED_EVENTS = 1024
"""Events held per choice for a stream its client does not read; beyond it the request is aborted (RELIABILITY D4).
Per choice, because a reader that keeps up can still be a step behind on every choice at once."""

_serials = itertools.count()


@dataclass
class Choice:
    index: int
    request_id: str
    prompt_index: int
    seq: SequenceState
    arrival: float
    num_cached_tokens: int = 0
    queue_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # per prompt position, when the request asked


@dataclass
class Event:
    """New text of one choice, with its state at that moment; `error` set when the choice failed."""

    choice: Choice
    text: str
    num_tokens: int = 0  # the choice's output tokens up to and including this event
    finish_reason: str | None = None
    error: BaseException | None = None


class SlowReaderError(Exception):
    """The client reads the stream slower than the engine writes it, beyond the buffer cap."""


class Generation:
    def __init__(
        self,
        client: EngineClient,
        tokenizer,
        http_request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        slo: Slo | None = None,
        lora_request: LoRARequest | None = None,
        max_buffered_events: int = MAX_BUFFERED_EVENTS,
    ):
        self.client = client
        self.tokenizer = tokenizer
        self.prompts = prompts
        self._event_cap = max_buffered_events * len(prompts) * params.num_sequences
        self.slow_reader = False
        self.structured_param: str | None = None  # the request field of its structured-output spec, if any
        self.route: tuple[str, str] | None = None  # (route, variant) when an A/B route chose the model
        self.tenant: str | None = None  # the API key's tenant id, set by the server
        self.choices: list[Choice] = []
        self._events: list[Event] = []  # not read yet
        self._wakeup: asyncio.Future | None = None  # the reader's, while it waits for events
        now = time.time()
        key = f"{http_request_id}.{next(_serials)}"  # unique, whatever the client's id
        n = params.num_sequences  # best_of candidates, or the n choices
        requests = []
        for p, prompt in enumerate(prompts):
            for s in fan_out(f"{key}-{p}", params):
                index = p * n + s.index
                seq = SequenceState(index, s.params, tokenizer, prompt)
                self.choices.append(Choice(index, s.request_id, p, seq, now))
                requests.append(AddRequest(s.request_id, prompt, s.params, arrival_time=now, priority=priority,
                                           cache_salt=cache_salt, slo=slo,
                                           lora_request=lora_request))
        for choice, add in zip(self.choices, requests):
            try:
                self.client.open(add, lambda item, choice=choice: self._take(choice, item))
            except Exception as e:  # e.g. the engine is shutting down: this choice fails, as if at once
                self._fail(choice, e)

    def _take(self, choice: Choice, item: RequestDelta | Exception) -> None:
        """The engine client's sink for one choice (inside its reader: never raises)."""
        if choice.finished:
            return
        try:
            if isinstance(item, Exception):
                raise item
            self._apply(choice, item)
        except Exception as e:  # request-scoped: this choice fails, the others go on
            self._fail(choice, e)
        self._wake()

    def _apply(self, choice: Choice, delta: RequestDelta) -> None:
        choice.token_times.append(time.time())
        if delta.queue_time is not None:
            choice.queue_time = delta.queue_time
            choice.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = [None if lp is None else to_position_logprobs(lp, self.tokenizer)
                                      for lp in delta.prompt_logprobs]
        text, stopped = choice.seq.apply(delta)
        if len(self._events) >= self._event_cap:
            raise SlowReaderError("the client is not reading the stream")
        self._events.append(Event(choice, text, len(choice.seq.token_ids), choice.seq.finish_reason))
        if stopped:  # a stop string ended it here: the core stops at once
            self.client.close([choice.request_id])
        if stopped or delta.finish_reason is not None:
            choice.finished = True

    def _fail(self, choice: Choice, e: Exception) -> None:
        if isinstance(e, SlowReaderError) and not self.slow_reader:
            self.slow_reader = True  # logged once per HTTP request; its other choices fail the same way
            logger.warning("request %s aborted: its client stopped reading the stream", choice.request_id)
        if choice.seq.finish_reason is None:  # how metrics and the audit log count it
            choice.seq.finish_reason = "abort" if isinstance(e, SlowReaderError) else "error"
        self.client.close([choice.request_id])  # still running in the core: aborted there
        choice.finished = True
        self._events.append(Event(choice, "", error=e))

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def batches(self) -> AsyncIterator[list[Event]]:
        """Every choice's events as they come, until all choices end: each list holds all that came since the
        last (one engine step's, for a reader that keeps up)."""
        while True:
            if self._events:
                batch, self._events = self._events, []
                yield batch
            elif self.done:
                return
            else:
                self._wakeup = asyncio.get_running_loop().create_future()
                try:
                    await self._wakeup
                finally:
                    self._wakeup = None

    async def events(self) -> AsyncIterator[Event]:
        """Every choice's events as they come, one by one, until all choices end."""
        async for batch in self.batches():
            for event in batch:
                yield event

    async def run(self) -> list[Event]:
        """Wait for the end of all choices; returns the error events (if any)."""
        return [e async for e in self.events() if e.error is not None]

    def returned(self, n: int) -> list[Choice]:
        """The choices an answer holds: every one, or of best_of candidates the n with the highest
        cumulative log-probability per prompt, renumbered p * n + rank (best first)."""
        if len(self.choices) == n * len(self.prompts):
            return self.choices
        groups: dict[int, list[Choice]] = {}
        for c in self.choices:
            groups.setdefault(c.prompt_index, []).append(c)
        return [replace(c, index=p * n + rank) for p, group in groups.items()
                for rank, c in enumerate(best_of(group, n, key=lambda c: c.seq.cumulative_logprob))]

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    def abort(self) -> None:
        """End every unfinished choice now with finish_reason "abort" (shutdown past its drain time)."""
        for choice in self.choices:
            if not choice.finished:
                choice.seq.finish_reason = "abort"
                self._events.append(Event(choice, "", len(choice.seq.token_ids), "abort"))
        self.close()
        self._wake()

    def close(self) -> None:
        """Close the choices still running; the engine client aborts their requests in the core.

        Synchronous on purpose: it runs in `finally` blocks of cancelled tasks, where any await
        would be cancelled again before it could finish.
        """
        running = [c for c in self.choices if not c.finished]
        for choice in running:
            choice.finished = True
        if running:
            self.client.close([c.request_id for c in running])

    # -- usage --------------------------------------------------------------------------------
    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.seq.token_ids) for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        # A prompt is computed once and its siblings reuse its pages: count the prompt once, as its
        # first computation found the cache.
        first: dict[int, int] = {}
        for c in self.choices:
            first[c.prompt_index] = min(first.get(c.prompt_index, c.num_cached_tokens), c.num_cached_tokens)
        return sum(first.values())
