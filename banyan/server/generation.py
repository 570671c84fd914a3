"""Generation: the choices of one HTTP request running in the core, merged into one event stream.

One HTTP request holds P prompts x n choices; each choice is one engine request. A pump task per
choice reads its deltas from the engine client, turns them into text (detokenizer, stop strings:
SequenceState, shared with the offline API) and puts events on one queue, so streaming and
non-streaming responses read the same events:

    choice index = prompt index * n + j            (OpenAI's numbering for several prompts)
    engine id    = f"{http request id}.{serial}-{prompt index}-{j}"   (frontend.prepare.fan_out, key f"{...}-{p}")

The HTTP request id (the client's X-Request-Id, if sane) is a label for logs: two requests may carry
the same one, so a per-process serial keeps the engine ids unique.

Closing the Generation (client gone, error, shutdown) cancels the pumps; the engine client aborts
their requests in the core, which frees their pages within one step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace

from banyan.frontend.prepare import fan_out
from banyan.ipc.client import EngineClient
from banyan.ipc.messages import AddRequest
from banyan.lora.request import LoRARequest
from banyan.request import Slo
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
        self.choices: list[Choice] = []
        self._queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self._read: dict[int, int] = {}  # choice index -> its output tokens up to the last event read
        self._tasks: list[asyncio.Task] = []
        now = time.time()
        key = f"{http_request_id}.{next(_serials)}"  # unique, whatever the client's id
        n = params.num_sequences  # best_of candidates, or the n choices
        for p, prompt in enumerate(prompts):
            for s in fan_out(f"{key}-{p}", params):
                index = p * n + s.index
                choice = Choice(index, s.request_id, p, SequenceState(index, s.params, tokenizer, prompt), now)
                add = AddRequest(s.request_id, prompt, s.params, arrival_time=now, priority=priority,
                                 cache_salt=cache_salt, group_id=s.group_id, slo=slo, lora_request=lora_request)
                self.choices.append(choice)
                self._tasks.append(asyncio.ensure_future(self._pump(choice, add)))

    async def _pump(self, choice: Choice, add: AddRequest) -> None:
        try:
            async with aclosing(self.client.generate(add)) as deltas:  # leaving early aborts it in the core
                async for delta in deltas:
                    choice.token_times.append(time.time())
                    if delta.queue_time is not None:
                        choice.queue_time = delta.queue_time
                        choice.num_cached_tokens = delta.num_cached_tokens
                    if delta.prompt_logprobs is not None:
                        choice.prompt_logprobs = [None if lp is None else to_position_logprobs(lp, self.tokenizer)
                                                  for lp in delta.prompt_logprobs]
                    text, stopped = choice.seq.apply(delta)
                    if self._queue.qsize() >= self._event_cap:
                        raise SlowReaderError("the client is not reading the stream")
                    self._queue.put_nowait(Event(choice, text, len(choice.seq.token_ids), choice.seq.finish_reason))
                    if stopped:  # a stop string ended it here: the core stops at once
                        await self.client.abort([choice.request_id])
                        break
        except asyncio.CancelledError:
            raise
        except Exception as e:  # request-scoped: this choice fails, the others go on
            if isinstance(e, SlowReaderError) and not self.slow_reader:
                self.slow_reader = True  # logged once per HTTP request; its other choices fail the same way
                logger.warning("request %s aborted: its client stopped reading the stream", choice.request_id)
            if choice.seq.finish_reason is None:  # how metrics and the audit log count it
                choice.seq.finish_reason = "abort" if isinstance(e, SlowReaderError) else "error"
            self._queue.put_nowait(Event(choice, "", error=e))
        finally:
            choice.finished = True
            self._queue.put_nowait(None)

    async def events(self) -> AsyncIterator[Event]:
        """Every choice's events as they come, until all choices end."""
        remaining = len(self._tasks)
        while remaining:
            event = await self._queue.get()
            if event is None:
                remaining -= 1
                continue
            if event.error is None:
                self._read[event.choice.index] = event.num_tokens
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
        return all(task.done() for task in self._tasks)

    def abort(self) -> None:
        """End every unfinished choice now with finish_reason "abort" (shutdown past its drain time)."""
        for choice, task in zip(self.choices, self._tasks):
            if not choice.finished:
                choice.seq.finish_reason = "abort"
                self._queue.put_nowait(Event(choice, "", len(choice.seq.token_ids), "abort"))
                task.cancel()

    def close(self) -> None:
        """Cancel what still runs; the engine client aborts their requests in the core.

        Synchronous on purpose: it runs in `finally` blocks of cancelled tasks, where any await
        would be cancelled again before it could finish.
        """
        for task in self._tasks:
            task.cancel()

    # -- usage --------------------------------------------------------------------------------
    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.seq.token_ids) for c in self.choices)

    @property
    def read_completion_tokens(self) -> int:
        """Output tokens of the events read so far (a stream's running count; the pumps may be ahead)."""
        return sum(self._read.values())

    @property
    def cached_tokens(self) -> int:
        # A prompt is computed once and its siblings reuse its pages: count the prompt once, as its
        # first computation found the cache.
        first: dict[int, int] = {}
        for c in self.choices:
            first[c.prompt_index] = min(first.get(c.prompt_index, c.num_cached_tokens), c.num_cached_tokens)
        return sum(first.values())
