"""Async scheduling (`--async-scheduling`), SGLang's zero-overhead scheduler: the engine launches step N+1 before it
reads step N's sampled ids, so the device runs while the host settles N and prepares the next step.

    engine step N+1:  schedule N+1, N taken as done (scheduler/overlap.py) -> launch N+1, its placeholders <- N's ids
                      on the device (runner/overlap.py) -> read N's ids, the one counted wait -> settle N (stops,
                      deltas) -> sample N+1 (penalties and min_tokens see token N), its ids left on the device

A step stays in flight only if each of its requests can do without its token on the host until the next schedule
(stays_in_flight); another is sampled and read at once, still launched before the previous step's read.
"""

from __future__ import annotations

from banyan.request import Request
from banyan.runner.overlap import PendingIds
from banyan.scheduler.batch import Batch
from banyan.scheduler.overlap import OverlapScheduler, stays_in_flight


class Overlap:
    """The engine's step with the step before in flight (at most one)."""

    def __init__(self, scheduler: OverlapScheduler, runner):
        self.scheduler, self.runner = scheduler, runner
        self.pending: PendingIds | None = None  # the step in flight's ids, on the device

    def run(self, batch: Batch) -> list[Request]:
        """Launch `batch`, settle the step in flight, sample `batch` (left in flight when it may); returns the
        requests that got tokens, each once."""
        previous, self.pending = self.pending, None
        if batch.is_empty:  # nothing new: only the step in flight to settle
            self.runner.to_host.new_step()
        launched = self.runner.launch(batch, previous) if not batch.is_empty else None
        advanced = self.scheduler.settle(previous.read(self.runner.to_host)) if previous is not None else []
        if launched is not None:
            keep = all(stays_in_flight(item.request) for item in batch.scheduled)
            result = self.runner.finish(launched, keep_ids=keep)
            if isinstance(result, PendingIds):
                self.pending = result
                self.scheduler.launched(batch)
            else:
                advanced += self.scheduler.update(batch, result)
        return list(dict.fromkeys(advanced))
