"""Every device->host read of a step goes through one call, so that the step's waits are few, known and counted.

A GPU runs the step's kernels while the host goes on; a read (`.tolist()`, `.item()`, `.cpu()`, `bool(t)`) makes
the host wait until everything queued before it has run. Between schedule and sample a step needs none: the
batch is built from host lists (ForwardBatch keeps host copies of the lengths), attention and the sampler run on
the device. The one read every sampling step makes is the sampled ids:

    schedule -> prepare (host lists -> device) -> forward -> logits -> sample -> to_host(ids) -> update
                                                                                  ^ the one wait
    then, only for requests that ask: to_host(logprobs), to_host(prompt logprobs), after the ids

Legitimate further reads: a speculative step's verified tokens (spec/verify.py), an embedding request's pooled
vector (layers/pooler.py), a drafter's draft tokens (runner/drafter.py), and CPU-only checks on host tensors.
tests/unit/test_host_reads.py counts every read of a step on a CPU through a torch function mode.
"""

from __future__ import annotations

import torch


class HostReads:
    """A ToHost (layers/sampler.py) that keeps what each read of the current step was for, in order."""

    def __init__(self):
        self.step: list[str] = []  # this step's reads, e.g. ["sampled ids", "logprobs"]

    def new_step(self) -> None:
        self.step = []

    def __call__(self, tensor: torch.Tensor, what: str) -> list:
        self.step.append(what)
        return tensor.tolist()

