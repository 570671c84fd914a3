"""The collectives tensor parallelism needs, over a torch.distributed process group object held here (no
global default group, so several engines can live in one process): gloo on CPU, NCCL on CUDA, one code path.

Two groups share one TCP store (rank 0 hosts it; the others reach it on 127.0.0.1, or on rank 0's node address when
they are Ray actors on other nodes, where gloo also listens on each rank's node address):
    startup   every rank loads its shard at its own pace: a long timeout (rendezvous, KV pool agreement)
    step      the collectives inside a forward: `timeout` seconds, after which a rank waiting on a dead or
              hung peer raises instead of hanging (WorkerError at rank 0)
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

STARTUP_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class TPGroup:
    """This process's place in a tensor-parallel group and the groups to talk over."""

    rank: int
    size: int
    step: object  # ProcessGroupGloo | ProcessGroupNCCL: the forward's collectives
    startup: object  # ProcessGroupGloo on the CPU: start-up agreement
    store: object  # the TCPStore (rank 0 hosts it; kept alive as long as the group)
    device: torch.device = torch.device("cpu")
    timeout: float = 60.0
    address: str | None = None  # where gloo listens (a Ray node's IP); None: gloo's default, the hostname's

    @staticmethod
    def host_store(size: int):
        """Rank 0's TCP store on 127.0.0.1, on a free port (its `.port`)."""
        return dist.TCPStore("127.0.0.1", 0, size, True, timeout=STARTUP_TIMEOUT, wait_for_workers=False)

    @staticmethod
    def connect_store(host: str, port: int, size: int):
        return dist.TCPStore(host, port, size, False, timeout=STARTUP_TIMEOUT)

    @classmethod
    def over(cls, store, rank: int, size: int, device: torch.device, timeout: float,
             address: str | None = None) -> TPGroup:
        startup = _gloo(dist.PrefixStore("startup", store), rank, size, STARTUP_TIMEOUT, address)
        step_timeout = datetime.timedelta(seconds=timeout)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = step_timeout
            step = dist.ProcessGroupNCCL(dist.PrefixStore("step", store), rank, size, options)
        else:
            step = _gloo(dist.PrefixStore("step", store), rank, size, step_timeout, address)
        return cls(rank, size, step, startup, store, device, timeout, address)

    def subgroup(self, name: str, rank: int, size: int) -> TPGroup:
        """A group of some of these ranks (every member calls this at once), under its own name in the store."""
        return TPGroup.over(dist.PrefixStore(name, self.store), rank, size, self.device, self.timeout, self.address)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        self.step.allreduce([tensor]).wait()
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape everywhere) at rank 0, in rank order; None elsewhere."""
        tensor = tensor.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(tensor) for _ in range(self.size)]
            self.step.gather([parts], [tensor], options).wait()
            return parts
        self.step.gather([], [tensor], options).wait()
        return None

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0):
        """Send without waiting (the caller keeps the tensor and waits on the returned work)."""
        return self.step.send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        self.step.recv([tensor], src, tag).wait()
        return tensor

    def agree_min(self, value: int) -> int:
        """The smallest `value` over ranks (each rank's KV pool must hold the same pages)."""
        t = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.startup.allreduce([t], options).wait()
        return int(t.item())


def _gloo(store, rank: int, size: int, timeout: datetime.timedelta, address: str | None):
    """A gloo group listening on `address` (None: on the address of this machine's hostname, gloo's default)."""
    if address is None:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, size, options)


def address_towards(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent: a UDP socket only picks its source)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]
