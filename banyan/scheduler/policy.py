"""Queue order and preemption victims.

fcfs: arrival order. priority: lower `priority` value first, then arrival. The victim of a
preemption is always the request that would be served last: the latest, or the lowest priority.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from banyan.registry import Registry
from banyan.request import Request

POLICIES: Registry[Callable[[Request], tuple]] = Registry("policy")  # name -> sort key: smaller is served first


@POLICIES.register("fcfs")
def _arrival(request: Request) -> tuple:
    return (request.metrics.arrival_time, request.seq_no)


@POLICIES.register("priority")
def _priority(request: Request) -> tuple:
    return (request.priority, request.metrics.arrival_time, request.seq_no)


class SchedulingPolicy:
    def __init__(self, name: str = "fcfs"):
        self.key = POLICIES.get(name)
        """Sort key of a request: smaller is served first."""

    def pick_victim(self, running: Iterable[Request]) -> Request:
        """The running request to preempt: the one served last."""
        return max(running, key=self.key)
