"""Data parallel: N engine cores (each a whole model, each possibly tensor-parallel) behind one API server.

    server ── DataParallelClient ── Router.choose(prompt, loads) ──► EngineClient r ──► engine core r
                                  ◄── deltas of that request ──────┘

`DataParallelClient` answers what the server asks of an `EngineClient` (generate, open, close, abort, stats, info,
health, shutdown), so the server does not know how many cores there are. Each request goes to the replica the router
picks (banyan/distributed/router.py; --router-policy, cache_aware by default), and its aborts follow it there.
Stats are summed over the replicas (per-replica series: server/replica_metrics.py). A replica that dies fails its
own in-flight requests (their streams raise EngineDeadError), the router stops sending there, and the server
carries on with the others while a new core starts in its place (at most MAX_RESTARTS times per replica); the
router takes it back once it is ready. A new core that fails to start (it exits while loading, or is not ready in
time) is tried again after a backoff, START_ATTEMPTS times in all, then the replica is left down:

    replica state   up ──dies──► restarting ──a new core is ready──► up
                                   │  └─ it fails: wait START_BACKOFF x 2^k (at most MAX_BACKOFF), try again
                                   └─ START_ATTEMPTS failures, or MAX_RESTARTS deaths already ──► down

Each replica's state, restarts and failed starts are on GET /admin/models and /metrics (replica_health()). Only
when every replica is down at once do the death hooks run (the server exits non-zero, for its supervisor).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec

from banyan.config import EngineConfig
from banyan.distributed.router import Router
from banyan.engine.faults import replacement_faults
from banyan.ipc import messages as m
from banyan.ipc.client import EngineClient, EngineDeadError, Sink
from banyan.request import RequestDelta

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3  # deaths restarted per replica, over the server's life: a core that keeps dying is left down
START_ATTEMPTS = 4  # new cores tried after one death before the replica is left down
START_BACKOFF, MAX_BACKOFF = 1.0, 30.0  # seconds before the second try, doubling for each later one


@dataclass
class ReplicaHealth:
    """One replica as the server shows it (GET /admin/models, /metrics)."""

    state: str = "up"  # up | restarting | down
    restarts: int = 0  # new cores that took the place of a dead one
    failed_starts: int = 0  # new cores that failed before they were ready
    last_error: str | None = None  # why it last died or failed to start (the first line)


async def start_engine_client(config: EngineConfig, *, fault: str | None = None, log_format: str = "text"):
    """An EngineClient, or with data_parallel_size > 1 a DataParallelClient over that many cores."""
    if config.parallel.data_parallel_size == 1:
        return await EngineClient.start(config, fault=fault, log_format=log_format)
    return await DataParallelClient.start(config, fault=fault, log_format=log_format)


class DataParallelClient:
    def __init__(self, config: EngineConfig, replicas: list[EngineClient], start=EngineClient.start,
                 backoff: float = START_BACKOFF):
        """start(config): a new core for a replica that died (EngineClient.start with the server's options);
        backoff: seconds before a failed start's second try (doubling after)."""
        self.config = config
        self._start = start
        self._backoff = backoff
        self.health = [ReplicaHealth() for _ in replicas]
        self._deaths = [0] * len(replicas)
        self._restarting: set[asyncio.Task] = set()
        self._closing = False
        self.replicas = replicas
        first = replicas[0].info
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
                    ready_timeout: float = 600.0, backoff: float = START_BACKOFF) -> DataParallelClient:
        """Start every replica at once; if one fails, the others are shut down and its error raised. backoff: seconds
        before a failed restart's second try."""
        n = config.parallel.data_parallel_size
        fault, replacement_fault = replacement_faults(fault)
        started = await asyncio.gather(*(EngineClient.start(config, fault=fault, log_format=log_format,
                                                            ready_timeout=ready_timeout) for _ in range(n)),
                                       return_exceptions=True)
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            await asyncio.gather(*(c.shutdown(timeout=1.0) for c in started if isinstance(c, EngineClient)))
            raise failed[0]
        logger.info("data parallel: %d engine cores, router policy %s", n, config.parallel.router_policy or "cache_aware")
        return cls(config, list(started), lambda c: EngineClient.start(c, fault=next(replacement_fault),
                                                                       log_format=log_format, ready_timeout=ready_timeout),
                   backoff)

    # -- state --------------------------------------------------------------------------------
    @property
    def info(self) -> m.Ready:
        """The first replica's Ready, with the KV pages of every replica now in place (a restarted core may have
        sized its pool anew)."""
        return msgspec.structs.replace(self.replicas[0].info, num_pages=sum(r.info.num_pages for r in self.replicas))

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
    def local_pids(self) -> list[int]:
        """The live cores on this host (a core on a Ray node has its memory read there, not here)."""
        return [pid for r in self.replicas for pid in r.local_pids]

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

    async def kv_reports(self, timeout: float = 10.0) -> list[m.KvReport | Exception]:
        """Every replica's KV census (each checks its own cache), asked at once; where a replica did not answer, the
        EngineDeadError or TimeoutError it gave."""
        return await asyncio.gather(*(r.kv_report(timeout) for r in self.replicas), return_exceptions=True)

    async def profiles(self, start: bool, directory: str = "",
                       timeout: float = 600.0) -> list[m.ProfileStatus | Exception | None]:
        """Start or stop every live replica's torch profiler at once (each core writes its own trace, named by its
        pid); per replica its ProfileStatus, the EngineDeadError or TimeoutError it gave, or None while it is down."""
        alive = self.alive()
        if not any(alive):
            raise EngineDeadError("every data-parallel replica is gone")

        async def control(replica: EngineClient, up: bool) -> m.ProfileStatus | None:
            return await replica.profile(start, directory, timeout) if up else None

        return await asyncio.gather(*map(control, self.replicas, alive), return_exceptions=True)

    # -- lifecycle ----------------------------------------------------------------------------
    def _replica_died(self, index: int, reason: str) -> None:
        self._dead.add(index)
        self.router.forget(index)
        health = self.health[index]
        health.last_error = reason.splitlines()[0] if reason else reason
        logger.error("data-parallel replica %d died (%s); %d left", index, reason, sum(self.alive()))
        if not self.is_alive():
            health.state = "down"
            for hook in self.on_death:
                result = hook(f"every data-parallel replica died; the last: {reason}")
                if asyncio.iscoroutine(result):
                    asyncio.ensure_future(result)
        elif self._deaths[index] < MAX_RESTARTS and not self._closing:
            self._deaths[index] += 1
            health.state = "restarting"
            task = asyncio.ensure_future(self._restart(index))
            self._restarting.add(task)
            task.add_done_callback(self._restarting.discard)
        else:
            health.state = "down"
            logger.error("data-parallel replica %d is left down: it died %d times", index, self._deaths[index] + 1)

    async def _restart(self, index: int) -> None:
        """New cores for the replica until one is ready (START_ATTEMPTS at most, with backoff between); the router
        sends to it again from then on. Meanwhile, and if none starts, the router routes around it."""
        health = self.health[index]
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                replica = await self._start(self.config)
            except Exception as e:
                health.failed_starts += 1
                health.last_error = str(e).splitlines()[0] if str(e) else type(e).__name__
                if attempt == START_ATTEMPTS:
                    break
                delay = min(MAX_BACKOFF, self._backoff * 2 ** (attempt - 1))
                logger.warning("data-parallel replica %d: new core %d of %d failed to start (%s); next try in %.1f s",
                               index, attempt, START_ATTEMPTS, health.last_error, delay)
                await asyncio.sleep(delay)
                continue
            if self._closing or not self.is_alive():
                await replica.shutdown(timeout=1.0)
                return
            await self.replicas[index].shutdown(timeout=1.0)  # the dead one's sockets and directory
            self.replicas[index] = replica
            self._watch(index, replica)
            self._dead.discard(index)
            health.state, health.restarts = "up", health.restarts + 1
            logger.info("data-parallel replica %d is back (restart %d of %d, after %d failed starts)", index,
                        self._deaths[index], MAX_RESTARTS, attempt - 1)
            return
        health.state = "down"
        logger.error("data-parallel replica %d is left down: %d new cores failed to start; the last: %s", index,
                     START_ATTEMPTS, health.last_error)

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._closing = True
        for task in list(self._restarting):
            task.cancel()
        await asyncio.gather(*self._restarting, return_exceptions=True)
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
