"""The admin routes over the models and routes of a running server (admin key only: the Guard checks it).

    GET    /admin/models                      {"object": "list", "data": [{name, model, state, memory_bytes, ...}]}
    POST   /admin/models                      {"name", "model", "engine_args": {...}, "memory_share"} -> loading
    GET    /admin/models/{name}               one entry
    DELETE /admin/models/{name}?timeout=S     stop routing now, drain up to S s, abort the rest, stop its core
    POST   /admin/models/{name}/swap          {"model", "engine_args"}: load beside it, switch when ready
    GET    /admin/routes                      {"object": "list", "data": [{name, variants}]}
    PUT    /admin/routes/{name}               {"variants": {"modelA": 90, "modelB": 10}}
    DELETE /admin/routes/{name}

Loads and swaps answer at once with the entry (state "loading"); GET shows "ready", or "failed" with the
reason. engine_args are engine settings by name (as LLM(**kwargs) and the CLI flags): a new model starts
from the server's own engine settings, a swap from the swapped model's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal

from fastapi import FastAPI
from pydantic import BaseModel
from starlette.requests import Request

from banyan.config import EngineConfig
from banyan.errors import BanyanError
from banyan.server import openapi
from banyan.server.errors import APIError, from_banyan_error
from banyan.server.model_specs import ModelSpec, engine_from_args
from banyan.server.models import ModelRegistry
from banyan.server.routing import make_route

ADMIN_ERRORS = (400, 401, 403, 404, 409, 503)
MAX_NAME_LENGTH = 256
NAME = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
TIMEOUT = {"name": "timeout", "in": "query", "required": False, "description": "seconds to drain before aborting",
           "schema": {"type": "number", "minimum": 0, "maximum": 3600}}


class ModelSwap(BaseModel):
    model: str
    state: str
    error: str | None = None


class AdminModel(BaseModel):
    """One served model as the operator sees it; memory_bytes: what its cores and their tensor/pipeline-parallel
    workers on this host hold now (RSS; the estimate while loading), memory_estimate_bytes: what the budget counts
    for it."""

    name: str
    model: str
    state: Literal["loading", "ready", "draining", "failed"]
    memory_bytes: int
    memory_estimate_bytes: int
    aliases: list[str]
    pid: int | None = None
    ready_at: float | None = None
    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    error: str | None = None
    swap: ModelSwap | None = None


class AdminModelList(BaseModel):
    object: Literal["list"]
    data: list[AdminModel]


class AdminRoute(BaseModel):
    name: str
    variants: dict[str, float]


class AdminRouteList(BaseModel):
    object: Literal["list"]
    data: list[AdminRoute]


class RouteDeleted(BaseModel):
    name: str
    deleted: bool


def install(app: FastAPI, registry: Callable[[], ModelRegistry], read_body: Callable[[Request], Awaitable[dict]]) -> None:
    """Add the admin model and route endpoints to `app` (registry: the server's, read at each call)."""

    def docs(answer: type[BaseModel], description: str, *params: dict) -> dict:
        extra = {"openapi_extra": {"parameters": list(params)}} if params else {}
        return openapi.route_docs(answer, errors=ADMIN_ERRORS, description=description) | extra

    @app.get("/admin/models", **docs(AdminModelList, "Admin key only. Every model: name, source, state, memory."))
    async def list_models() -> dict:
        return {"object": "list", "data": registry().describe()}

    @app.get("/admin/models/{name:path}", **docs(AdminModel, "Admin key only. One model's entry.", NAME))
    async def get_model(request: Request) -> dict:
        name = request.path_params["name"]
        entry = next((e for e in registry().describe() if name in (e["name"], *e["aliases"])), None)
        if entry is None:
            raise APIError(404, f"there is no model {name[:100]!r}", type="NotFoundError", code="model_not_found")
        return entry

    @app.post("/admin/models", **docs(AdminModel, "Admin key only. Load a model in the background (state loading -> ready | "
                                      "failed); refused with 409 when it would not fit the memory budget."))
    async def load_model(request: Request) -> dict:
        models, body = registry(), await read_body(request)
        spec = ModelSpec(_names(body.get("name")), _engine(models.base_engine, body), _share(body.get("memory_share")),
                         fault=_fault(body))
        return (await _answering(models.load(spec))).describe()

    @app.post("/admin/models/{name:path}/swap", **docs(AdminModel,
        "Admin key only. Load another source under this name; requests switch to it when it is ready, the old "
        "model drains and stops. No request fails or is answered by a half-loaded model.", NAME))
    async def swap_model(request: Request) -> dict:
        name, models, body = request.path_params["name"], registry(), await read_body(request)
        current = models.entries.get(name)
        base = current.spec.engine if current is not None else models.base_engine
        spec = ModelSpec((name,), _engine(base, body), _share(body.get("memory_share")), fault=_fault(body))
        return (await _answering(models.swap(name, spec))).describe()

    @app.delete("/admin/models/{name:path}", **docs(AdminModel,
        "Admin key only. Unload: new requests get 404 at once; running ones may finish for `timeout` seconds "
        "(default --shutdown-timeout), then end with finish_reason abort; the model's core exits.", NAME, TIMEOUT))
    async def unload_model(request: Request) -> dict:
        models = registry()
        timeout = _timeout(request.query_params.get("timeout"), models.config.shutdown_timeout)
        return models.unload(request.path_params["name"], timeout).describe()

    @app.get("/admin/routes", **docs(AdminRouteList, "Admin key only. The A/B and canary routes."))
    async def list_routes() -> dict:
        return {"object": "list", "data": [r.as_dict() for r in registry().routes.values()]}

    @app.put("/admin/routes/{name:path}", **docs(AdminRoute, "Admin key only. Create a route or change its weights live.", NAME))
    async def put_route(request: Request) -> dict:
        body = await read_body(request)
        route = _checked(lambda: make_route(request.path_params["name"], body.get("variants")))
        registry().set_route(route)
        return route.as_dict()

    @app.delete("/admin/routes/{name:path}", **docs(RouteDeleted, "Admin key only. Remove a route.", NAME))
    async def delete_route(request: Request) -> dict:
        name = request.path_params["name"]
        registry().delete_route(name)
        return {"name": name, "deleted": True}


def _timeout(value: str | None, default: float) -> float:
    """?timeout=S: seconds to drain before aborting (0 to 3600)."""
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 3600:
        raise APIError(400, "timeout must be a number of seconds from 0 to 3600", param="timeout")
    return seconds


def _names(value: object) -> tuple[str, ...]:
    names = [value] if isinstance(value, str) else value
    if (not isinstance(names, list) or not names
            or not all(isinstance(n, str) and 0 < len(n) <= MAX_NAME_LENGTH and n.isprintable() for n in names)):
        raise APIError(400, f"name must be a model name (or a list of names) of 1-{MAX_NAME_LENGTH} printable "
                       "characters", param="name")
    return tuple(names)


def _engine(base: EngineConfig, body: dict) -> EngineConfig:
    source = body.get("model")
    if not isinstance(source, str) or not source or len(source) > 4096:
        raise APIError(400, "model must be a model path or alias", param="model")
    return _checked(lambda: engine_from_args(base, source, body.get("engine_args")))


def _share(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise APIError(400, "memory_share must be a fraction in (0, 1]", param="memory_share")
    return float(value)


def _fault(body: dict) -> str | None:
    """Test-only fault injection for the new core (honoured only when the server runs with --fault)."""
    fault = body.get("fault")
    return fault if isinstance(fault, str) else None


async def _answering(work: Awaitable):
    try:
        return await work
    except BanyanError as e:  # e.g. the memory budget: its status and code, the numbers in the message
        raise from_banyan_error(e) from None


def _checked(build: Callable):
    try:
        return build()
    except BanyanError as e:
        raise from_banyan_error(e) from None
