"""Data parallel: N engine cores (each a whole model, each possibly tensor-parallel) behind one API server.

    server ── DataParallelClient ── Router.choose(prompt, loads) ──► EngineClient r ──► engine core r
                                  ◄── deltas of that request ──────┘

`DataParallelClient` answers what the server asks of an `EngineClient` (generate, open, close, abort, stats, info,
health, shutdown), so the server does not know how many cores there are. Each request goes to the replica the router
picks (banyan/distributed/router.py; --router-policy, cache_aware by default), and its aborts follow it there.
Stats are summed over the replicas (per-replica series: server/replica_metrics.py). A replica that dies fails its
own in-flight requests (their streams raise EngineDeadError), the router stops sending there, and the server
carries on with the others while a new core starts in its place (at most MAX_RESTARTS times per replica); the
router takes it back once it is ready. Only when every replica is down at once do the death hooks run (the server
exits non-zero, for its supervisor to restart).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import msgspec

from banyan.config import EngineConfig
from banyan.distributed.router import Router
from banyan.ipc import messages as m
from banyan.ipc.client import EngineClient, EngineDeadError, Sink
from banyan.request import RequestDelta

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3  # per replica, over the server's life: a core that keeps dying is left down


async def start_engine_client(config: EngineConfig, *, fault: str | None = None, log_format: str = "text"):
    """An EngineClient, or with data_parallel_size > 1 a DataParallelClient over that many cores."""
    if config.parallel.data_parallel_size == 1:
        return await EngineClient.start(config, fault=fault, log_format=log_format)
    return await DataParallelClient.start(config, fault=fault, log_format=log_format)


class DataParallelClient:
    def __init__(self, config: EngineConfig, replicas: list[EngineClient], start=EngineClient.start):
        """start(config): a new core for a replica that died (EngineClient.start with the server's options)."""
        self.config = config
        self._start = start
        self._restarts = [0] * len(replicas)
        self._closing = False
        self.replicas = replicas
        first = replicas[0].info
        self.info = msgspec.structs.replace(first, num_pages=sum(r.info.num_pages for r in replicas))
        self.router = Router(config.parallel.router_policy or "cache_aware", len(replicas), first.page_size,
                             first.num_pages)
        self.on_death: list[Callable[[str], object]] = []
        self._placed: dict[str, int] = {}  # request id -> its replica, while it runs
        self._dead: set[int] = set()
        for index, replica in enumerate(replicas):
            self._watch(index, replica)

    def _watch(self, index: int, replica: EngineClient) -> None:
        replica.on_death.append(lambda reason: self._replica_died(index, reason))

    @classmethod
    async def start(cls, config: EngineConfig, *, fault: str | None = None, log_format: str = "text",
                    ready_timeout: float = 600.0) -> DataParallelClient:
        """Start every replica at once; if one fails, the others are shut down and its error raised."""
        n = config.parallel.data_parallel_size
        started = await asyncio.gather(*(EngineClient.start(config, fault=fault, log_format=log_format,
                                                            ready_timeout=ready_timeout) for _ in range(n)),
                                       return_exceptions=True)
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            await asyncio.gather(*(c.shutdown(timeout=1.0) for c in started if isinstance(c, EngineClient)))
            raise failed[0]
        logger.info("data parallel: %d engine cores, router policy %s", n, config.parallel.router_policy or "cache_aware")
        return cls(config, list(started), lambda c: EngineClient.start(c, fault=fault, log_format=log_format,
                                                                       ready_timeout=ready_timeout))

    # -- state --------------------------------------------------------------------------------
    def alive(self) -> list[bool]:
        return [i not in self._dead and r.is_alive() for i, r in enumerate(self.replicas)]

    def is_alive(self) -> bool:
        return any(self.alive())

    def is_making_progress(self, wedge_timeout: float) -> bool:
        return all(r.is_making_progress(wedge_timeout) for r, ok in zip(self.replicas, self.alive()) if ok)

    @property
    def stats(self) -> m.EngineStats | None:
        """Every live replica's stats summed (counters and loads; fractions and times averaged); the router learns
        each replica's evictions from them."""
        live = [(i, r.stats) for i, (r, ok) in enumerate(zip(self.replicas, self.alive())) if ok and r.stats]
        for index, stats in live:
            self.router.observe_evictions(index, stats.num_evicted_pages)
        return merge_stats([s for _, s in live]) if live else None

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    @property
    def pid(self) -> int:
        return self.replicas[0].pid

    @property
    def pids(self) -> list[int]:
        return [r.pid for r in self.replicas]

    @property
    def returncode(self) -> int | None:
        codes = [r.returncode for r in self.replicas]
        return None if None in codes else next((c for c in codes if c), 0)

    def stderr_tail(self) -> str:
        return "".join(f"[replica {i}]\n{r.stderr_tail()}" for i, r in enumerate(self.replicas))

    # -- requests -----------------------------------------------------------------------------
    async def generate(self, request: m.AddRequest) -> AsyncIterator[RequestDelta]:
        """As EngineClient.generate, on the replica the router picks."""
        index = self._place(request)
        try:
            async for delta in self.replicas[index].generate(request):
                yield delta
        finally:
            self._placed.pop(request.request_id, None)

    def open(self, request: m.AddRequest, sink: Sink) -> None:
        """As EngineClient.open, on the replica the router picks."""
        index = self._place(request)

        def placed_sink(item: RequestDelta | Exception) -> None:
            if isinstance(item, Exception) or item.finish_reason is not None:
                self._placed.pop(request.request_id, None)
            sink(item)

        try:
            self.replicas[index].open(request, placed_sink)
        except BaseException:
            self._placed.pop(request.request_id, None)
            raise

    def close(self, request_ids: list[str]) -> None:
        """As EngineClient.close, each on its replica."""
        for index, ids in self._by_replica(request_ids).items():
            self.replicas[index].close(ids)
        for request_id in request_ids:
            self._placed.pop(request_id, None)

    async def abort(self, request_ids: list[str]) -> None:
        for index, ids in self._by_replica(request_ids).items():
            await self.replicas[index].abort(ids)

    def _place(self, request: m.AddRequest) -> int:
        """The replica the router picks for the request, remembered until it ends."""
        if not self.is_alive():
            raise EngineDeadError("every data-parallel replica is gone")
        loads = [r.num_in_flight for r in self.replicas]
        index = self.router.choose(request.cache_salt, request.prompt_token_ids, loads, self.alive())
        self._placed[request.request_id] = index
        return index

    def _by_replica(self, request_ids: list[str]) -> dict[int, list[str]]:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            if request_id in self._placed:
                by_replica.setdefault(self._placed[request_id], []).append(request_id)
        return by_replica

    async def kv_report(self, timeout: float = 10.0) -> m.KvReport:
        """The first live replica's KV census (each replica checks its own cache)."""
        return await self._first_alive().kv_report(timeout)

    async def profile(self, start: bool, directory: str = "", timeout: float = 600.0) -> m.ProfileStatus:
        """The torch profiler of the first live replica."""
        return await self._first_alive().profile(start, directory, timeout)

    def _first_alive(self) -> EngineClient:
        for replica, ok in zip(self.replicas, self.alive()):
            if ok:
                return replica
        raise EngineDeadError("every data-parallel replica is gone")

    # -- lifecycle ----------------------------------------------------------------------------
    def _replica_died(self, index: int, reason: str) -> None:
        self._dead.add(index)
        self.router.forget(index)
        logger.error("data-parallel replica %d died (%s); %d left", index, reason, sum(self.alive()))
        if not self.is_alive():
            for hook in self.on_death:
                result = hook(f"every data-parallel replica died; the last: {reason}")
                if asyncio.iscoroutine(result):
                    asyncio.ensure_future(result)
        elif self._restarts[index] < MAX_RESTARTS and not self._closing:
            self._restarts[index] += 1
            asyncio.ensure_future(self._restart(index))

    async def _restart(self, index: int) -> None:
        """A new core for the replica; the router sends to it again once it is ready."""
        try:
            replica = await self._start(self.config)
        except Exception as e:
            logger.error("data-parallel replica %d could not restart: %s", index, e)
            return
        if self._closing or not self.is_alive():
            await replica.shutdown(timeout=1.0)
            return
        await self.replicas[index].shutdown(timeout=1.0)  # the dead one's sockets and directory
        self.replicas[index] = replica
        self._watch(index, replica)
        self._dead.discard(index)
        logger.info("data-parallel replica %d is back (restart %d of %d)", index, self._restarts[index], MAX_RESTARTS)

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._closing = True
        await asyncio.gather(*(r.shutdown(timeout) for r in self.replicas))


def merge_stats(parts: list[m.EngineStats]) -> m.EngineStats:
    """One EngineStats for several cores: integers (counts, counters) and per-position lists summed, floats
    (a usage fraction, measured times) averaged, num_steps summed (it grows while any core makes progress)."""
    merged = {}
    for name in parts[0].__struct_fields__:
        values = [getattr(p, name) for p in parts]
        if isinstance(values[0], bool) or values[0] is None:
            merged[name] = values[0]
        elif isinstance(values[0], int):
            merged[name] = sum(values)
        elif isinstance(values[0], float):
            merged[name] = sum(values) / len(values)
        elif isinstance(values[0], list):
            width = max(len(v) for v in values)
            merged[name] = [sum(v[i] for v in values if i < len(v)) for i in range(width)]
        else:
            merged[name] = values[0]
    return m.EngineStats(**merged)
