"""Ray placement (`pip install 'banyan[ray]'`): engine cores and tensor/pipeline-parallel workers on the nodes of a
Ray cluster instead of local subprocesses (vLLM's flags: --data-parallel-backend ray,
--distributed-executor-backend ray).

    API server (or engine core)                       a node of the Ray cluster
    RayProcess(args, resources) ──── Ray ────►  ProcessHost actor ── starts ──► python core_launch.py ARGS
      .poll() .wait() .kill()   ◄── the actor's end: its exit status, or      --parent-pid <the actor>
                                    LOST when its node or actor died
    ZeroMQ / gloo over TCP on the node's address ◄──────────────────────────────► the same sockets as locally

Ray only places and supervises processes. What a process runs (the same command line as a local one) and how it
talks (msgspec frames over ZeroMQ, gloo collectives) do not change; its addresses are tcp:// on the node's IP
instead of ipc:// files and 127.0.0.1. So the engine client, the data-parallel router and the workers keep one code
path each, and a RayProcess stands where a subprocess.Popen stood. Nothing here imports ray until it is used:
`import banyan` and the server stay free of it.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

from banyan.config import RAY_CLIENT_REFUSED, EngineConfig
from banyan.errors import InvalidParameterError, WorkerError

CORE_LAUNCH = Path(__file__).resolve().parents[1] / "ipc" / "core_launch.py"  # by path: distributed never imports ipc
logger = logging.getLogger(__name__)

LOST = -9  # the returncode of a process whose actor or node died (as if SIGKILLed)
LOG_TAIL_LINES = 40
PLACEMENTS = 3  # tries to place a process whose actor is lost before it started it (put on a node going away)


def connect(address: str | None = None) -> str:
    """Join the Ray cluster whose GCS is at `address` (host:port; None: $RAY_ADDRESS, or else a one-node Ray started
    here), once per process. Returns the cluster's GCS address, for the processes started from here to join.
    InvalidParameterError for a ray:// (Ray Client) address, from the setting or $RAY_ADDRESS (RAY_CLIENT_REFUSED)."""
    if (address or os.environ.get("RAY_ADDRESS", "")).startswith("ray://"):
        raise InvalidParameterError("ray_address" if address else "RAY_ADDRESS", RAY_CLIENT_REFUSED)
    import ray

    if not ray.is_initialized():
        ray.init(address=address or None, log_to_driver=True)
    return ray.get_runtime_context().gcs_address


def node_address() -> str:
    """This node's IP address in the cluster: what the sockets others connect to bind to."""
    import ray

    return ray.util.get_node_ip_address()


class RayProcess:
    """`python core_launch.py ARGS` run by a ProcessHost actor somewhere Ray finds `options` (num_cpus, num_gpus,
    scheduling_strategy), handled as a subprocess.Popen: poll, wait, kill, returncode, pid. A node that dies is
    known as soon as Ray knows (at once when its processes end; a machine that vanishes, after the cluster's
    health checks); its process's returncode is then LOST. Ray never restarts the actor: whoever started the
    process starts a new one (the data-parallel client does, as for a local core). Only an actor lost before its
    process started (Ray placed it on a node that was going away) is placed again, up to PLACEMENTS times."""

    stderr = None  # the log lines go to the actor's log, which Ray forwards to the driver's stderr

    def __init__(self, args: list[str], options: dict, env: dict[str, str] | None = None):
        import ray

        self.args, self.options, self.env, self.returncode = list(args), options, env or {}, None
        self._ray = ray
        self._placements = 0
        self._place()

    def _place(self) -> None:
        self._placements += 1
        self._actor = _host_class().options(max_restarts=0, max_concurrency=3, **self.options).remote(self.args, self.env)
        self._done = self._actor.wait.remote()
        self._pid = self._actor.pid.remote()

    def poll(self) -> int | None:
        return self.wait(0) if self._finished(0) else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._finished(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        if self.returncode is None:
            try:
                self.returncode = self._ray.get(self._done)
            except self._ray.exceptions.RayError:  # the actor or its node died
                self.returncode = LOST
            self.kill()  # the actor's resources go back to the cluster now, not when its handle is collected
        return self.returncode

    def _finished(self, timeout: float | None) -> bool:
        if self.returncode is None and not self._ray.is_initialized():  # this process left Ray: its actors ended
            self.returncode = LOST
        if self.returncode is not None:
            return True
        while self._ray.wait([self._done], timeout=timeout)[0]:
            if self._placements >= PLACEMENTS or self.pid or not self._actor_lost():
                return True
            logger.warning("Ray lost the actor before it started its process (placed on a node going away?); "
                           "placing it again (%d of %d)", self._placements + 1, PLACEMENTS)
            self._place()
        return False

    def _actor_lost(self) -> bool:
        try:
            self._ray.get(self._done)
        except self._ray.exceptions.RayError:
            return True
        return False

    def kill(self) -> None:
        """End the actor (its process dies with it) and let Ray release its resources."""
        if self._ray.is_initialized():
            self._ray.kill(self._actor, no_restart=True)

    @property
    def pid(self) -> int:
        """The process's pid on its node (0 until the actor has started it)."""
        try:
            return self._ray.get(self._pid, timeout=0) if self._ray.wait([self._pid], timeout=0)[0] else 0
        except (self._ray.exceptions.RayError, ValueError):  # ValueError: this process left Ray
            return 0

    def node_id(self, timeout: float = 60.0) -> str:
        """The id of the Ray node it runs on (waits for the actor to be placed)."""
        return self._ray.get(self._actor.node_id.remote(), timeout=timeout)

    def log_tail(self) -> str:
        """The process's last log lines; or why there are none (not placed yet: what it asks for and what is free)."""
        try:
            return self._ray.get(self._actor.log_tail.remote(), timeout=2)
        except self._ray.exceptions.GetTimeoutError:
            return (f"(Ray has not started it: it asks {self.options}; the cluster has "
                    f"{self._ray.available_resources()} free)\n")
        except self._ray.exceptions.RayError as e:
            return f"(its Ray actor is gone: {type(e).__name__})\n"


class ProcessHost:
    """The Ray actor behind a RayProcess: starts this node's banyan by file path with `--parent-pid` its own pid, so
    the process dies with the actor (core_launch.py ties it before anything slow), and keeps its last log lines.
    `env`: added to the process's environment (its socket keys, distributed/curve.py)."""

    def __init__(self, args: list[str], env: dict[str, str]):
        cmd = [sys.executable, str(CORE_LAUNCH), *args, "--parent-pid", str(os.getpid())]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env={**os.environ, **env})
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            self.tail.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    def wait(self) -> int:
        return self.proc.wait()

    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self) -> str:
        return "".join(self.tail)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


@functools.lru_cache(maxsize=1)
def _host_class():
    import ray

    return ray.remote(ProcessHost)


def resources(on_gpu: bool, num_threads: int | None, ranks: int = 1) -> dict:
    """Actor options for a process that runs `ranks` model ranks: one GPU per rank, or the CPUs their threads use
    (num_threads each; 1 when it is unset, and the process then uses every core of its node)."""
    return {"num_cpus": 1, "num_gpus": ranks} if on_gpu else {"num_cpus": (num_threads or 1) * ranks}


def core_options(config: EngineConfig) -> dict:
    """Where an engine core may run: spread over the nodes, with its ranks' resources (only rank 0's when its
    workers are Ray actors of their own); on GPUs when the device says so, or when it is auto and the cluster has
    some."""
    import ray

    parallel, device = config.parallel, config.model.device
    local_ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    ranks = 1 if parallel.distributed_executor_backend == "ray" else local_ranks
    on_gpu = device.startswith("cuda") or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    return {**resources(on_gpu, config.model.num_threads, ranks), "scheduling_strategy": "SPREAD"}  # one per node


def replicas_on_a_node(config: EngineConfig) -> int:
    """The most engine cores of `config`'s data_parallel_size that Ray may put on one node of the cluster now (what
    each core's KV pool shares that node's memory with: ParallelConfig.pools_on_host)."""
    import ray

    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    return replicas_per_node(config.parallel.data_parallel_size, nodes, as_bundle(core_options(config)))


def replicas_per_node(replicas: int, nodes: list[dict], need: dict) -> int:
    """How many of `replicas` cores, each needing the resources `need`, SPREAD puts on the fullest node: one on each
    node with room, then again round the nodes with room left (nodes: each node's total resources). Cores beyond
    what the nodes hold wait for room; counted as on the fullest node too, where they may land. At least 1.

        need {"CPU": 2}, nodes of 8, 2 and 0 CPUs (room for 4, 1, 0), 5 replicas:
            round 1: 1 1 0   round 2: 2 1 0   round 3: 3 1 0   round 4: 4 1 0   -> 4
    """
    room = [min(int(node.get(name, 0) // amount) for name, amount in need.items() if amount) for node in nodes]
    placed = [0] * len(room)
    left = replicas
    while left and any(p < r for p, r in zip(placed, room)):
        for i in range(len(room)):
            if left and placed[i] < room[i]:
                placed[i], left = placed[i] + 1, left - 1
    return max(1, max(placed, default=0) + left)


def ranks_sharing_node(nodes: list[str]) -> list[int]:
    """For each rank, the ranks on its node, itself included (nodes[r]: rank r's node id)."""
    counts = collections.Counter(nodes)
    return [counts[node] for node in nodes]


def rank_nodes(group) -> list[str]:
    """The node of each rank of a tensor/pipeline group: rank 0 is this process, rank r runs in bundle r-1 of the
    placement group."""
    import ray
    from ray.util import placement_group_table

    bundles = placement_group_table(group)["bundles_to_node_id"]
    return [ray.get_runtime_context().get_node_id()] + [bundles[i] for i in range(len(bundles))]


def as_bundle(options: dict) -> dict:
    """The same resources as a placement-group bundle."""
    return {"CPU": options["num_cpus"], **({"GPU": options["num_gpus"]} if options.get("num_gpus") else {})}


def place(bundles: list[dict], timeout: float):
    """A placement group of `bundles` (one per worker, as close together as the cluster allows: PACK), once Ray has
    reserved them all; WorkerError naming what was asked and what is free if it cannot within `timeout` seconds."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(bundles, strategy="PACK")
    if not ray.wait([group.ready()], timeout=timeout)[0]:
        remove_placement_group(group)
        raise WorkerError(f"Ray could not place {len(bundles)} workers ({bundles[0]} each) in {timeout:g} s; the "
                          f"cluster has {ray.available_resources()} free")
    return group


def in_bundle(group, index: int) -> dict:
    """Actor options that run it in bundle `index` of the placement group."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)}


def release(group) -> None:
    """Give the placement group's resources back (a no-op once this process has left Ray: Ray freed them then)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    if ray.is_initialized():
        remove_placement_group(group)
