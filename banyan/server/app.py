"""The HTTP surface: routes, and one ASGI guard in front of all of them.

The guard runs before routing, on every path (RELIABILITY rules 5 and 8):
  - a request id (X-Request-Id accepted when sane, else made) echoed on the response;
  - authentication, default-deny: every path but /health (and /metrics unless protected) and the
    playground's page and files (`/`, `/static/<file>`: no data; its API calls carry a key) needs a
    valid key, so a route added later is protected without anyone remembering to (the OpenAPI
    document and /docs too; unknown paths get 401 before they could get 404);
  - admin routes (ADMIN_PATHS) need an admin key instead: none configured → 404 (the routes do not
    exist), a user key → 403, anything else → 401;
  - 503 while draining for shutdown, 413 for a declared body over the limit.
Handlers read the body themselves (bounded, streamed bodies included) and parse it strictly.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from banyan import __version__
from banyan.config import ServerConfig
from banyan.ipc.client import EngineClient, EngineDeadError
from banyan.server import admin_models, lora_adapters, openapi, playground, profiling
from banyan.server.audit import AuditLog
from banyan.server.auth import ANONYMOUS, AdminAuth, ApiKeyAuth, Tenant
from banyan.errors import BanyanError
from banyan.server.errors import APIError, error_body, from_banyan_error, parse_json_body
from banyan.server.embeddings import create_embeddings
from banyan.server.kv_census import kv_census
from banyan.server.response_store import ResponseStore
from banyan.server.responses import ResponsesServing
from banyan.server.metrics import ServerMetrics
from banyan.server.models import ModelRegistry
from banyan.server.serving import OpenAIServing

logger = logging.getLogger("banyan.server")

OPEN_PATHS = {"/health"}
ADMIN_PATHS = ("/admin/", "/start_profile", "/stop_profile", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
"""Paths (exact, or prefixes when ending in /) that only an admin key may call: the one list to extend."""
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass
class ServerState:
    config: ServerConfig
    client: EngineClient
    serving: OpenAIServing
    auth: ApiKeyAuth
    metrics: ServerMetrics
    admin: AdminAuth | None = None
    draining: bool = False
    dead: bool = False
    extra: dict = field(default_factory=dict)
    models: ModelRegistry | None = None  # every served model (client and serving above: the first one's)


def api_error_response(err: APIError, headers: dict | None = None) -> JSONResponse:
    if err.retry_after:
        headers = {**(headers or {}), "Retry-After": str(max(1, round(err.retry_after)))}
    return JSONResponse(error_body(err), status_code=err.status, headers=headers)


class Guard:
    """Pure ASGI middleware (not BaseHTTPMiddleware: that would break streaming disconnects)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        self.open_paths = OPEN_PATHS | (set() if state.config.protect_metrics else {"/metrics"})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get("x-request-id", "")
        request_id = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            await send(message)

        error = self._refuse(scope, headers)
        if error is not None:
            return await api_error_response(error)(scope, receive, send_with_id)
        await self.app(scope, receive, send_with_id)

    def _refuse(self, scope, headers: dict) -> APIError | None:
        path = scope["path"]
        if is_admin_path(path):
            error = self._refuse_admin(headers)
            if error is not None:
                return error
            scope["state"]["principal"] = "admin"  # who the audit log names
        elif path not in self.open_paths and not playground.is_page_path(path) and self.state.auth.enabled:
            tenant = self.state.auth.authenticate(headers.get("authorization"))
            if tenant is None:
                return APIError(401, "invalid or missing API key", type="invalid_request_error", code="invalid_api_key")
            scope["state"]["tenant"] = tenant
        if self.state.draining and path not in self.open_paths:
            return APIError(503, "the server is shutting down", type="server_error", code="shutting_down", retry_after=5)
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.state.config.max_body_bytes:
            return APIError(413, f"the body exceeds {self.state.config.max_body_bytes} bytes", code="payload_too_large")
        return None


    def _refuse_admin(self, headers: dict) -> APIError | None:
        admin = self.state.admin
        if admin is None or not admin.enabled:
            return APIError(404, "not found: admin routes need --admin-api-key", type="NotFoundError")
        verdict = admin.check(headers.get("authorization"))
        if verdict == 403:
            return APIError(403, "this route needs the admin key", type="permission_error", code="admin_key_required")
        if verdict == 401:
            return APIError(401, "invalid or missing admin API key", type="invalid_request_error",
                            code="invalid_api_key")
        return None


def profiled(state: ServerState) -> dict[str, EngineClient]:
    """The engine cores /start_profile and /stop_profile drive: every ready model's."""
    return {entry.name: entry.client for entry in state.models.ready()}


def is_admin_path(path: str) -> bool:
    return any(path.startswith(p) if p.endswith("/") else path == p for p in ADMIN_PATHS)


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object, refusing more than `limit` bytes even when it comes chunked."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the body exceeds {limit} bytes", code="payload_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # it left, or was too slow (connection.py): nobody reads this answer
        raise APIError(400, "the connection closed before the whole body arrived") from None
    return parse_json_body(b"".join(chunks))


def tenant_of(request: Request) -> Tenant:
    return getattr(request.state, "tenant", None) or ANONYMOUS


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="banyan", version=__version__, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json",
                  description=openapi.DESCRIPTION)
    serving = state.serving
    limit = state.config.max_body_bytes
    openapi.install(app, auth_enabled=lambda: state.auth.enabled,
                    open_paths=lambda: OPEN_PATHS | (set() if state.config.protect_metrics else {"/metrics"}))

    @app.get("/health", response_class=Response, response_model=None, responses={
        200: {"description": "serving"}, 503: {"description": "not serving: stopped, wedged or shutting down"}})
    async def health() -> Response:
        healthy = not state.dead and all(state.models.engine_healthy(e) for e in state.models.ready())
        return Response(status_code=200 if healthy and not state.draining else 503)

    @app.get("/version", **openapi.route_docs(openapi.VersionResponse))
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models", **openapi.route_docs(openapi.ModelList))
    async def models() -> dict:
        return {"object": "list", "data": state.models.model_cards()}

    @app.get("/metrics", response_class=PlainTextResponse, response_model=None, responses={
        200: {"description": "Prometheus text format"},
        401: {"model": openapi.ErrorResponse, "description": "with --protect-metrics: missing or wrong API key"}})
    async def metrics() -> Response:
        body, content_type = state.models.render_metrics()
        return Response(body, media_type=content_type)

    @app.get("/admin/kv", **openapi.route_docs(openapi.KvReportResponse, errors=(401, 403, 404, 503), description=(
        "Admin key only. The engine core checks its KV cache's integrity (free + cached + in use == total, ref counts "
        "agree with their holders) between two steps and counts the pages. With data-parallel replicas: the counts "
        "summed over the replicas that answered, and each replica's in `replicas`.")))
    async def admin_kv() -> dict:
        try:
            return await kv_census(state.client)
        except (EngineDeadError, asyncio.TimeoutError):
            raise APIError(503, "the engine core did not answer", type="server_error", code="engine_unavailable",
                           retry_after=5) from None

    @app.post("/start_profile", **openapi.route_docs(openapi.ProfileResponse, errors=(400, 401, 403, 404, 409, 503),
                                                    description=profiling.START_DOC))
    async def start_profile() -> dict:
        return await profiling.control_profilers(profiled(state), state.config.profile_dir, start=True)

    @app.post("/stop_profile", **openapi.route_docs(openapi.ProfileResponse, errors=(400, 401, 403, 404, 409, 503),
                                                   description=profiling.STOP_DOC))
    async def stop_profile() -> dict:
        return await profiling.control_profilers(profiled(state), state.config.profile_dir, start=False)

    @app.post("/v1/completions", **openapi.route_docs(openapi.CompletionResponse, errors=openapi.POST_ERRORS, stream=True))
    async def completions(request: Request) -> Response:
        return await state.models.dispatch(await read_json(request, limit), tenant_of(request), request,
                                           lambda serving, body: serving.completions(body, tenant_of(request), request))

    @app.post("/v1/chat/completions", **openapi.route_docs(openapi.ChatCompletionResponse, errors=openapi.POST_ERRORS,
                                                          stream=True))
    async def chat(request: Request) -> Response:
        return await state.models.dispatch(await read_json(request, limit), tenant_of(request), request,
                                           lambda serving, body: serving.chat(body, tenant_of(request), request))

    @app.post("/v1/embeddings", **openapi.route_docs(openapi.EmbeddingResponse, errors=openapi.POST_ERRORS))
    async def embed(request: Request) -> Response:
        tenant = tenant_of(request)
        return await state.models.dispatch(await read_json(request, limit), tenant, request,
                                           lambda serving, body: create_embeddings(serving, body, tenant, request))

    responses = ResponsesServing(ResponseStore(state.config.responses_store_size, state.config.responses_store_ttl))

    @app.post("/v1/responses", **openapi.route_docs(openapi.ResponseObject, errors=openapi.POST_ERRORS, stream=True,
                                                    description=openapi.RESPONSES_DOC))
    async def create_response(request: Request) -> Response:
        tenant = tenant_of(request)
        return await state.models.dispatch(await read_json(request, limit), tenant, request,
                                           lambda serving, body: responses.create(serving, body, tenant, request))

    @app.get("/v1/responses/{response_id}", **openapi.route_docs(openapi.ResponseObject, errors=(401, 404)))
    async def get_response(response_id: str, request: Request) -> Response:
        return responses.get(response_id, tenant_of(request))

    @app.post("/tokenize", **openapi.route_docs(openapi.TokenizeResponse, errors=openapi.POST_ERRORS, description=(
        "A prompt, or messages rendered with the chat template; add_special_tokens (default true for a prompt, false "
        "for messages) puts the tokenizer's special tokens (e.g. BOS) around the text or the rendered chat.")))
    async def tokenize(request: Request) -> Response:
        return await state.models.dispatch(await read_json(request, limit), tenant_of(request), request,
                                           lambda serving, body: serving.tokenize(body))

    @app.post("/detokenize", **openapi.route_docs(openapi.DetokenizeResponse, errors=openapi.POST_ERRORS))
    async def detokenize(request: Request) -> Response:
        return await state.models.dispatch(await read_json(request, limit), tenant_of(request), request,
                                           lambda serving, body: serving.detokenize(body))

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, err: APIError) -> JSONResponse:
        return api_error_response(err)

    @app.exception_handler(BanyanError)
    async def on_banyan_error(request: Request, err: BanyanError) -> JSONResponse:
        return api_error_response(from_banyan_error(err))  # a typed error an endpoint let through: its own status

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = {404: "NotFoundError", 405: "invalid_request_error"}.get(err.status_code, "invalid_request_error")
        return api_error_response(APIError(err.status_code, str(err.detail), type=kind), err.headers)  # 405: Allow

    @app.exception_handler(Exception)
    async def on_bug(request: Request, err: Exception) -> JSONResponse:
        logger.exception("request %s failed", getattr(request.state, "request_id", "?"))
        return api_error_response(APIError(500, "internal server error", type="server_error"))

    admin_models.install(app, lambda: state.models, lambda request: read_json(request, limit))
    lora_adapters.install(app, lambda: next((e.serving.lora for e in state.models.ready() if e.serving.lora), None),
                          lambda request: read_json(request, limit))
    playground.install(app)
    app.add_middleware(Guard, state=state)
    app.add_middleware(AuditLog, enabled=state.config.audit_log)  # added last: outermost, sees the Guard's refusals
    return app
