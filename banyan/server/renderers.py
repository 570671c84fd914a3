"""The answers of /v1/completions and /v1/chat/completions: one JSON body, or SSE chunks.

A renderer reads one Generation: `response()` builds the body once every choice has ended; `stream()`
writes the chunks as the events come (with tools, each reply is parsed for calls as it streams:
id and name first, then the arguments), then the usage chunk when stream_options asks for it, and
with continuous_usage_stats the running usage on every chunk. A stream wakes once per batch of events
(one engine step's) and writes all of that batch's chunks as one piece of SSE bytes (server/sse.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

from banyan.server.generation import Choice, Event, Generation
from banyan.server.logprobs import (
    chat_logprobs, completion_logprobs, echoed_prompt_logprobs, joined, vllm_prompt_logprobs,
)
from banyan.server.sse import ChunkEncoder, escape_line_breaks
from banyan.text.reasoning import ReasoningSplitter
from banyan.tools import ToolCalling, ToolCallParser


def usage(gen: Generation, completion_tokens: int | None = None) -> dict:
    """The request's usage; `completion_tokens` given: a running count in the middle of a stream."""
    if completion_tokens is None:
        completion_tokens = gen.completion_tokens
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": gen.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


class _Render:
    """What both answers share: the id, creation time and model they carry, and the stream's usage."""

    id_prefix = ""
    chunk_object = ""

    def __init__(self, gen: Generation, req, tokenizer, model: str):
        self.gen, self.req, self.tokenizer = gen, req, tokenizer
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = req.model or model

    def _head(self, choices: list[dict] | None = None) -> dict:
        """A chunk's fields (a chunk's whole body with `choices`)."""
        head = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model}
        return head if choices is None else head | {"choices": choices}

    def opening(self) -> list[list[dict]]:
        """Called once as the stream starts: sets up the choices' stream state; returns the `choices` of the chunks
        sent before any event."""
        return []

    def event_chunks(self, event: Event) -> list[list[dict]]:
        """The `choices` of each chunk one event makes (none, one or two)."""
        raise NotImplementedError

    async def stream(self) -> AsyncIterator[bytes]:
        """The SSE body, one piece per batch of events (an error event raises, after the chunks before it), then
        the usage chunk when stream_options asks for it. With continuous_usage_stats (vLLM's; here it implies
        include_usage, which vLLM requires) every chunk carries the running usage of the events streamed so far."""
        options = self.req.stream_options
        running = bool(options and options.continuous_usage_stats)
        read: dict[int, int] = {}  # choice index -> its output tokens in the events streamed so far
        encoder = ChunkEncoder(self._head())

        def encoded(chunks: list[list[dict]]) -> list[bytes]:
            running_usage = usage(self.gen, sum(read.values())) if running else None
            return [encoder.encode(choices, running_usage) for choices in chunks]

        opening = encoded(self.opening())
        if opening:
            yield escape_line_breaks(b"".join(opening))
        async for batch in self.gen.batches():
            pieces = []
            for event in batch:
                if event.error is not None:
                    if pieces:
                        yield escape_line_breaks(b"".join(pieces))
                    raise event.error
                read[event.choice.index] = event.num_tokens
                pieces += encoded(self.event_chunks(event))
            if pieces:
                yield escape_line_breaks(b"".join(pieces))
        if options and (options.include_usage or options.continuous_usage_stats):
            yield escape_line_breaks(encoder.encode([], usage(self.gen, self.completion_tokens())))

    def completion_tokens(self) -> int | None:
        """The answer's completion tokens when they differ from what the engine generated (None: those)."""
        return None


class CompletionRender(_Render):
    """/v1/completions bodies and chunks; `prompt_texts`: each prompt's text, when the request echoes it.

    With max_tokens 0 (echo, scores only) the engine sampled one token that the answer leaves out: the
    text is the prompt, the logprobs the prompt's, finish_reason "length", no completion tokens."""

    id_prefix = "cmpl"
    chunk_object = "text_completion"

    def __init__(self, gen: Generation, req, tokenizer, model: str, prompt_texts: list[str] | None):
        super().__init__(gen, req, tokenizer, model)
        self.prompt_texts = prompt_texts

    def _echo(self, c: Choice) -> tuple[str, dict | None]:
        """The echoed prompt's text and (with logprobs) its positions."""
        if not self.prompt_texts:
            return "", None
        logprobs = None
        if self.req.logprobs is not None and c.prompt_logprobs is not None:
            logprobs = echoed_prompt_logprobs(self.gen.prompts[c.prompt_index], c.prompt_logprobs, self.tokenizer,
                                              self.req.logprobs)
        return self.prompt_texts[c.prompt_index], logprobs

    def _logprobs(self, c: Choice, start: int = 0, end: int | None = None, offset: int = 0):
        if self.req.logprobs is None or self.req.scores_only:
            return None
        return completion_logprobs(c.seq, self.tokenizer, self.req.logprobs, start, end, offset)

    def _choice(self, c: Choice, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(c.prompt_logprobs)
        return choice

    def response(self) -> dict:
        choices = []
        for c in self.gen.returned(self.req.n):
            echo, echo_logprobs = self._echo(c)
            text = echo if self.req.scores_only else echo + c.seq.text
            logprobs = joined(echo_logprobs, self._logprobs(c, offset=len(echo)))
            finish_reason = "length" if self.req.scores_only else c.seq.finish_reason
            choices.append(self._choice(c, text, logprobs, finish_reason) | {"stop_reason": c.seq.stop_reason})
        return self._head(choices) | {"usage": usage(self.gen, self.completion_tokens())}

    def completion_tokens(self) -> int | None:
        return 0 if self.req.scores_only else None

    def opening(self) -> list[list[dict]]:
        self._echoed: dict[int, int] = {}  # choice index -> length of its echoed prompt
        self._sent = {c.index: 0 for c in self.gen.choices}  # logprob positions already sent
        return []

    def event_chunks(self, event: Event) -> list[list[dict]]:
        c, text, logprobs = event.choice, event.text, None
        finish_reason = event.finish_reason
        if self.req.scores_only:
            text, finish_reason = "", "length" if finish_reason else None
        if self.prompt_texts and c.index not in self._echoed:
            echo, logprobs = self._echo(c)
            self._echoed[c.index], text = len(echo), echo + text
        if self.req.logprobs is not None:
            logprobs = joined(logprobs, self._logprobs(c, self._sent[c.index], event.num_tokens,
                                                       self._echoed.get(c.index, 0)))
            self._sent[c.index] = event.num_tokens
        if text or logprobs or finish_reason:
            return [[self._choice(c, text, logprobs, finish_reason)]]
        return []


class ChatRender(_Render):
    """/v1/chat/completions bodies and chunks; with tools, each choice's reply is read for tool calls."""

    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def __init__(self, gen: Generation, req, tokenizer, model: str, calling: ToolCalling,
                 reasoning: Callable[[], ReasoningSplitter] | None = None):
        """reasoning: a new splitter per reply (--reasoning-parser): the thinking goes to `reasoning`, the rest is
        content (read for tool calls)."""
        super().__init__(gen, req, tokenizer, model)
        self.calling = calling
        self.reasoning = reasoning

    def _logprobs(self, c: Choice, start: int = 0, end: int | None = None):
        if not self.req.logprobs:
            return None
        return chat_logprobs(c.seq, self.tokenizer, self.req.top_logprobs or 0, start, end)

    def _message(self, c: Choice) -> tuple[dict, str | None]:
        """The reply as a message, and its finish reason ("tool_calls" when it ended with calls)."""
        text, head = c.seq.text, {"role": "assistant"}
        if self.reasoning is not None:  # vLLM's field name; None when the reply did not reason
            reasoning, text = self.reasoning().parse(text)
            head["reasoning"] = reasoning or None
        parser = self.calling.parser()
        if parser is None:
            return head | {"content": text}, c.seq.finish_reason
        content, calls = parser.parse(text)
        if not calls:
            return head | {"content": content}, c.seq.finish_reason
        message = head | {"content": content if content.strip() else None, "tool_calls": [
            {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}} for t in calls]}
        return message, _tool_finish_reason(c.seq.finish_reason, parser)

    def response(self) -> dict:
        choices = []
        for c in self.gen.choices:
            message, finish_reason = self._message(c)
            choices.append({"index": c.index, "message": message, "logprobs": self._logprobs(c),
                            "finish_reason": finish_reason, "stop_reason": c.seq.stop_reason})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(self.gen)}

    def opening(self) -> list[list[dict]]:
        self._sent = {c.index: 0 for c in self.gen.choices}  # logprob positions already sent
        self._parsers = {c.index: self.calling.parser() for c in self.gen.choices}
        self._splitters = {c.index: self.reasoning() for c in self.gen.choices} if self.reasoning else {}
        # OpenAI sends the role first, with empty content
        role = {"role": "assistant", "content": ""}
        return [[{"index": c.index, "delta": role, "logprobs": None, "finish_reason": None}] for c in self.gen.choices]

    def event_chunks(self, event: Event) -> list[list[dict]]:
        c, parser = event.choice, self._parsers[event.choice.index]
        logprobs = self._logprobs(c, self._sent[c.index], event.num_tokens)
        self._sent[c.index] = event.num_tokens
        delta = _stream_delta(parser, event.text, done=event.finish_reason is not None,
                              splitter=self._splitters.get(c.index))
        chunks = []
        if delta or logprobs:
            delta = delta or {"content": ""}
            chunks.append([{"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}])
        if event.finish_reason is not None:
            finish_reason = _tool_finish_reason(event.finish_reason, parser) if parser else event.finish_reason
            chunks.append([{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}])
        return chunks


def _stream_delta(parser: ToolCallParser | None, text: str, done: bool,
                  splitter: ReasoningSplitter | None = None) -> dict:
    """One chunk's delta: new reasoning (with a reasoning parser), new content, and tool-call pieces (id and name
    first, then arguments)."""
    reasoning = ""
    if splitter is not None:
        reasoning, text = splitter.feed(text)
        if done:
            more_reasoning, more_text = splitter.finish()
            reasoning, text = reasoning + more_reasoning, text + more_text
    head = {"reasoning": reasoning} if reasoning else {}
    if parser is None:
        return head | ({"content": text} if text else {})
    content, pieces = parser.feed(text)
    if done:
        content += parser.finish()[0]
    delta: dict = head | ({"content": content} if content else {})
    if pieces:
        delta["tool_calls"] = [_tool_call_piece(p) for p in pieces]
    return delta


def _tool_call_piece(piece) -> dict:
    if piece.id is None:
        return {"index": piece.index, "function": {"arguments": piece.arguments}}
    return {"index": piece.index, "id": piece.id, "type": "function",
            "function": {"name": piece.name, "arguments": piece.arguments}}


def _tool_finish_reason(finish_reason: str | None, parser: ToolCallParser) -> str | None:
    """OpenAI's "tool_calls" when a reply that ended normally holds calls, none of them cut short;
    else the reason stays ("length": max_tokens cut a call; "stop": a stop string did)."""
    return "tool_calls" if finish_reason == "stop" and parser.all_complete else finish_reason

