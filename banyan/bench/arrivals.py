"""Serving-style load on an in-process Engine: requests arrive over time instead of all at once.

A closed batch (every prompt submitted at once) ends when its slowest request ends, so anything that speeds up
only some requests (speculation on the copy-heavy half of a mixed workload) barely moves its makespan. A server
sees arrivals: a request that finishes sooner frees its slot and its share of every later step. This driver
replays a seeded arrival schedule against an Engine and times each request as a client would, from its
scheduled arrival (so time spent waiting for the engine's current step counts, as queueing does on a server):

    arrival[i] = start + offsets[i]
    ttft[i]    = first token seen - arrival[i]
    e2el[i]    = last token seen  - arrival[i]
    tpot[i]    = (e2el - ttft) / (output tokens - 1)      (banyan.bench.metrics.RequestTiming)

The loop adds every request whose time has come, runs one engine step, and sleeps only when the engine is idle.
"""

from __future__ import annotations

import math
import random
import time

from banyan.bench.metrics import RequestTiming
from banyan.bench.workloads import BenchPrompt
from banyan.sampling_params import SamplingParams


def poisson_offsets(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request arrives: a Poisson process at `request_rate` per second
    (exponential gaps, seeded, the first request at 0); all at 0 when the rate is infinite."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


def run_arrivals(engine, prompts: list[BenchPrompt], offsets: list[float], temperature: float,
                 tag: str = "arrival") -> tuple[list[RequestTiming], float]:
    """Each prompt added to `engine` at its offset, the engine stepped until all finish.
    Returns the per-request timings (prompt order) and the seconds from the start to the last token."""
    timings = [RequestTiming(success=False, prompt_tokens=len(p.prompt_token_ids)) for p in prompts]
    index = {f"{tag}-{i}": i for i in range(len(prompts))}
    last_seen: dict[int, float] = {}
    start = time.perf_counter()
    next_up = 0
    while next_up < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while next_up < len(prompts) and start + offsets[next_up] <= now:
            _add(engine, f"{tag}-{next_up}", prompts[next_up], temperature)
            next_up += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + offsets[next_up] - time.perf_counter()))
            continue
        for delta in engine.step():
            i, seen = index[delta.request_id], time.perf_counter()
            timing = timings[i]
            if delta.new_token_ids:
                since = seen - start - offsets[i]
                if not timing.output_tokens:
                    timing.ttft = since
                else:
                    timing.itl.append(seen - last_seen[i])
                last_seen[i] = seen
                timing.output_tokens += len(delta.new_token_ids)
                timing.e2el = since
            if delta.finish_reason is not None:
                timing.success = delta.error is None
                timing.error = delta.error.message if delta.error else ""
    return timings, time.perf_counter() - start


def _add(engine, request_id: str, prompt: BenchPrompt, temperature: float) -> None:
    params = SamplingParams(temperature=temperature if prompt.temperature is None else prompt.temperature, top_p=1.0,
                            max_tokens=prompt.output_len, ignore_eos=prompt.ignore_eos, structured_outputs=prompt.structured_outputs)
    engine.add_request(request_id, prompt.prompt_token_ids, params)
