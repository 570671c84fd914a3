"""The answers of /v1/completions and /v1/chat/completions: one JSON body, or SSE chunks.

A renderer reads one Generation: `response()` builds the body once every choice has ended; `stream()`
yields the chunks as the events come (with tools, each reply is parsed for calls as it streams:
id and name first, then the arguments), then the usage chunk when stream_options asks for it, and
with continuous_usage_stats the running usage on every chunk.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from banyan.server.generation import Choice, Generation
from banyan.server.logprobs import chat_logprobs, completion_logprobs
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

    def _head(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model, "choices": choices}

    def chunks(self) -> AsyncIterator[dict]:
        """The choices' chunks, as their events come."""
        raise NotImplementedError

    async def stream(self) -> AsyncIterator[dict]:
        """The SSE chunks, then the usage chunk when stream_options asks for it. With continuous_usage_stats
        (vLLM's; here it implies include_usage, which vLLM requires) every chunk carries the running usage
        of the events read so far."""
        options = self.req.stream_options
        running = bool(options and options.continuous_usage_stats)
        async for chunk in self.chunks():
            if running:
                chunk["usage"] = usage(self.gen, self.gen.read_completion_tokens)
            yield chunk
        if options and (options.include_usage or options.continuous_usage_stats):
            yield self._head([]) | {"usage": usage(self.gen)}


class CompletionRender(_Render):
    """/v1/completions bodies and chunks; `prompt_texts`: each prompt's text, when the request echoes it."""

    id_prefix = "cmpl"
    chunk_object = "text_completion"

    def __init__(self, gen: Generation, req, tokenizer, model: str, prompt_texts: list[str] | None):
        super().__init__(gen, req, tokenizer, model)
        self.prompt_texts = prompt_texts

    def _logprobs(self, c: Choice):
        if self.req.logprobs is None:
            return None
        return completion_logprobs(c.seq, self.tokenizer, self.req.logprobs)

    def response(self) -> dict:
        choices = []
        for c in self.gen.returned(self.req.n):
            echo = self.prompt_texts[c.prompt_index] if self.prompt_texts else ""
            choices.append({"index": c.index, "text": echo + c.seq.text, "logprobs": self._logprobs(c),
                            "finish_reason": c.seq.finish_reason, "stop_reason": c.seq.stop_reason})
        return self._head(choices) | {"usage": usage(self.gen)}

    async def chunks(self) -> AsyncIterator[dict]:
        echoed: set[int] = set()
        sent = {c.index: 0 for c in self.gen.choices}  # logprob positions already sent
        async for event in self.gen.events():
            if event.error is not None:
                raise event.error
            c, text = event.choice, event.text
            if self.prompt_texts and c.index not in echoed:
                echoed.add(c.index)
                text = self.prompt_texts[c.prompt_index] + text
            logprobs = None
            if self.req.logprobs is not None:
                logprobs = completion_logprobs(c.seq, self.tokenizer, self.req.logprobs, sent[c.index], event.num_tokens)
                sent[c.index] = event.num_tokens
            if text or logprobs or event.finish_reason:
                yield self._head([{"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": event.finish_reason}])


class ChatRender(_Render):
    """/v1/chat/completions bodies and chunks; with tools, each choice's reply is read for tool calls."""

    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def __init__(self, gen: Generation, req, tokenizer, model: str, calling: ToolCalling):
        super().__init__(gen, req, tokenizer, model)
        self.calling = calling

    def _logprobs(self, c: Choice, start: int = 0, end: int | None = None):
        if not self.req.logprobs:
            return None
        return chat_logprobs(c.seq, self.tokenizer, self.req.top_logprobs or 0, start, end)

    def _message(self, c: Choice) -> tuple[dict, str | None]:
        """The reply as a message, and its finish reason ("tool_calls" when it ended with calls)."""
        parser = self.calling.parser()
        if parser is None:
            return {"role": "assistant", "content": c.seq.text}, c.seq.finish_reason
        content, calls = parser.parse(c.seq.text)
        if not calls:
            return {"role": "assistant", "content": content}, c.seq.finish_reason
        message = {"role": "assistant", "content": content if content.strip() else None, "tool_calls": [
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

    async def chunks(self) -> AsyncIterator[dict]:
        for c in self.gen.choices:  # OpenAI sends the role first, with empty content
            yield self._head([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
        sent = {c.index: 0 for c in self.gen.choices}  # logprob positions already sent
        parsers = {c.index: self.calling.parser() for c in self.gen.choices}
        async for event in self.gen.events():
            if event.error is not None:
                raise event.error
            c, parser = event.choice, parsers[event.choice.index]
            logprobs = self._logprobs(c, sent[c.index], event.num_tokens)
            sent[c.index] = event.num_tokens
            delta = _stream_delta(parser, event.text, done=event.finish_reason is not None)
            if delta or logprobs:
                yield self._head([{"index": c.index, "delta": delta or {"content": ""}, "logprobs": logprobs, "finish_reason": None}])
            if event.finish_reason is not None:
                finish_reason = _tool_finish_reason(event.finish_reason, parser) if parser else event.finish_reason
                yield self._head([{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}])


def _stream_delta(parser: ToolCallParser | None, text: str, done: bool) -> dict:
    """One chunk's delta: new content, and tool-call pieces (id and name first, then arguments)."""
    if parser is None:
        return {"content": text} if text else {}
    content, pieces = parser.feed(text)
    if done:
        content += parser.finish()[0]
    delta: dict = {"content": content} if content else {}
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

