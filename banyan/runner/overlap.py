"""A step split in two for async scheduling: launched (queued up to the logits), then sampled with its ids left on the
device (engine/overlap.py drives it; scheduler/overlap.py keeps the requests' side).

    engine step N+1:  schedule N+1 -> launch N+1 (its placeholders <- N's ids, on the device) -> read N's ids
                      -> settle N (stop checks) -> sample N+1, ids left on the device (PendingIds)
    device:           ... sample N | gather, forward N+1, logits | sample N+1 | gather, forward N+2 ...

The device never waits for the host while the host has the next step to prepare; the host waits once a step, for
the ids it needs (the one counted read, runner/host_reads.py). On CUDA the ids are copied into pinned host memory
with non_blocking=True and an event recorded after the copy, so that the read is the event's wait and a copy of a
few bytes already done; on a CPU there is nothing to wait for and the tensor itself is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from banyan.forward_batch import to_device
from banyan.request import PENDING_TOKEN
from banyan.runner.logits_plan import LogitsPlan
from banyan.scheduler.batch import Batch, StepResult


@dataclass
class LaunchedStep:
    """A step queued on the device up to its logits; ModelRunner.finish samples it."""

    plan: LogitsPlan
    hidden: torch.Tensor  # [num_tokens, hidden]
    logits: torch.Tensor  # [num_logits, vocab] fp32
    drafting: list = field(default_factory=list)  # requests whose drafts a network made in the step
    draft_seconds: float = 0.0


class KeepIds:
    """A ToHost (layers/sampler.py) for a step whose sampled ids stay on the device: it keeps the tensor and reads
    nothing. Only the ids may come through it (async scheduling leaves steps with logprobs synchronous)."""

    def __init__(self):
        self.tensor: torch.Tensor | None = None

    def __call__(self, tensor: torch.Tensor, what: str) -> list:
        if what != "sampled ids":
            raise RuntimeError(f"async scheduling: {what} would be read in a step whose ids stay on the device")
        self.tensor = tensor
        return [None] * tensor.shape[0]  # filled in by PendingIds.read


class PendingIds:
    """A sampled step whose ids are on the device: the next step's placeholders gather from them there (fill), and
    read() waits for them once, on the host."""

    def __init__(self, ids: torch.Tensor, result: StepResult, pinned: torch.Tensor | None):
        """ids: [rows] sampled ids on the device, row i for the i-th request in result.sampled (whose token_ids
        are None until read). pinned: a host buffer of at least `rows` ids on CUDA, free until read() is done."""
        self.ids = ids
        self.result = result
        self.row_of = {request_id: row for row, request_id in enumerate(result.sampled)}
        self.event = None
        if pinned is None:
            self.host = ids
        else:
            self.host = pinned[: ids.shape[0]]
            self.host.copy_(ids, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def fill(self, input_ids: torch.Tensor, batch: Batch) -> None:
        """Each input row of `batch` that holds a PENDING_TOKEN of this step's requests takes its sampled id, on the
        device (queued before the forward; no read). A placeholder is always its request's last token:

            rows of one request:  [ start ... end - 1 ]      all_token_ids[end - 1] == PENDING_TOKEN
        """
        dst, src, row, row_of = [], [], 0, self.row_of
        for item in batch.scheduled:
            row += item.num_new_tokens
            source = row_of.get(item.request.request_id)
            if source is not None and item.request.all_token_ids[item.end - 1] == PENDING_TOKEN:
                dst.append(row - 1)
                src.append(source)
        if dst:
            device = input_ids.device
            input_ids[to_device(dst, torch.long, device)] = self.ids[to_device(src, torch.long, device)]

    def read(self, to_host) -> StepResult:
        """The step's result with its tokens, after the one wait for them (counted by `to_host`)."""
        if self.event is not None:
            self.event.synchronize()
        for sampled, token_id in zip(self.result.sampled.values(), to_host(self.host, "sampled ids")):
            sampled.token_id = token_id
        return self.result
