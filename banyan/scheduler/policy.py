"""Queue order and preemption victims.

fcfs: arrival order. priority: lower `priority` value first, then arrival. The victim of a
preemption is always the request that would be served last: the latest, or the lowest priority.
"""

from __future__ import annotations

from collections.abc import Iterable

from banyan.request import Request


class SchedulingPolicy:
    def __init__(self, name: str = "fcfs"):
        self.use_priority = name == "priority"

    def key(self, request: Request) -> tuple:
        """Sort key: smaller is served first."""
        if self.use_priority:
            return (request.priority, request.metrics.arrival_time, request.seq_no)
        return (request.metrics.arrival_time, request.seq_no)

    def pick_victim(self, running: Iterable[Request]) -> Request:
        """The running request to preempt: the one served last."""
        return max(running, key=self.key)
