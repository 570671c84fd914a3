"""EngineClient: the API server's handle on the engine core process, inside its asyncio loop.

    client = await EngineClient.start(config)
    async for delta in client.generate(AddRequest(...)):   # one stream per request
        ...
    await client.shutdown()

One background task reads the core's output socket and hands each delta to its request's sink in the
same turn of the loop (`open(request, sink)`): a consumer of many streams (a Generation, an HTTP
connection) then wakes once per step, not once per token; `generate` is the one-queue-per-request
form. The task also watches the process, so that when the core dies (EngineDead, crash, SIGKILL)
every stream raises EngineDeadError within ~POLL_MS and the `on_death` hooks run. A stream the
consumer leaves early (break, aclose, cancelled task, `close`: the HTTP client went away) aborts its
request in the core. Sockets are ipc:// in a private 0700 directory (for a core on a Ray node, --data-parallel-backend
ray: TCP on this node's address, distributed/ray_cluster.py); messages are msgspec structs, never pickle.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from banyan.config import EngineConfig
from banyan.distributed import ray_cluster
from banyan.distributed.curve import Guard
from banyan.errors import BanyanError, ErrorInfo
from banyan.ipc import core_launch
from banyan.ipc import messages as m
from banyan.request import RequestDelta

logger = logging.getLogger(__name__)

Sink = Callable[[RequestDelta | Exception], None]
"""Takes one request's deltas, then possibly an exception (RequestError, EngineDeadError) as its last item; called
by the reader inside the event loop, so it must neither block nor raise."""

POLL_MS = 100  # how often the reader looks at the process between messages
STDERR_TAIL_LINES = 40


class EngineDeadError(BanyanError):
    """The engine core is gone (crashed, killed or shut down); no request can be served."""

    code = "engine_dead"
    public_message = "the engine stopped; the server is restarting"


class RequestError(BanyanError):
    """One request failed in the core (its last delta carried `error`): the OpenAI error fields, as sent."""

    public_message = None

    def __init__(self, error: ErrorInfo):
        super().__init__(error.message)
        self.status, self.type, self.param, self.code = error.status, error.type, error.param, error.code
        self.retry_after = error.retry_after


class EngineClient:
    """Use `await EngineClient.start(config)`; the constructor expects a running loop and a fresh ipc dir."""

    def __init__(self, config: EngineConfig, ipc_dir: str, fault: str | None = None, log_format: str = "text"):
        self.config = config
        self.ipc_dir = ipc_dir
        self.info: m.Ready | None = None
        self.stats: m.EngineStats | None = None
        self.on_death: list[Callable[[str], object]] = []  # called once with the reason; may be async
        self._streams: dict[str, Sink] = {}  # request id -> where its deltas go, while it runs
        self._kv_queries: dict[int, asyncio.Future] = {}  # query id -> the KvReport to come
        self._query_ids = itertools.count()
        self._profile_lock = asyncio.Lock()
        self._profile_reply: asyncio.Future | None = None  # the ProfileStatus to come
        self._dead: str | None = None
        self._closing = False
        self._shutdown_task: asyncio.Task | None = None
        self._stats_at = self._progress_at = time.monotonic()
        self._encoder = m.encoder()
        self._decoder = m.client_decoder()

        config = joined_to_ray(config)  # first: a refused Ray address leaves no sockets behind
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._output = self._ctx.socket(zmq.PULL)
        # a core on a Ray node connects over TCP: CURVE, admitting only the keys it is given (distributed/curve.py)
        self._guard = Guard(self._ctx) if config.parallel.data_parallel_backend == "ray" else None
        addresses = [_bind(sock, ipc_dir, name, self._guard) for sock, name in ((self._input, "input"),
                                                                                (self._output, "output"))]
        self._output_now = zmq.Socket.shadow(self._output.underlying)  # the same socket, read without futures
        self._proc = _spawn(config, *addresses, fault, log_format, self._guard)
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._stderr_pump = threading.Thread(target=_pump_stderr, args=(self._proc, self._stderr_tail), daemon=True)
        self._stderr_pump.start()
        self._finalizer = weakref.finalize(self, _reap, self._proc, ipc_dir)  # also at interpreter exit
        self._ready = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read_loop(), name="banyan-engine-reader")

    @classmethod
    async def start(cls, config: EngineConfig, *, fault: str | None = None, ready_timeout: float = 600.0,
                    log_format: str = "text") -> EngineClient:
        """Spawn the core and wait for Ready; EngineDeadError (with the core's stderr tail) if it fails first.
        log_format: the core's log lines, text or json (banyan.logs)."""
        ipc_dir = tempfile.mkdtemp(prefix="banyan-")  # mode 0700
        try:
            client = cls(config, ipc_dir, fault, log_format)
        except BaseException:  # nothing started (a refused Ray address, a process that could not be spawned)
            shutil.rmtree(ipc_dir, ignore_errors=True)
            raise
        try:
            client.info = await asyncio.wait_for(asyncio.shield(client._ready), ready_timeout)
        except BaseException as e:
            await client.shutdown(timeout=0.5)
            if isinstance(e, asyncio.TimeoutError):
                message = f"the engine core was not ready after {ready_timeout:.0f} s"
                raise EngineDeadError(f"{message}\n{client.stderr_tail()}") from None
            if isinstance(e, EngineDeadError):
                raise EngineDeadError(f"{e}\n{client.stderr_tail()}") from None
            raise
        return client

    # -- state --------------------------------------------------------------------------------
    def is_alive(self) -> bool:
        return self._dead is None and self._proc.poll() is None

    def is_making_progress(self, wedge_timeout: float) -> bool:
        """False when no EngineStats came for wedge_timeout, or requests wait and no step completed in it."""
        now = time.monotonic()
        if now - self._stats_at > wedge_timeout:
            return False
        return not self._streams or now - self._progress_at <= wedge_timeout

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def local_pids(self) -> list[int]:
        """[its pid] while the core lives on this host, whose /proc shows its memory; [] once it has exited, and for
        a core Ray placed (--data-parallel-backend ray), which may run on any node."""
        return [self._proc.pid] if isinstance(self._proc, subprocess.Popen) and self.is_alive() else []

    @property
    def returncode(self) -> int | None:
        """The core's exit status once it has exited (negative: killed by that signal)."""
        return self._proc.poll()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def stderr_tail(self) -> str:
        """The core's last log lines (all of them once it has exited)."""
        if self._proc.stderr is None:  # a core on a Ray node: its actor keeps them
            return self._proc.log_tail()
        if self._proc.poll() is not None:
            self._stderr_pump.join(timeout=1.0)
        return "".join(self._stderr_tail)

    # -- requests -----------------------------------------------------------------------------
    async def generate(self, request: m.AddRequest) -> AsyncIterator[RequestDelta]:
        """Send the request and yield its deltas, the last one with finish_reason.

        Raises RequestError (the core refused it, or it failed on the way) or EngineDeadError. Leaving early aborts it in the core.
        """
        queue: asyncio.Queue = asyncio.Queue()
        sink = queue.put_nowait
        self.open(request, sink)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if self._streams.get(request.request_id) is sink:  # still open in the core: the consumer left early
                self.close([request.request_id])

    def open(self, request: m.AddRequest, sink: Sink) -> None:
        """Send the request; the reader calls `sink` with each of its deltas until the one with finish_reason, or
        with the exception that ends it. Raises EngineDeadError, or RequestError for an id already running."""
        request_id = request.request_id
        if self._dead is not None or self._closing:
            raise EngineDeadError(self._dead or "the engine is shutting down")
        if request_id in self._streams:
            raise RequestError(ErrorInfo(f"request {request_id!r} is already running", param="request_id"))
        if not self._streams:
            self._progress_at = time.monotonic()  # idle until now: the wedge clock starts here
        self._streams[request_id] = sink
        self._send(request)

    def close(self, request_ids: list[str]) -> None:
        """Stop the sinks of the requests still open and abort them in the core (the consumer left early); a
        no-op for those that ended."""
        still_open = [request_id for request_id in request_ids if self._streams.pop(request_id, None) is not None]
        if still_open and self.is_alive():
            self._send(m.AbortRequests(still_open))

    async def abort(self, request_ids: list[str]) -> None:
        """Abort in the core; their streams end with a delta whose finish_reason is "abort"."""
        if request_ids and self.is_alive():
            self._send(m.AbortRequests(list(request_ids)))

    async def kv_report(self, timeout: float = 10.0) -> m.KvReport:
        """The core's KV cache, integrity-checked and counted between two steps; EngineDeadError if it is gone,
        asyncio.TimeoutError if it does not answer in time (a wedged core)."""
        if not self.is_alive():
            raise EngineDeadError(self._dead or "the engine is not running")
        query_id = next(self._query_ids)
        future = self._kv_queries[query_id] = asyncio.get_running_loop().create_future()
        try:
            self._send(m.KvQuery(query_id))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._kv_queries.pop(query_id, None)

    async def profile(self, start: bool, directory: str = "", timeout: float = 600.0) -> m.ProfileStatus:
        """Start or stop the core's torch profiler; one call at a time (an export can take a while).
        EngineDeadError if the core is gone, asyncio.TimeoutError if it does not answer in time."""
        async with self._profile_lock:
            if not self.is_alive():
                raise EngineDeadError(self._dead or "the engine is not running")
            self._profile_reply = asyncio.get_running_loop().create_future()
            try:
                self._send(m.ProfileControl(start=start, directory=directory))
                return await asyncio.wait_for(self._profile_reply, timeout)
            finally:
                self._profile_reply = None

    async def profiles(self, start: bool, directory: str = "",
                       timeout: float = 600.0) -> list[m.ProfileStatus | Exception]:
        """`profile` as DataParallelClient.profiles answers: one entry per core, its status or the error it gave."""
        try:
            return [await self.profile(start, directory, timeout)]
        except (EngineDeadError, asyncio.TimeoutError) as e:
            return [e]

    def _send(self, msg: m.ToCore) -> None:
        # Never awaited: the send goes out at once or queues in order, and a dead peer cannot block a
        # caller (its stream fails through the reader instead).
        self._input.send(self._encoder.encode(msg), copy=False)

    # -- shutdown -----------------------------------------------------------------------------
    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to exit, kill it after timeout, close the sockets, remove the ipc dir. Idempotent."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown(timeout))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, timeout: float) -> None:
        self._closing = True
        if self._proc.poll() is None:
            self._send(m.Shutdown())
            if not await _wait_exit(self._proc, timeout):
                logger.warning("the engine core did not exit within %.1f s; killing it", timeout)
                self._proc.kill()
                await _wait_exit(self._proc, 5.0)
        try:
            await asyncio.wait_for(self._reader, timeout=1.0)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            pass
        self._fail_all("the engine is shut down")
        self._input.close(linger=0)
        self._output.close(linger=0)
        if self._guard is not None:
            self._guard.stop()
        self._ctx.term()
        self._finalizer()
        self._stderr_pump.join(timeout=1.0)

    # -- the reader ---------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        try:
            while self._proc.poll() is None:
                if await self._output.poll(POLL_MS):
                    await self._dispatch_all()
            await self._dispatch_all()  # what it sent before it went
            self._die(f"the engine core exited with status {self._proc.returncode}")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a reader that stops silently would hang every stream
            logger.exception("engine output reader failed")
            self._die(f"engine output reader failed: {e}")

    async def _dispatch_all(self) -> None:
        """Every message waiting on the socket, in order, read without a future each; after each one the consumers it
        woke run (a step's outputs are taken before the next step's: a backlog is not mistaken for a slow reader)."""
        while True:
            try:
                raw = self._output_now.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._dispatch(raw)
            await asyncio.sleep(0)

    def _dispatch(self, raw: bytes) -> None:
        msg = self._decoder.decode(raw)
        if isinstance(msg, m.StepOutputs):
            for delta in msg.deltas:
                item = delta if delta.error is None else RequestError(delta.error)
                self._route(delta.request_id, item, delta.finish_reason is not None)
        elif isinstance(msg, m.EngineStats):
            self._on_stats(msg)
        elif isinstance(msg, m.KvReport):
            future = self._kv_queries.get(msg.query_id)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, m.Ready):
            self._stats_at = self._progress_at = time.monotonic()  # the heartbeat clock starts now
            if not self._ready.done():
                self._ready.set_result(msg)
        elif isinstance(msg, m.ProfileStatus):
            if self._profile_reply is not None and not self._profile_reply.done():
                self._profile_reply.set_result(msg)
        elif isinstance(msg, m.EngineDead):
            self._die(msg.message)

    def _route(self, request_id: str, item: RequestDelta | Exception, last: bool) -> None:
        sink = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if sink is None:  # already left by its consumer
            return
        try:
            sink(item)
        except Exception:  # a consumer's bug fails its request, not the reader that every stream needs
            logger.exception("the consumer of request %s failed", request_id)
            self.close([request_id])

    def _on_stats(self, stats: m.EngineStats) -> None:
        now = time.monotonic()
        if self.stats is None or stats.num_steps > self.stats.num_steps or not self._streams:
            self._progress_at = now
        self.stats = stats
        self._stats_at = now

    def _die(self, reason: str) -> None:
        """Fail every stream and run the death hooks, once; a deliberate shutdown runs no hooks."""
        if self._dead is not None:
            return
        self._dead = reason
        if self._closing:
            self._ready.cancel()  # a no-op once Ready came
        elif not self._ready.done():
            self._ready.set_exception(EngineDeadError(reason))
        self._fail_all(reason)
        if self._closing:
            return
        logger.error("engine core died: %s", reason)
        for hook in self.on_death:
            try:
                result = hook(reason)
                if inspect.isawaitable(result):
                    asyncio.ensure_future(result)
            except Exception:
                logger.exception("engine death hook failed")

    def _fail_all(self, reason: str) -> None:
        sinks, self._streams = list(self._streams.values()), {}
        for sink in sinks:
            sink(EngineDeadError(reason))
        if self._profile_reply is not None and not self._profile_reply.done():
            self._profile_reply.set_exception(EngineDeadError(reason))
        for future in self._kv_queries.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))


def joined_to_ray(config: EngineConfig) -> EngineConfig:
    """With a Ray backend: this process joins the cluster, and the config names its address, so that a core started
    from here (and its workers) join the same one; with Ray placing the replicas, it also says how many may share a
    node (each core sizes its KV pool from its node's memory, shared with only those)."""
    if not config.parallel.on_ray:
        return config
    parallel = dataclasses.replace(config.parallel, ray_address=ray_cluster.connect(config.parallel.ray_address))
    if parallel.data_parallel_backend == "ray" and parallel.replicas_on_host is None:
        parallel = dataclasses.replace(parallel, replicas_on_host=ray_cluster.replicas_on_a_node(config))
    return config.replace(parallel=parallel)


def _bind(sock: zmq.Socket, ipc_dir: str, name: str, guard: Guard | None) -> str:
    """Bind a socket for the core to connect to: a file in the private ipc dir, or for a core on a Ray node (guard),
    a TCP port on this node's address (any free one), CURVE-secured. Returns the address."""
    if guard is None:
        sock.bind(f"ipc://{ipc_dir}/{name}")
        return f"ipc://{ipc_dir}/{name}"
    guard.serve(sock)
    sock.bind(f"tcp://{ray_cluster.node_address()}:*")
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def _spawn(config: EngineConfig, input_address: str, output_address: str, fault: str | None,
           log_format: str = "text", guard: Guard | None = None) -> subprocess.Popen | ray_cluster.RayProcess:
    """Start the core with a plain command line (nothing pickled), by the file path of core_launch.py: locally
    our own, so it imports this very banyan package (never one in the working directory) and dies with us; with
    --data-parallel-backend ray, its node's, run by an actor that Ray places (the core dies with the actor, the
    actor with us)."""
    args = ["--config-json", msgspec.json.encode(config).decode(), "--input", input_address, "--output",
            output_address, "--log-format", log_format] + (["--fault", fault] if fault else [])  # fmt: skip
    if config.parallel.data_parallel_backend == "ray":
        return ray_cluster.RayProcess(args, ray_cluster.core_options(config), guard.env)
    cmd = [sys.executable, str(Path(core_launch.__file__).resolve()), "--parent-pid", str(os.getpid()), *args]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _pump_stderr(proc: subprocess.Popen, tail: collections.deque) -> None:
    """Forward the core's log lines to ours, keeping the last few for error messages."""
    if proc.stderr is None:  # a core on a Ray node: Ray forwards its lines
        return
    for raw in proc.stderr:
        line = raw.decode(errors="replace")
        tail.append(line)
        try:
            sys.stderr.write(line)
        except (ValueError, OSError):  # our stderr closed at interpreter exit
            pass
    proc.stderr.close()


async def _wait_exit(proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def _reap(proc: subprocess.Popen, ipc_dir: str) -> None:
    """Last resort (shutdown not called, interpreter exiting): no orphan core, no stale sockets."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(ipc_dir, ignore_errors=True)
