"""What the shared-prefix wait costs the scheduler: `schedule()` alone, with the wait off and on, no model.

    python benchmarks/shared_prefix_schedule_cost.py [--requests 1000] [--runs 5]

--requests requests sharing a 1,024-token prefix (each with 32 tokens of its own, 8 output tokens) are queued at once
on a scheduler with pages of 16, a budget of 2,048 tokens and 256 seats; a stand-in model samples token 7. Each run
steps until all finish, timing only `schedule()`; runs alternate the order of the two settings; medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from banyan.config import SchedulerConfig
from banyan.kv_cache import KVCacheManager
from banyan.request import Request
from banyan.sampling_params import SamplingParams
from banyan.scheduler import SampledToken, Scheduler, StepResult


def run(wait_tokens: int, num_requests: int, shared: int = 1024, own: int = 32, max_tokens: int = 8):
    """Seconds in schedule(), steps, tokens computed."""
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048, shared_prefix_wait_tokens=wait_tokens)
    scheduler = Scheduler(config, KVCacheManager(8192, 16), 4096)
    prefix = list(range(1000, 1000 + shared))
    for i in range(num_requests):
        prompt = prefix + [5000 + i * own + j for j in range(own)]
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens,
                                      arrival_time=float(i)))
    seconds, steps, tokens = 0.0, 0, 0
    while scheduler.has_unfinished_requests():
        start = time.perf_counter()
        batch = scheduler.schedule()
        seconds += time.perf_counter() - start
        steps, tokens = steps + 1, tokens + batch.num_tokens
        scheduler.update(batch, StepResult(sampled={x.request.request_id: SampledToken(7, 0.0)
                                                    for x in batch.scheduled if x.samples}))
    return seconds, steps, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    results = {0: [], 32: []}
    for r in range(args.runs):
        for wait in (0, 32) if r % 2 == 0 else (32, 0):
            results[wait].append(run(wait, args.requests))
    for wait, runs in results.items():
        seconds, (_, steps, tokens) = statistics.median(x[0] for x in runs), runs[0]
        print(f"shared_prefix_wait_tokens={wait}: schedule() {seconds * 1000:.1f} ms in {steps} steps "
              f"({seconds / steps * 1000:.2f} ms a step), {tokens} tokens computed")


if __name__ == "__main__":
    main()
