"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API (its core) on the chat path.

    body --ResponsesRequest--> input items + instructions (+ the stored conversation of previous_response_id)
         --as a chat request--> OpenAIServing.start_chat (template, tools' grammar or text.format's, admission)
         --Generation--> OutputItems (response_render.py) --> the response object, or its typed events (SSE)
         --store (unless store: false)--> ResponseStore, per API key

One implementation with chat completions: the same template rendering, tool-call grammar and parser,
structured output and reasoning split; only the shapes differ. Input items: messages (roles user, system,
developer, assistant; text content), function_call and function_call_output (what a client sends back after
running a call), reasoning (accepted, not replayed). `instructions` are the system message of this request only
(a follow-up does not inherit them), as OpenAI specifies.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from banyan.errors import BanyanError, InvalidParameterError
from banyan.sampling_params import INT64_MAX
from banyan.server import protocol
from banyan.server.auth import Tenant
from banyan.server.errors import APIError, from_banyan_error
from banyan.server.protocol_parts import Int64, RequestModel, StrictModel
from banyan.server.response_render import OutputItems, new_id, output_messages
from banyan.server.response_store import ResponseStore
from banyan.server.serving import OpenAIServing
from banyan.server.sse import sse_event
from banyan.text.reasoning import splitters

MAX_INPUT_ITEMS = 2048
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_CHAT_PARAMS = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens",
                "max_tokens": "max_output_tokens", "messages": "input"}


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1, max_length=MAX_INPUT_ITEMS)
    """A text (one user message) or a list of items: messages, function_call, function_call_output."""
    instructions: str | None = None
    """The system message of this request (not carried into follow-ups)."""
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: Int64 | None = None
    """banyan's extension (as vLLM's): a per-request seed."""
    logit_bias: dict[str, float] | None = None
    """banyan's extension, as in chat completions: token id -> bias in [-100, 100]."""
    tools: list[FunctionTool] | None = None
    """Function tools only: {"type": "function", "name", "description", "parameters"}."""
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    """{"format": {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "name", "schema", "strict"}}"""
    stream: bool = False
    store: bool = True
    """Keep the response for previous_response_id and GET /v1/responses/{id} (bounded: --responses-store-size,
    --responses-store-ttl)."""
    previous_response_id: str | None = Field(None, max_length=128)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None


class ResponsesServing:
    """The endpoint over one model's OpenAIServing; `store` is shared by all models of the server."""

    def __init__(self, store: ResponseStore):
        self.store = store

    async def create(self, serving: OpenAIServing, body: dict, tenant: Tenant, http: Request) -> Response:
        req = protocol.parse(ResponsesRequest, body)
        history = self._history(req, tenant)
        try:
            conversation = history + input_messages(req.input)
            chat = protocol.parse(protocol.ChatCompletionRequest, chat_body(req, conversation))
            gen, prepared = await serving.start_chat(chat, tenant, http)
        except (APIError, BanyanError) as e:
            raise _as_responses_error(from_banyan_error(e)) from None
        parser = prepared.calling.parser()
        make_splitter = splitters(serving.client.info.reasoning_parser, prepared.prompts[0][0])
        answer = _Answer(req, serving.answering(req.model), OutputItems(parser, make_splitter and make_splitter()),
                         serving.tokenizer)
        finish = lambda: self._finish(answer, gen, tenant, conversation)  # noqa: E731
        if req.stream:
            events = (_event(event) async for event in answer.stream(gen, finish))
            return serving.sse(gen, events, http, error_event=lambda error: _event(answer.numbered(_error_event(error))),
                               done="")
        try:
            return await serving.respond(gen, lambda: answer.whole(gen, finish), http)
        except APIError as e:  # e.g. a grammar the core failed to compile
            raise _as_responses_error(e) from None

    def get(self, response_id: str, tenant: Tenant) -> JSONResponse:
        stored = self.store.get(tenant.tenant_id, response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        return JSONResponse(stored.body)

    def _history(self, req: ResponsesRequest, tenant: Tenant) -> list[dict]:
        if req.previous_response_id is None:
            return []
        stored = self.store.get(tenant.tenant_id, req.previous_response_id)
        if stored is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
        return list(stored.conversation)

    def _finish(self, answer: _Answer, gen, tenant: Tenant, conversation: list[dict]) -> dict:
        body = answer.body(gen)
        if answer.req.store:
            self.store.put(tenant.tenant_id, body["id"], body, conversation + output_messages(body["output"]))
        return body


class _Answer:
    """One response: its id and echo of the request, the output items, usage."""

    def __init__(self, req: ResponsesRequest, model: str, items: OutputItems, tokenizer):
        self.req, self.model, self.items, self.tokenizer = req, model, items, tokenizer
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self._sequence = itertools.count()

    def numbered(self, event: dict) -> dict:
        """The event with the next sequence_number (every event of a stream has one, in order)."""
        return event | {"sequence_number": next(self._sequence)}

    def body(self, gen=None) -> dict:
        """The response object: in progress (gen None) or finished."""
        req, choice = self.req, gen.choices[0] if gen is not None else None
        cut = choice is not None and choice.seq.finish_reason == "length"
        body = {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": "in_progress" if gen is None else "incomplete" if cut else "completed",
            "output": [] if gen is None else self.items.items, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, StrictModel) else
            req.tool_choice or ("auto" if req.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "text": req.text or {"format": {"type": "text"}}, "previous_response_id": req.previous_response_id,
            "store": req.store, "metadata": req.metadata or {}, "truncation": "disabled", "user": req.user,
            "usage": None if gen is None else self._usage(gen),
        }
        return body

    def whole(self, gen, finish) -> dict:
        self.items.feed(gen.choices[0].seq.text, done=True)
        if gen.choices[0].seq.finish_reason == "length":
            self.items.mark_incomplete()
        return finish()

    async def stream(self, gen, finish):
        yield self.numbered({"type": "response.created", "response": self.body()})
        yield self.numbered({"type": "response.in_progress", "response": self.body()})
        async for event in gen.events():
            if event.error is not None:
                raise event.error
            for item_event in self.items.feed(event.text, done=event.finish_reason is not None):
                yield self.numbered(item_event)
        if gen.choices[0].seq.finish_reason == "length":
            self.items.mark_incomplete()
        body = finish()
        yield self.numbered({"type": "response.incomplete" if body["status"] == "incomplete" else "response.completed",
                             "response": body})

    def _usage(self, gen) -> dict:
        reasoning = "".join(p["text"] for i in self.items.items if i["type"] == "reasoning" for p in i["content"])
        reasoning_tokens = len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return {"input_tokens": gen.prompt_tokens, "input_tokens_details": {"cached_tokens": gen.cached_tokens},
                "output_tokens": gen.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": gen.prompt_tokens + gen.completion_tokens}


# -- input items -> chat ----------------------------------------------------------------------------
def input_messages(value: str | list[dict]) -> list[dict]:
    """The input as chat messages (ChatMessageParam's shape); InvalidParameterError naming input[i].field."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind == "message" or (kind is None and "role" in item):
            messages.append(_message(f"input[{i}]", item))
        elif kind == "function_call":
            call = {"id": _string(f"input[{i}].call_id", item.get("call_id")), "type": "function",
                    "function": {"name": _string(f"input[{i}].name", item.get("name")),
                                 "arguments": _string(f"input[{i}].arguments", item.get("arguments"))}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # calls of one turn join its message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            output = output if isinstance(output, str) else json.dumps(output) if output is not None else None
            messages.append({"role": "tool", "tool_call_id": _string(f"input[{i}].call_id", item.get("call_id")),
                             "content": _string(f"input[{i}].output", output)})
        elif kind != "reasoning":  # a previous output's reasoning item: accepted, not replayed
            raise InvalidParameterError(f"input[{i}].type", f"items of type {str(kind)[:40]!r} are not supported "
                                                            "(message, function_call, function_call_output)")
    return messages


def _message(param: str, item: dict) -> dict:
    role = item.get("role")
    if role not in _ROLES:
        raise InvalidParameterError(f"{param}.role", f"must be one of {', '.join(_ROLES)}")
    content = item.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                raise InvalidParameterError(f"{param}.content[{j}]", "only text parts are supported "
                                                                     '({"type": "input_text", "text": "..."})')
            parts.append(part["text"])
        content = "".join(parts)
    return {"role": _ROLES[role], "content": _string(f"{param}.content", content)}


def _string(param: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidParameterError(param, "is required (a string)")
    return value


def chat_body(req: ResponsesRequest, conversation: list[dict]) -> dict:
    """The chat completions body that asks for the same generation."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    body = {"model": req.model, "messages": system + conversation, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "user": req.user,
            "logit_bias": req.logit_bias,
            "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req.text)}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type", "strict"}, exclude_none=True)}
                         for t in req.tools]
    if isinstance(req.tool_choice, FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    else:
        body["tool_choice"] = req.tool_choice
    return {k: v for k, v in body.items() if v is not None}


def _response_format(text: dict | None) -> dict | None:
    """text.format -> chat's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidParameterError("text.format", 'must be {"type": "text" | "json_object" | "json_schema", ...}')
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _as_responses_error(error: APIError) -> APIError:
    """A chat-path error named with the Responses field it concerns."""
    param = error.param or ""
    for chat, ours in _CHAT_PARAMS.items():
        if param == chat or param.startswith((chat + "[", chat + ".")):
            error.param = ours + param[len(chat):] if chat != "messages" else "input"
    if param.startswith("tools[") and ".function." in param:
        error.param = param.replace(".function.", ".")
    return error


def _not_found(response_id: str, param: str) -> APIError:
    shown = response_id if len(response_id) <= 64 else response_id[:61] + "..."
    return APIError(404, f"no response {shown!r} is stored for this API key", type="invalid_request_error",
                    param=param, code="response_not_found")


def _event(event: dict) -> str:
    """An SSE event as OpenAI sends them: `event: <type>` then its data (numbered by the caller)."""
    return f"event: {event['type']}\n{sse_event(event)}"


def _error_event(error: APIError) -> dict:
    error = _as_responses_error(error)
    return {"type": "error", "code": error.code, "message": error.message, "param": error.param}
