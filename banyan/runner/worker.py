"""Tensor-parallel and pipeline workers: ranks 1..N-1 of a group whose rank 0 is the engine's own runner.

    engine process (rank 0: ParallelRunner)              worker processes (ranks 1..N-1)
    schedule -> Batch -> ForwardBatch ──── publish ────►  the same ForwardBatch, unpacked
    forward: one all-reduce after attention, ◄─ gloo ─►  forward, its shard of every layer
             one after the MLP                 / NCCL
    logits: vocabulary columns gathered ◄──── gather ──  compute_logits over the same rows
    sample, grammars, scheduler update

(Pipeline parallel, distributed/pipeline.py: the same frames; each rank runs its layers on the hidden states the
rank before sends it, micro-batch by micro-batch, and the last sends them back to rank 0.)

The scheduler, the KV accounting, sampling and grammars stay with rank 0; a worker holds its shard of the
weights (or its layers) and its part of the KV of the same pages. Each forward's ForwardBatch goes out once: one frame on a ZeroMQ
PUB socket every worker subscribes to (a header and int64 arrays, never pickle). Rank 0 publishes a frame for
every `_forward` and then computes logits over its `logits_indices` once; a worker does the same, so the
collectives pair up. Waiting for the next frame has no timeout (an engine may idle for hours); every
collective inside a forward has `distributed_timeout`.

Failure: a worker that exits is seen before the next publish (its process polled) or in a collective
(connection closed); one that hangs makes rank 0's collective time out. Either way the step raises WorkerError:
`LLM` raises it, the engine core dies with it (in-flight requests get an error, the server exits non-zero), and
the workers are killed and reaped. Workers start through ipc/core_launch.py --worker, so they die with the
engine process from their first moment (PR_SET_PDEATHSIG), whatever ends it. With --distributed-executor-backend ray
the same command runs in a Ray actor on some node of a placement group, over TCP on the nodes' addresses
(distributed/ray_cluster.py), and dies with that actor.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import msgspec
import numpy as np
import torch
import zmq

from banyan.config import CacheConfig, ModelConfig, ParallelConfig
from banyan.distributed import ray_cluster
from banyan.distributed.collectives import STARTUP_TIMEOUT, TPGroup, address_towards
from banyan.distributed.curve import Guard, secure_connect
from banyan.distributed.pipeline import Pipeline, check_stages
from banyan.distributed.tensor_parallel import TensorParallel, check_sizes
from banyan.errors import InvalidParameterError, WorkerError
from banyan.forward_batch import ForwardBatch
from banyan.runner.device import resolve_device
from banyan.runner.model_runner import ModelRunner, RunnerLimits
from banyan.runner.weights import open_model

logger = logging.getLogger(__name__)

CORE_LAUNCH = Path(__file__).resolve().parents[1] / "ipc" / "core_launch.py"  # by path: no import of ipc here
STOP, FORWARD = 0, 1
SUBSCRIBE_TIMEOUT = 300.0  # seconds for every worker to import torch and subscribe
STOP_GRACE = 2.0  # seconds a worker has to leave after STOP before it is killed


def runner_factory(parallel: ParallelConfig, factory):
    """The engine's runner factory: `factory` itself, or with tensor_parallel_size or pipeline_parallel_size > 1 a
    ParallelRunner (when the factory is the plain ModelRunner; a benchmark's double stays as it is)."""
    if group_size(parallel) == 1 or factory is not ModelRunner:
        return factory
    return functools.partial(ParallelRunner, parallel=parallel)


def group_size(parallel: ParallelConfig) -> int:
    return parallel.tensor_parallel_size * parallel.pipeline_parallel_size


def placement(parallel: ParallelConfig, group: TPGroup, arch) -> TensorParallel | Pipeline:
    """This rank's part: a tensor-parallel shard, a pipeline stage, or a shard of a stage (rank = stage * T + t;
    each stage's T ranks form their own tensor-parallel group)."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if pp == 1:
        return TensorParallel(group, arch)
    stage, t = divmod(group.rank, tp)
    shard = TensorParallel(group.subgroup(f"stage{stage}", t, tp), arch) if tp > 1 else None
    return Pipeline(group, arch, pp, shard, parallel.pipeline_micro_batches)


class ParallelRunner(ModelRunner):
    """Rank 0: a ModelRunner over its shard (or stage) that starts the other ranks and publishes each forward."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, source, limits: RunnerLimits,
                 lora_config=None, *, parallel: ParallelConfig, pools_on_host: int = 1):
        if lora_config is not None:
            raise InvalidParameterError("tensor_parallel_size", "LoRA adapters run in one process (tensor and "
                                        "pipeline parallel size 1) only")
        check_sizes(source.arch, parallel.tensor_parallel_size)
        check_stages(source.arch, parallel.pipeline_parallel_size)
        self.workers = Workers(WorkerSpec(0, group_size(parallel), 0, "", model_config, cache_config, limits,
                                          parallel), resolve_device(model_config.device))
        try:
            if self.workers.ranks_here is not None:  # Ray placed the ranks: only those on this node share it
                pools_on_host = parallel.pools_on_host(self.workers.ranks_here[0])
            super().__init__(model_config, cache_config, source, limits, pools_on_host=pools_on_host,
                             parallel=placement(parallel, self.workers.group, source.arch))
        except RuntimeError as e:  # a worker failed while loading: the agreement on the KV pool saw it
            raise self.workers.failure(e) from e
        except BaseException:
            self.workers.close()
            raise

    def _forward(self, fb: ForwardBatch, *args) -> torch.Tensor:
        self.workers.publish(encode_step(fb))
        try:
            return super()._forward(fb, *args)
        except RuntimeError as e:
            raise self.workers.failure(e) from e

    def execute(self, batch):
        try:
            return super().execute(batch)
        except RuntimeError as e:  # the logits' gather
            raise self.workers.failure(e) from e

    def use_layer_skip(self, num_layers: int) -> None:
        raise InvalidParameterError("speculative_config", "layer_skip drafts with the model in one process: it needs "
                                    "tensor_parallel_size 1")

    def close(self) -> None:
        self.workers.close()


class WorkerSpec(msgspec.Struct):
    """What one worker needs to build its shard and find the others (sent as JSON on its command line)."""

    rank: int
    size: int
    port: int  # the TCP store rank 0 hosts on 127.0.0.1
    steps: str  # the PUB socket's address
    model: ModelConfig
    cache: CacheConfig
    limits: RunnerLimits
    parallel: ParallelConfig
    host: str = "127.0.0.1"  # rank 0's address (its node's with --distributed-executor-backend ray)
    ranks_here: int | None = None  # ranks on this rank's node, Ray placing them (None: every rank, local processes)


class Workers:
    """Rank 0's side: start ranks 1..N-1, publish forwards to them, notice their death, stop them."""

    def __init__(self, spec: WorkerSpec, device: torch.device):
        self.size, self.timeout = spec.size, spec.parallel.distributed_timeout
        on_ray = spec.parallel.distributed_executor_backend == "ray"
        options, self.ray_group = _ray_placement(spec, device) if on_ray else (None, None)
        # Ray may put ranks on other nodes: each rank's KV pool shares its node with the ranks there only
        self.ranks_here = ray_cluster.ranks_sharing_node(ray_cluster.rank_nodes(self.ray_group)) if on_ray else None
        self.dir = tempfile.mkdtemp(prefix="banyan-tp-")  # mode 0700
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per worker, duplicates too
        self.pub.setsockopt(zmq.SNDHWM, 0)  # never drop a frame for a slow worker
        host = ray_cluster.node_address() if on_ray else "127.0.0.1"
        self.guard = Guard(self.context) if on_ray else None  # TCP between nodes: CURVE (distributed/curve.py)
        if self.guard is not None:
            self.guard.serve(self.pub)
        self.pub.bind(f"tcp://{host}:*" if on_ray else f"ipc://{self.dir}/steps")
        store = TPGroup.host_store(spec.size)
        spec = msgspec.structs.replace(spec, host=host, port=store.port,
                                       steps=self.pub.getsockopt(zmq.LAST_ENDPOINT).decode())
        here = self.ranks_here or [None] * spec.size
        self.procs = [_spawn(msgspec.structs.replace(spec, rank=rank, ranks_here=here[rank]), self.ray_group, options,
                             self.guard) for rank in range(1, spec.size)]
        self._finalizer = weakref.finalize(self, _reap, self.procs, self.pub, self.context, self.dir, self.ray_group,
                                           self.guard)
        try:
            self._await_subscriptions()
            self.group = TPGroup.over(store, 0, spec.size, device, spec.parallel.distributed_timeout,
                                      host if on_ray else None)
        except BaseException:
            self.close()
            raise

    def _await_subscriptions(self) -> None:
        deadline, subscribed = time.monotonic() + SUBSCRIBE_TIMEOUT, 0
        while subscribed < len(self.procs):
            self._check_alive()
            if time.monotonic() > deadline:
                raise WorkerError(f"tensor-parallel workers not started after {SUBSCRIBE_TIMEOUT:.0f} s")
            if self.pub.poll(100):
                subscribed += self.pub.recv()[:1] == b"\x01"

    def publish(self, frame: bytes) -> None:
        self._check_alive()
        self.pub.send(frame, copy=False)

    def _check_alive(self) -> None:
        dead = self._dead()
        if dead:
            raise self.failure(None)

    def _dead(self) -> list[str]:
        return [f"rank {rank} (exit status {proc.returncode})"
                for rank, proc in enumerate(self.procs, 1) if proc.poll() is not None]

    def failure(self, error: BaseException | None) -> WorkerError:
        """The error the step raises; the workers are stopped (a hung one killed) before it propagates."""
        time.sleep(0.05)  # a worker that just crashed: let its exit status arrive
        dead = self._dead()
        if dead:
            message = f"tensor-parallel worker {', '.join(dead)} died"
        else:
            message = (f"a collective between tensor-parallel workers failed or waited past --distributed-timeout "
                       f"({self.timeout:g} s): a worker hung ({error})")
        logger.error("%s; stopping the workers", message)
        self.close()
        return WorkerError(message)

    def close(self) -> None:
        """Stop every worker (STOP, then a kill after STOP_GRACE) and reap it; idempotent."""
        self._finalizer()


def _reap(procs: list, pub: zmq.Socket, context: zmq.Context, directory: str, ray_group=None, guard=None) -> None:
    if any(proc.poll() is None for proc in procs):
        try:
            pub.send(encode_stop(), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    deadline = time.monotonic() + STOP_GRACE
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    pub.close(linger=0)
    if guard is not None:
        guard.stop()
    context.term()
    shutil.rmtree(directory, ignore_errors=True)
    if ray_group is not None:
        ray_cluster.release(ray_group)


def _spawn(spec: WorkerSpec, ray_group=None, ray_options: dict | None = None, guard: Guard | None = None):
    """By the file path of our own core_launch.py (this banyan, never one in the working directory); its log
    lines go to our stderr. With --distributed-executor-backend ray: the same command in the rank's bundle of the
    placement group, by its node's banyan, dying with the actor that runs it (ray_cluster.RayProcess)."""
    args = ["--worker", "--spec-json", msgspec.json.encode(spec).decode()]
    if ray_group is not None:
        return ray_cluster.RayProcess(args, {**ray_options, **ray_cluster.in_bundle(ray_group, spec.rank - 1)},
                                      guard.env)
    cmd = [sys.executable, str(CORE_LAUNCH), "--parent-pid", str(os.getpid()), *args]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def _ray_placement(spec: WorkerSpec, device: torch.device) -> tuple[dict, object]:
    """A rank's actor options (one GPU, or its threads' CPUs) and a placement group with a bundle of them for each
    of ranks 1..N-1, once this process has joined the cluster."""
    ray_cluster.connect(spec.parallel.ray_address)
    options = ray_cluster.resources(device.type == "cuda", spec.model.num_threads)
    return options, ray_cluster.place([ray_cluster.as_bundle(options)] * (spec.size - 1), SUBSCRIBE_TIMEOUT)


# -- the frame: one forward ------------------------------------------------------------------------
#   int64: | kind | T | S | W | L | page_size | input_ids[T] | positions[T] | slots[T] | query_start[S+1] |
#          | seq_lens[S] | block_tables[S*W] | logits_indices[L] |
_HEADER = 6


def encode_step(fb: ForwardBatch) -> bytes:
    parts = [fb.input_ids, fb.positions, fb.slot_mapping, fb.query_start_loc, fb.seq_lens, fb.block_tables.flatten(),
             fb.logits_indices]
    header = [FORWARD, fb.num_tokens, fb.num_seqs, fb.block_tables.shape[1], fb.logits_indices.numel(), fb.page_size]
    arrays = [np.asarray(header, dtype=np.int64)] + [p.to("cpu", torch.int64).numpy() for p in parts]
    return np.concatenate(arrays).tobytes()


def encode_stop() -> bytes:
    return np.zeros(_HEADER, dtype=np.int64).tobytes()


def decode_step(frame: bytes, device: torch.device) -> ForwardBatch | None:
    """The ForwardBatch of a FORWARD frame; None for STOP."""
    data = np.frombuffer(frame, dtype=np.int64)
    kind, T, S, W, L, page_size = (int(x) for x in data[:_HEADER])
    if kind == STOP:
        return None
    sizes = [T, T, T, S + 1, S, S * W, L]
    ids, positions, slots, query_start, seq_lens, tables, logits = np.split(data[_HEADER:], np.cumsum(sizes)[:-1])

    def tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a.copy()).to(device=device, dtype=dtype)

    context_lens = seq_lens.tolist()
    return ForwardBatch(
        input_ids=tensor(ids, torch.long),
        positions=tensor(positions, torch.long),
        slot_mapping=tensor(slots, torch.long),
        query_start_loc=tensor(query_start, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        block_tables=tensor(tables, torch.int32).view(S, W),
        logits_indices=tensor(logits, torch.long),
        query_lens=np.diff(query_start).tolist(),
        context_lens=context_lens,
        page_size=page_size,
    )


# -- the worker process ------------------------------------------------------------------------------
class WorkerFault:
    """Tests only (ParallelConfig.worker_fault, on rank 1): hang-at-step=N sleeps before the N-th forward (a
    collective that never completes), exit-at-step=N exits with status 3 there (a worker that dies)."""

    def __init__(self, spec: str):
        name, _, value = spec.partition("=")
        if name not in ("hang-at-step", "exit-at-step"):
            raise ValueError(f"unknown worker fault {spec!r}")
        self.kind, self.step, self.num_steps = name, int(value), 0

    def __call__(self) -> None:
        self.num_steps += 1
        if self.num_steps != self.step:
            return
        logger.warning("injected fault: %s at forward %d", self.kind, self.step)
        if self.kind == "exit-at-step":
            os._exit(3)
        time.sleep(STARTUP_TIMEOUT.total_seconds())


@torch.inference_mode()
def serve(runner: ModelRunner, steps: zmq.Socket, fault: WorkerFault | None = None) -> None:
    """Run each published forward (tensor parallel: and its logits, for the gather; pipeline: this stage) until STOP."""
    while (fb := decode_step(steps.recv(), runner.device)) is not None:
        if fault is not None:
            fault()
        runner.parallel.worker_step(runner, fb)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="banyan tensor-parallel worker (started by the engine)")
    parser.add_argument("--spec-json", required=True)
    parser.add_argument("--parent-pid", type=int)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args(argv)
    spec = msgspec.json.decode(args.spec_json, type=WorkerSpec)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-worker-{spec.rank} %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine ends us (STOP, or its death)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    context = zmq.Context()
    steps = context.socket(zmq.SUB)
    steps.setsockopt(zmq.RCVHWM, 0)
    secure_connect(steps, spec.steps)  # over TCP (a rank Ray placed), with the keys in our environment
    steps.setsockopt(zmq.SUBSCRIBE, b"")
    device = resolve_device(spec.model.device)
    if device.type == "cuda":
        torch.cuda.set_device(spec.rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    on_ray = spec.parallel.distributed_executor_backend == "ray"
    group = TPGroup.over(TPGroup.connect_store(spec.host, spec.port, spec.size), spec.rank, spec.size, device,
                         spec.parallel.distributed_timeout, address_towards(spec.host) if on_ray else None)
    source = open_model(spec.model.model, spec.model.trust_remote_code, spec.model.tokenizer)
    part = placement(spec.parallel, group, source.arch)
    runner = ModelRunner(spec.model, spec.cache, source, spec.limits, parallel=part,
                         pools_on_host=spec.parallel.pools_on_host(spec.ranks_here))
    fault = WorkerFault(spec.parallel.worker_fault) if spec.parallel.worker_fault and spec.rank == 1 else None
    serve(runner, steps, fault)
    steps.close(linger=0)
    context.term()
    return 0
