"""The models one server runs: a registry of named entries, each its own engine core, loaded, unloaded and
swapped while the server runs, with the memory accounted for before each load.

    entry: names (aliases), spec, state, EngineClient (its core process), OpenAIServing (its tokenizer, chat
           template, limits, metrics), memory estimate

    state:   loading ──ready──► ready ──unload──► draining ──core exited──► (gone)
                │                 │
                └──failed──► failed (the reason; the name is free again)
             swap: the new entry loads beside the old one; when it is ready the name points at it in one
                   assignment (no request sees a half-loaded model), and the old one drains and exits.

A request names a model, an alias or a route (routing.py). `dispatch` resolves it, counts it as active on
its entry until its handler returns (a stream's Generation is in its serving's `live` set until it ends),
and a draining entry's core exits only once neither holds anything, or at the drain timeout, when what
is left ends with finish_reason "abort". Requests for a loading model get 503 with Retry-After; for an
unknown one, or one being unloaded, 404.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request

from banyan.checkpoint import open_checkpoint, resolve_model
from banyan.config import EngineConfig, ServerConfig
from banyan.errors import BanyanError
from banyan.ipc.client import EngineClient, joined_to_ray
from banyan.server.auth import ANONYMOUS, RateLimiter, Tenant
from banyan.server.errors import APIError, model_not_found
from banyan.server.metrics import ServerMetrics, render_all
from banyan.server.model_entry import ModelEntry, ModelState
from banyan.server.model_memory import (
    Holding,
    MemoryBudget,
    cpu_default_kv_bytes,
    estimate_memory,
    gpu_cache_by_utilization,
    runs_on_gpu,
)
from banyan.server.model_specs import ModelSpec, with_engine
from banyan.server.routing import Route, RouteMetrics
from banyan.server.serving import OpenAIServing

logger = logging.getLogger("banyan.server")

LOADING_RETRY_AFTER = 5  # seconds a client is told to wait for a loading model
UNLOAD_KILL_AFTER = 10.0  # seconds a draining core gets to exit on its own


ServingFactory = Callable[["ModelEntry"], tuple[OpenAIServing, ServerMetrics]]
"""Builds a ready entry's serving and metrics (launch.py: they take the server's settings)."""
ClientFactory = Callable[[EngineConfig, "str | None"], Awaitable[EngineClient]]
"""Starts an engine core for these settings (and test-only fault) and waits for it to be ready."""


class ModelRegistry:
    """Every model this server runs, by name; the routes over them; loading, unloading and swapping."""

    def __init__(self, config: ServerConfig, base_engine: EngineConfig, budget: MemoryBudget,
                 make_serving: ServingFactory, start_client: ClientFactory, *, allow_faults: bool = False):
        self.config = config
        self.base_engine = base_engine  # the command line's engine settings: what an admin load starts from
        self.budget = budget
        self.make_serving = make_serving
        self.start_client = start_client
        self.allow_faults = allow_faults
        self.limiter = RateLimiter(config.requests_per_minute, config.tokens_per_minute)  # per key, across models
        self.entries: dict[str, ModelEntry] = {}  # every name and alias -> its entry (loading or ready)
        self.failed: dict[str, ModelEntry] = {}  # the last failed load per name, for GET /admin/models
        self.draining: set[ModelEntry] = set()  # unloaded or swapped out, until their core has exited
        self.routes: dict[str, Route] = {}
        self.route_metrics = RouteMetrics()
        self.primary: str | None = None  # requests without `model` go here: the first model given
        self.on_death: list[Callable[[str], object]] = []  # a ready model's core died (not one we stopped)
        self.on_swapped: list[Callable[[str, ModelEntry], None]] = []

    # -- what there is -------------------------------------------------------------------------------
    def models(self) -> list[ModelEntry]:
        """Each entry once (loading and ready), in the order they came."""
        return list(dict.fromkeys(self.entries.values()))

    def ready(self) -> list[ModelEntry]:
        return [e for e in self.models() if e.state is ModelState.READY]

    def every_entry(self) -> list[ModelEntry]:
        """With the swaps loading and those draining: every entry that holds or will hold memory."""
        loaded = self.models()
        swaps = [e.replacement for e in loaded if e.replacement is not None]
        return [*loaded, *swaps, *self.draining]

    def holdings(self) -> list[Holding]:
        return [e.holding() for e in self.every_entry()]

    def describe(self) -> list[dict]:
        live = [e.describe() for e in (*self.models(), *self.draining)]
        return live + [e.describe() for name, e in self.failed.items() if name not in self.entries]

    def model_cards(self) -> list[dict]:
        created = int(time.time())
        cards = [card for e in self.ready() for card in e.cards(created)]
        lengths = {c["id"]: c["max_model_len"] for c in cards}
        return cards + [{"id": r.name, "object": "model", "created": created, "owned_by": "banyan", "root": None,
                         "parent": None, "route": r.as_dict()["variants"],
                         "max_model_len": min((lengths.get(m, 0) for m, _ in r.variants), default=0)}
                        for r in self.routes.values()]

    def engine_healthy(self, entry: ModelEntry) -> bool:
        """Its engine core runs and makes progress (what /health and banyan:engine_healthy report)."""
        return entry.client.is_alive() and entry.client.is_making_progress(self.config.wedge_timeout)

    def render_metrics(self) -> tuple[bytes, str]:
        """/metrics: every ready model's series (model_name label), then the routes'."""
        ready = self.ready()
        for e in ready:
            if e.client.stats is not None:
                e.metrics.update_from_engine_stats(e.client.stats)
            e.metrics.engine_healthy.set(1 if self.engine_healthy(e) else 0)
        return render_all([e.metrics for e in ready], self.route_metrics.registry)

    def in_flight(self) -> list:
        return [g for e in self.every_entry() if e.serving is not None for g in e.serving.in_flight()]

    def abort_all(self) -> None:
        for e in self.every_entry():
            if e.serving is not None:
                e.serving.abort_all()

    # -- requests ------------------------------------------------------------------------------------
    def resolve(self, model: object, user: str | None) -> tuple[ModelEntry, str | None]:
        """The entry that serves `model` (a name, an alias or a route), and the variant's name when a route chose it."""
        if model is None or not isinstance(model, str):  # (the body's validation answers a `model` of the wrong type)
            if self.primary is None:
                raise APIError(404, "no model is loaded; name one", type="NotFoundError", param="model",
                               code="model_not_found")
            model = self.primary
        variant = None
        route = self.routes.get(model)
        if route is not None:
            ready = {name for name, e in self.entries.items() if e.state is ModelState.READY}
            try:
                variant = model = route.choose(user, ready)
            except LookupError:
                raise APIError(503, f"no model of the route {model!r} is ready", type="server_error",
                               code="model_not_ready", retry_after=LOADING_RETRY_AFTER) from None
        entry = self.entries.get(model) or next((e for e in self.ready() if model in e.adapters), None)
        if entry is None:
            raise model_not_found(model)
        if entry.state is not ModelState.READY:
            raise APIError(503, f"the model {model!r} is loading; retry shortly", type="server_error",
                           code="model_loading", retry_after=LOADING_RETRY_AFTER)
        return entry, variant

    async def dispatch(self, body: dict, tenant: Tenant, http: Request,
                       call: Callable[[OpenAIServing, dict], Awaitable]) -> object:
        """Run `call(serving, body)` on the model the body names; a route's variant replaces `model` in the body."""
        requested = body.get("model")
        entry, variant = self.resolve(requested, sticky_user(body, tenant))
        if variant is not None:
            body = {**body, "model": variant}
            http.state.route = (requested, variant)
        entry.active += 1
        try:
            return await call(entry.serving, body)
        except APIError:
            if variant is not None:
                self.route_metrics.observe(requested, variant, ok=False)
            raise
        finally:
            entry.active -= 1

    def observe_route(self, gen) -> None:
        """A finished generation of a routed request: its route's metrics (the serving's finish hook)."""
        if gen.route is None:
            return
        first = [c for c in gen.choices if c.token_times]
        ttft = min((c.token_times[0] - c.arrival for c in first), default=None)
        itls = [b - a for c in first for a, b in zip(c.token_times, c.token_times[1:])]
        ok = all(c.seq.finish_reason is not None for c in gen.choices)
        self.route_metrics.observe(*gen.route, ok=ok, prompt_tokens=gen.prompt_tokens,
                                   generation_tokens=gen.completion_tokens, ttft=ttft, itls=itls)

    # -- loading ---------------------------------------------------------------------------------------
    async def start(self, specs: list[ModelSpec]) -> None:
        """The models given at start-up, all loaded before the server listens; the first failure is raised."""
        # One model and no --memory-budget: as a single-model server always was, the core's own sizing decides (on a
        # CPU from free memory); otherwise each CPU pool is pinned to what its estimate counts (_cpu_cache_pinned).
        check = len(specs) > 1 or self.budget.budget is not None
        entries = [await self.load(spec, check_memory=check) for spec in specs]
        for entry in entries:
            entry.started_with_server = True
        await asyncio.gather(*(t for e in entries for t in e.tasks), return_exceptions=True)
        failed = next((e for e in entries if e.state is ModelState.FAILED), None)
        if failed is not None:
            await self.shutdown()
            raise BanyanError(f"model {failed.name!r} failed to load: {failed.error}")

    async def load(self, spec: ModelSpec, *, check_memory: bool = True) -> ModelEntry:
        """Accept a load (names free, memory fits) and start it in the background; the entry says how it goes."""
        self._check_names_free(spec)
        entry = await self._accepted(spec, check_memory)
        self._check_names_free(spec)  # again: another load may have taken a name meanwhile
        for name in spec.names:
            self.entries[name] = entry
            self.failed.pop(name, None)
        if self.primary is None:
            self.primary = spec.name
        self._background(entry, self._bring_up(entry, on_ready=lambda: None, on_failed=lambda: self._forget(entry)))
        return entry

    def _check_names_free(self, spec: ModelSpec) -> None:
        taken = [n for n in spec.names if n in self.entries or n in self.routes]
        if taken:
            raise APIError(409, f"the name {taken[0]!r} is already in use", param="name", code="model_exists")

    async def swap(self, name: str, spec: ModelSpec) -> ModelEntry:
        """Load `spec` beside the model serving `name`; once ready, `name` (and its aliases) switch to it at once."""
        old = self._ready_entry(name)
        if old.replacement is not None:
            raise APIError(409, f"a swap of {name!r} is already loading", param="name", code="swap_in_progress")
        new = await self._accepted(dataclasses.replace(spec, names=old.spec.names))
        if self.entries.get(name) is not old or old.replacement is not None:  # it changed while we looked
            raise APIError(409, f"the model {name!r} changed meanwhile; try again", param="name", code="model_changed")
        old.replacement = new
        new.started_with_server = old.started_with_server

        def switch() -> None:
            old.replacement = None
            for alias in old.spec.names:
                self.entries[alias] = new
            logger.info("model %r swapped: %s -> %s", name, old.spec.source, new.spec.source)
            for hook in self.on_swapped:
                hook(old.name, new)
            self._retire(old, self.config.shutdown_timeout)

        def keep_old() -> None:  # the old model serves on; the reason stays on its entry
            old.replacement = None
            old.error = f"swap to {new.spec.source} failed: {new.error}"
            logger.error("swap of %r to %s failed: %s", name, new.spec.source, new.error)

        self._background(new, self._bring_up(new, on_ready=switch, on_failed=keep_old))
        return old

    def unload(self, name: str, timeout: float) -> ModelEntry:
        """Stop routing to `name` now; drain its requests up to `timeout` s, abort the rest, stop its core."""
        entry = self.entries.get(name)
        if entry is None:
            raise model_not_found(name)
        if entry.replacement is not None:
            raise APIError(409, f"a swap of {name!r} is loading; unload it once it is done", code="swap_in_progress")
        self._forget(entry)
        if entry.state is ModelState.LOADING:  # nothing to drain: stop the load (its core is killed)
            for task in list(entry.tasks):
                task.cancel()
            entry.state, entry.error = ModelState.FAILED, "unloaded while loading"
            return entry
        self._retire(entry, timeout)
        return entry

    async def _accepted(self, spec: ModelSpec, check_memory: bool = True) -> ModelEntry:
        """The entry for a load that fits (or MemoryBudgetExceededError with the numbers; a bad checkpoint: 400)."""
        if spec.fault is not None and not self.allow_faults:
            spec = dataclasses.replace(spec, fault=None)
        model = spec.engine.model
        try:  # reading the tokenizer and shape takes a while: off the event loop
            path = resolve_model(spec.source)
            checkpoint = await asyncio.to_thread(open_checkpoint, spec.source, model.trust_remote_code, model.tokenizer)
        except BanyanError as e:
            raise APIError(400, f"cannot load {spec.source!r}: {e}", param="model", code="model_load_failed") from None
        if spec.engine.parallel.data_parallel_backend == "ray":  # count (and tell the cores) the replicas on a node
            spec = await asyncio.to_thread(_counted_per_node, spec)
        gpu = runs_on_gpu(spec.engine)
        spec = self._with_share(spec, checkpoint, path, gpu)
        if check_memory and not gpu:
            spec = _cpu_cache_pinned(spec)
        estimate = estimate_memory(spec.engine, checkpoint.arch, path, gpu)
        if gpu and spec.engine.cache.kv_cache_memory is None and spec.engine.cache.num_pages is None:
            estimate = gpu_cache_by_utilization(estimate, spec.engine.cache.gpu_memory_utilization)
        if check_memory:
            self.budget.check(spec.name, estimate, self.holdings(), gpu)
        return ModelEntry(spec, estimate, tokenizer=checkpoint.tokenizer)

    def _with_share(self, spec: ModelSpec, checkpoint, path, gpu: bool) -> ModelSpec:
        """A memory_share without kv_cache_memory: the KV cache gets what the share leaves after weights and process."""
        if spec.memory_share is None or spec.engine.cache.kv_cache_memory is not None:
            return spec
        share = self.budget.share_bytes(spec.memory_share, gpu)
        if share is None:
            return spec
        without_kv = estimate_memory(with_engine(spec, cache=_cache(spec, 0)).engine, checkpoint.arch, path, gpu)
        kv = share - without_kv.weights - without_kv.process
        if kv <= 0:
            raise APIError(409, f"model {spec.name!r}: memory_share {spec.memory_share} ({share} bytes) does not hold "
                           f"its weights and process ({without_kv.weights + without_kv.process} bytes)",
                           param="memory_share", code="memory_budget_exceeded")
        return with_engine(spec, cache=_cache(spec, kv))

    async def _bring_up(self, entry: ModelEntry, on_ready: Callable[[], None], on_failed: Callable[[], None]) -> None:
        try:
            entry.client = await self.start_client(entry.spec.engine, entry.spec.fault)
            entry.serving, entry.metrics = self.make_serving(entry)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the reason goes to GET /admin/models; the server carries on
            entry.state, entry.error = ModelState.FAILED, _reason(e)
            logger.error("model %r (%s) failed to load: %s", entry.name, entry.spec.source, entry.error)
            if entry.client is not None:
                await entry.client.shutdown(timeout=2.0)
            on_failed()
            return
        entry.client.on_death.append(lambda reason: self._died(entry, reason))
        entry.state, entry.loaded_at = ModelState.READY, time.time()
        logger.info("model %r ready (%s)", entry.name, entry.spec.source)
        on_ready()

    def _forget(self, entry: ModelEntry) -> None:
        """Its names route nowhere from now on (a failed load is remembered for GET /admin/models)."""
        for name in entry.spec.names:
            if self.entries.get(name) is entry:
                del self.entries[name]
            if entry.state is ModelState.FAILED:
                self.failed[name] = entry
        if self.primary in entry.spec.names:  # requests without `model` go to the next one given
            self.primary = next((e.name for e in self.models()), None)
        # Routes keep their variants: `resolve` chooses among the ready ones.

    def _retire(self, entry: ModelEntry, timeout: float) -> None:
        entry.state = ModelState.DRAINING
        self.draining.add(entry)
        self._background(entry, self._drain(entry, timeout))

    async def _drain(self, entry: ModelEntry, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while entry.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if entry.busy():
            logger.warning("model %r: aborting %d requests still running after %.1f s", entry.name,
                           len(entry.serving.in_flight()), timeout)
            entry.serving.abort_all()
            await asyncio.sleep(0.2)  # let the aborted streams write their last chunks
        await entry.client.shutdown(timeout=UNLOAD_KILL_AFTER)
        self.draining.discard(entry)
        logger.info("model %r (%s) unloaded", entry.name, entry.spec.source)

    def _died(self, entry: ModelEntry, reason: str) -> None:
        """A core died on its own. One of the start-up models: the server ends (its supervisor restarts the set it
        was given). One loaded since: only it fails (its requests got the error), the others serve on."""
        if entry.started_with_server:
            for hook in self.on_death:
                hook(f"model {entry.name!r}: {reason}")
            return
        logger.error("model %r: its engine core died (%s); the other models serve on", entry.name, reason)
        entry.state, entry.error = ModelState.FAILED, f"its engine core died: {reason}"
        self._forget(entry)
        self._background(entry, entry.client.shutdown(timeout=1.0))  # reap it, close its sockets

    def _ready_entry(self, name: str) -> ModelEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise model_not_found(name)
        if entry.state is not ModelState.READY:
            raise APIError(409, f"the model {name!r} is {entry.state.value}", param="name", code="model_not_ready")
        return entry

    def _background(self, entry: ModelEntry, work: Awaitable) -> None:
        task = asyncio.ensure_future(work)
        entry.tasks.add(task)
        task.add_done_callback(entry.tasks.discard)

    # -- routes ------------------------------------------------------------------------------------------
    def set_route(self, route: Route) -> None:
        """Create or replace a route (weights change for the next request; sticky users move only as the slices do)."""
        if route.name in self.entries:
            raise APIError(409, f"{route.name!r} names a model; a route needs a name of its own", param="name",
                           code="route_name_taken")
        unknown = [m for m, _ in route.variants if m not in self.entries]
        if unknown:
            raise APIError(400, f"the route's variant {unknown[0]!r} is not a served model", param=f"variants.{unknown[0]}",
                           code="model_not_found")
        self.routes[route.name] = route

    def delete_route(self, name: str) -> None:
        if self.routes.pop(name, None) is None:
            raise APIError(404, f"there is no route {name!r}", type="NotFoundError", code="route_not_found")

    # -- shutdown ----------------------------------------------------------------------------------------
    async def shutdown(self) -> None:
        entries = self.every_entry()
        for e in entries:
            for task in list(e.tasks):
                task.cancel()
        await asyncio.gather(*(e.client.shutdown() for e in entries if e.client is not None), return_exceptions=True)


def sticky_user(body: dict, tenant: Tenant) -> str | None:
    """Who a route keeps on one variant: the OpenAI `user` field, else the API key's tenant (None: anonymous)."""
    user = body.get("user")
    if isinstance(user, str) and user:
        return "user:" + user
    return None if tenant is ANONYMOUS else "tenant:" + tenant.tenant_id


def _counted_per_node(spec: ModelSpec) -> ModelSpec:
    """With Ray placing the replicas: the spec joined to the cluster, naming the most replicas one node may hold
    (replicas_on_host), so that its estimate counts those on this host as each core's KV sizing does; unchanged when
    the cluster cannot be joined (the core's start then fails with the reason)."""
    try:
        return dataclasses.replace(spec, engine=joined_to_ray(spec.engine))
    except Exception as e:  # noqa: BLE001 - reported by the start that follows
        logger.warning("model %r: the Ray cluster could not be joined to count its replicas per node: %s", spec.name, e)
        return spec


def _cpu_cache_pinned(spec: ModelSpec) -> ModelSpec:
    """A CPU model in a server that budgets memory keeps the pool its estimate counted (cpu_default_kv_bytes) instead of
    sizing it from free memory, which the other models' cores, starting at the same time, are about to take."""
    cache = spec.engine.cache
    if cache.kv_cache_memory is not None or cache.num_pages is not None:
        return spec
    return with_engine(spec, cache=_cache(spec, cpu_default_kv_bytes()))


def _cache(spec: ModelSpec, kv_bytes: int):
    return dataclasses.replace(spec.engine.cache, kv_cache_memory=kv_bytes)


def _reason(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text if len(text) <= 2000 else text[:2000] + " ..."
