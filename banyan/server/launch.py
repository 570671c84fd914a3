"""`banyan serve`: start the engine core, then the HTTP server, and own their lifecycle.

    start:   core process up and Ready  ->  bind the port  ->  "listening on ..."
    SIGTERM: stop admitting (503) -> wait for in-flight up to shutdown_timeout -> abort the rest
             (finish_reason "abort") -> close HTTP -> stop the core -> exit 0
    core dies: /health 503, in-flight requests fail at once -> exit 1 (a supervisor restarts us)
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import uvicorn

from banyan.config import EngineConfig, ServerConfig
from banyan.errors import InvalidParameterError
from banyan.ipc.client import EngineClient
from banyan.ipc.dp_client import DataParallelClient, start_engine_client
from banyan.logs import announce
from banyan.server.app import ServerState, build_app
from banyan.server.auth import ADMIN_API_KEY_ENV, AdminAuth, ApiKeyAuth, ApiKeyConfigError, load_api_keys
from banyan.server.connection import DeadlineH11Protocol
from banyan.server import lora_adapters
from banyan.server.errors import APIError
from banyan.server.metrics import ServerMetrics
from banyan.server.model_memory import MemoryBudget
from banyan.server.model_specs import ModelSpec, served_names
from banyan.server.models import ModelRegistry
from banyan.server.replica_metrics import ReplicaCollector
from banyan.server.routing import Route, parse_route
from banyan.server.serving import OpenAIServing

logger = logging.getLogger("banyan.server")


class _Server(uvicorn.Server):
    """uvicorn, with banyan's drain on the first SIGTERM/SIGINT (a second one exits at once)."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        if self.state.draining or self.state.dead:
            return super().handle_exit(sig, frame)
        self.state.draining = True
        asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.state.config.shutdown_timeout
        models = self.state.models
        logger.info("draining %d requests (up to %.0f s)", len(models.in_flight()), self.state.config.shutdown_timeout)
        while models.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        models.abort_all()
        await asyncio.sleep(0.2)  # let the aborted streams write their last chunks
        self.should_exit = True


def load_chat_template(value: str | None) -> str | None:
    """--chat-template takes a file path or the template itself."""
    if value is None:
        return None
    path = Path(value)
    if len(value) < 4096 and path.is_file():
        return path.read_text(encoding="utf-8")
    return value


async def serve(engine_config: EngineConfig, server_config: ServerConfig, *, fault: str | None = None,
                specs: list[ModelSpec] | None = None, routes: list[Route] = ()) -> int:
    """Run until shut down; returns the process exit status. specs: the models (default: engine_config's alone);
    routes: A/B routes besides --route's."""
    keys = load_api_keys(server_config.api_key, os.environ, server_config.api_key_file)
    auth = ApiKeyAuth(keys, share_prefix_cache=server_config.share_prefix_cache)
    admin_keys = load_api_keys(server_config.admin_api_key, os.environ, None, flag="--admin-api-key",
                               env_name=ADMIN_API_KEY_ENV)
    if set(admin_keys) & set(keys):
        raise ApiKeyConfigError("an admin API key must differ from every user API key")
    admin = AdminAuth(admin_keys, auth)
    if specs is None:
        specs = [ModelSpec(served_names(server_config.served_model_name, engine_config.model.model), engine_config,
                           fault=fault)]
    config = _with_template(server_config)
    if config.lora_modules and not specs[0].engine.lora.enable_lora:
        raise InvalidParameterError("lora_modules", "serving LoRA adapters needs --enable-lora on the first model")
    models = await _start_models(config, engine_config, specs, [*routes, *map(parse_route, config.route)])
    first = models.entries[models.primary]
    state = ServerState(config, first.client, first.serving, auth, first.metrics, admin=admin, models=models)
    app = build_app(state)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="warning",
        timeout_keep_alive=30,
        timeout_graceful_shutdown=5,
        h11_max_incomplete_event_size=64 * 1024,  # caps header size (RELIABILITY H5)
        http=DeadlineH11Protocol.with_timeouts(config.request_read_timeout, config.response_write_timeout),
        log_config=None,  # uvicorn's own lines go through banyan's handler (text or JSON, banyan.logs)
    )
    server = _Server(uv_config, state)

    def on_death(message: str) -> None:
        logger.error("engine core died: %s", message)
        state.dead = True
        asyncio.get_running_loop().call_later(1.0, lambda: setattr(server, "should_exit", True))

    def on_swapped(name: str, entry) -> None:  # the first model's handles follow its swaps
        if name == models.primary:
            state.client, state.serving, state.metrics = entry.client, entry.serving, entry.metrics

    models.on_death.append(on_death)
    models.on_swapped.append(on_swapped)
    for entry in models.ready():
        info = entry.client.info
        announce(
            f"banyan: serving {entry.name} ({info.architecture}, {info.dtype} on {info.device}) at "
            f"http://{config.host}:{config.port}/v1 — KV cache {info.num_pages * info.page_size} tokens, "
            f"max_model_len {info.max_model_len}{', API keys required' if auth.enabled else ''}",
            config.log_format,
        )
    try:
        await server.serve()
    finally:
        await models.shutdown()
    return 1 if state.dead else 0


async def _start_models(config: ServerConfig, engine_config: EngineConfig, specs: list[ModelSpec],
                        routes: list[Route]) -> ModelRegistry:
    """Every model of the command line (or models file) loaded and ready, and the routes over them."""

    def make_serving(entry) -> tuple[OpenAIServing, ServerMetrics]:
        client = entry.client
        metrics = ServerMetrics(entry.name, max_model_len=client.info.max_model_len, vllm_names=config.vllm_metric_names)
        own = replace(config, chat_template=load_chat_template(entry.spec.chat_template)) if entry.spec.chat_template else config
        serving = OpenAIServing(own, client, entry.tokenizer, list(entry.spec.names), metrics)
        if isinstance(client, DataParallelClient):
            metrics.registry.register(ReplicaCollector(client, entry.name))
        serving.limiter = models.limiter  # rate limits are per key across all models
        if entry.spec.engine.lora.enable_lora:  # --lora-modules: onto the first model
            serving.lora = lora_adapters.for_model(entry, config.lora_modules if entry.name == models.primary else ())
        serving.finish_hooks.append(models.observe_route)
        return serving, metrics

    async def start_client(engine: EngineConfig, fault: str | None) -> EngineClient:
        return await start_engine_client(engine, fault=fault, log_format=config.log_format)  # DP: several cores

    budget = MemoryBudget(config.memory_budget, engine_config.cache.gpu_memory_utilization)
    allow_faults = any(spec.fault for spec in specs)
    models = ModelRegistry(config, engine_config, budget, make_serving, start_client, allow_faults=allow_faults)
    await models.start(specs)
    try:
        for route in routes:
            models.set_route(route)
    except APIError as e:
        await models.shutdown()
        raise InvalidParameterError("route", e.message) from None
    return models


def _with_template(config: ServerConfig) -> ServerConfig:
    return replace(config, chat_template=load_chat_template(config.chat_template))
