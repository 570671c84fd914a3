"""The OpenAPI document (/openapi.json, Swagger UI at /docs): what each route takes and answers.

Routes read and validate their bodies themselves (bounded, strict: app.py, protocol.py), so FastAPI
never sees the request models; `route_docs` names them for each route and `install` puts their JSON
schemas (as pydantic derives them from protocol.py, the same models that validate) into the
document's components. The answers are described by the models below, written for the document
only: serving.py builds plain dicts of these shapes, and tests/e2e/test_openapi.py fuzzes a live
server against the document (schemathesis) so that the two cannot drift apart.

With an API key set, the document and /docs need it like every route but /health (and /metrics
unless protected): default-deny (RELIABILITY rule 5); the document declares the bearer scheme.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from banyan.server import protocol
from banyan.server.embeddings import EmbeddingRequest
from banyan.server.responses import ResponsesRequest

DESCRIPTION = (
    "OpenAI-compatible inference server. Request bodies are validated strictly (no \"1\" for 1, finite numbers "
    "only); unknown fields are ignored; a JSON null means the field's default (for max_tokens: as many as the "
    "context allows), and the schemas say so. Errors are OpenAI's {\"error\": {message, type, param, code}}, "
    "`param` naming the field at fault. With --api-key, every route but /health (and /metrics unless "
    "--protect-metrics) needs `Authorization: Bearer KEY`, this document and /docs included."
)
REQUEST_BODIES: dict[str, tuple[type[BaseModel], ...]] = {
    "/v1/completions": (protocol.CompletionRequest,),
    "/v1/chat/completions": (protocol.ChatCompletionRequest,),
    "/tokenize": (protocol.TokenizeCompletionRequest, protocol.TokenizeChatRequest),
    "/detokenize": (protocol.DetokenizeRequest,),
    "/v1/embeddings": (EmbeddingRequest,),
    "/v1/responses": (ResponsesRequest,),
}
RESPONSES_DOC = (
    "OpenAI's Responses API (its core): input as text or items (messages, function_call, function_call_output), "
    "instructions, max_output_tokens, sampling, function tools and tool_choice, text.format json_schema, "
    "previous_response_id over the responses stored for the same API key (404 for any other id). With stream, "
    "server-sent events `event: <type>` / `data: {...}` numbered by sequence_number, from response.created to "
    "response.completed (docs/responses.md).")


# -- answers ---------------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    """The request field at fault, as a path (`messages[0].content`)."""
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class CalledFunction(BaseModel):
    name: str
    arguments: str


class ChatToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ChatToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str
    """Floats, or with encoding_format base64 the base64 of their little-endian float32 bytes."""


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """A response of the Responses API; `output` holds reasoning, message and function_call items."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    output: list[dict[str, Any]]
    error: None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    previous_response_id: str | None
    store: bool
    metadata: dict[str, str]
    truncation: str
    user: str | None
    usage: ResponseUsage | None


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class VersionResponse(BaseModel):
    version: str


class ProfileResponse(BaseModel):
    """Whether the engine cores' profilers run now; /stop_profile: the traces written, per model (`trace`: the first),
    and for a model with data-parallel replicas each replica's (null: down, or its profiler was not running)."""

    profiling: bool
    trace: str | None = None
    traces: dict[str, str] | None = None
    replica_traces: dict[str, list[str | None]] | None = None


class ReplicaKvReport(BaseModel):
    """One data-parallel replica's KV census (as KvReportResponse's counts), or `error` when it did not answer."""

    replica: int
    state: Literal["up", "restarting", "down"]
    num_pages: int | None = None
    num_free: int | None = None
    num_in_use: int | None = None
    num_cached: int | None = None
    num_locked: int | None = None
    num_running: int | None = None
    num_waiting: int | None = None
    integrity: Literal["ok", "broken"] | None = None
    integrity_error: str | None = None
    error: str | None = None


class KvReportResponse(BaseModel):
    """The KV cache after its integrity check: num_pages == num_free + num_in_use + num_cached; idle, num_in_use
    is 0 (anything else is a leaked page)."""

    num_pages: int
    num_free: int
    num_in_use: int
    """Held by at least one request."""
    num_cached: int
    """In the radix tree, held by no request (evictable)."""
    num_locked: int
    """In the radix tree and held by a request."""
    num_running: int
    num_waiting: int
    integrity: Literal["ok", "broken"]
    integrity_error: str | None
    replicas: list[ReplicaKvReport] | None = None
    """With --data-parallel-size N: each replica's census (the counts above are their sum over those that
    answered)."""


# -- per route ---------------------------------------------------------------------------------------
_ERRORS = {
    400: "invalid request: `param` names the field",
    401: "missing or wrong API key",
    403: "a user key on an admin route",
    404: "unknown model (`code`: model_not_found); an admin route on a server without --admin-api-key",
    409: "the state does not allow it (e.g. /start_profile while the profiler runs)",
    413: "body over --max-body-bytes",
    429: "rate limit of the API key reached (Retry-After)",
    500: "internal error",
    503: "at capacity or shutting down (Retry-After)",
}
# One server-sent event as the HTML standard parses a stream (OpenAPI 3.2's generic text/event-stream item; on 3.1 the
# media type's schema is read as each event's, by schemathesis among others): data is one JSON chunk, then `[DONE]`.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON chunk of the answer's stream model, or [DONE] last"},
    "event": {"type": "string", "description": "the Responses API's event type; `message` elsewhere"},
    "id": {"type": "string"}, "retry": {"type": "integer", "minimum": 0}}}
_STREAM = {"text/event-stream": {"schema": _SSE_EVENT}}


def route_docs(answer: type[BaseModel] | None = None, *, errors: tuple[int, ...] = (401, 503),
               stream: bool = False, description: str | None = None) -> dict[str, Any]:
    """Keyword arguments for a route decorator: its answer and its errors (each as ErrorResponse)."""
    responses: dict[int | str, dict[str, Any]] = {status: {"model": ErrorResponse, "description": _ERRORS[status]}
                                                  for status in errors}
    if answer is not None:
        responses[200] = {"model": answer, "description": "success"}
        if stream:
            responses[200] |= {"content": _STREAM, "description": "success; with stream, server-sent events "
                               "`data: {chunk}`, the last one `data: [DONE]`"}
    return {"responses": responses, "description": description, "response_model": None}


POST_ERRORS = (400, 401, 404, 413, 429, 500, 503)


def install(app: FastAPI, *, auth_enabled, open_paths) -> None:
    """Make `app.openapi()` the document: FastAPI's, plus the request bodies and the bearer scheme.

    auth_enabled, open_paths: callables read when the document is first asked for (the app is built
    before the server's state is complete)."""

    def document() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = _document(app, auth_enabled(), open_paths())
        return app.openapi_schema

    app.openapi = document


def _as_validated(body: dict) -> None:
    """Say in a body's schema what validation accepts beyond the model's types: a top-level null means
    the default (RequestModel drops it), and `stop` may be one string (a list of one)."""
    required = set(body.get("required", ()))
    for name, prop in body["properties"].items():
        options = prop.get("anyOf", [])
        if name == "stop":
            item = next(o["items"] for o in options if o.get("type") == "array")
            options.insert(0, item)
        if name not in required and {"type": "null"} not in options:
            body["properties"][name] = {"anyOf": [*(options or [_type_part(prop)]), {"type": "null"}],
                                        **{k: v for k, v in prop.items() if k in _ANNOTATIONS}}


_ANNOTATIONS = ("default", "title", "description")


def _type_part(prop: dict) -> dict:
    return {k: v for k, v in prop.items() if k not in _ANNOTATIONS}


def _document(app: FastAPI, auth_enabled: bool, open_paths: set[str]) -> dict:
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    models = [m for bodies in REQUEST_BODIES.values() for m in bodies]
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    schemas.update(defs.get("$defs", {}))
    for model in models:
        _as_validated(schemas[model.__name__])
    for path, bodies in REQUEST_BODIES.items():
        options = [refs[(m, "validation")] for m in bodies]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        doc["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    if auth_enabled:
        doc["security"] = [{"bearer": []}]
    for path, methods in doc["paths"].items():
        for operation in methods.values():
            if path in open_paths:
                operation["security"] = []
                operation["responses"].pop("401", None)
    return doc
