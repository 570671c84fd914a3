"""`banyan bench swap`: a model swapped under load on a `banyan serve` it starts, against the same load before.

    |-- warm-up --|------ before ------|--- swap: load beside, switch, drain old ---|-- after --|
                                       ^ POST /admin/models/m/swap      switched ^   old core exited ^

`--concurrency` clients stream /v1/completions back to back the whole time. Every streamed token is time-stamped;
the report compares the window before the swap with the swap itself (from the POST until the old core has
exited): the longest gap between two tokens served to anyone, TTFT p50/p99 of the requests that started in the
window, output tokens/s, and failed requests (the goal: none). A swap loads the new core beside the old one, so
the swap window shares the CPU with a model load: the gap and the TTFT say what clients feel of it. The switch
time comes from the server (the new entry's ready_at), the old core's exit from /proc (the bench runs on the
server's machine).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from dataclasses import dataclass, field

from banyan.bench.launcher import banyan_serve_cmd, free_port, launched
from banyan.bench.metrics import RequestTiming, percentile
from banyan.bench.serve import send_completion, stream_session
from banyan.bench.workloads import BenchPrompt
from banyan.config import EngineConfig

ADMIN_KEY = "bench-swap-admin-key"
NAME = "m"
TEXT = "The lighthouse keeper climbed the spiral stairs every evening at dusk and wrote down the boats. "


@dataclass
class Stream:
    start: float
    timing: RequestTiming

    @property
    def token_times(self) -> list[float]:
        if self.timing.ttft <= 0:  # no token came (RequestTiming keeps 0.0 then)
            return []
        return list(itertools.accumulate(self.timing.itl, initial=self.start + self.timing.ttft))


@dataclass
class Load:
    streams: list[Stream] = field(default_factory=list)
    stop: bool = False


def run_swap(engine: EngineConfig, args) -> tuple[dict, dict]:
    port = free_port()
    cmd = [*banyan_serve_cmd(engine, port), "--served-model-name", NAME, "--admin-api-key", ADMIN_KEY]
    config = {"model": engine.model.model, "swap_to": args.swap_model or engine.model.model,
              "concurrency": args.concurrency, "input_len": args.input_len, "output_len": args.output_len,
              "before_seconds": args.before_seconds}
    with launched(cmd, port, ready_timeout=900) as base_url:
        results = asyncio.run(_measure(base_url, args))
    return config, results


async def _measure(base_url: str, args) -> dict:
    import httpx

    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with (httpx.AsyncClient(base_url=base_url, timeout=900, limits=httpx.Limits(max_keepalive_connections=0)) as http,
                stream_session(base_url, timeout=900) as streams):
        ids = (await http.post("/tokenize", json={"model": NAME, "prompt": TEXT * 64})).json()["tokens"]
        prompt = BenchPrompt(ids[: args.input_len], args.output_len)
        load = Load()
        clients = [asyncio.create_task(_client(streams, prompt, load)) for _ in range(args.concurrency)]
        await asyncio.sleep(args.warmup_seconds)
        t_before = time.perf_counter()
        await asyncio.sleep(args.before_seconds)
        t_swap, wall_at_swap = time.perf_counter(), time.time()
        body = {"model": args.swap_model or (await _entry(http, admin, NAME))["model"]}
        old = await _entry(http, admin, NAME)
        answer = await http.post(f"/admin/models/{NAME}/swap", json=body, headers=admin)
        answer.raise_for_status()
        await _until(lambda e: "swap" not in e[NAME], http, admin)
        new = await _entry(http, admin, NAME)
        failed_swap = new.get("error")
        # the server's own clock says when the name switched (our polls may lag behind a busy server); the old
        # core's exit shows in /proc at once
        t_switch = t_swap + new.get("ready_at", time.time()) - wall_at_swap if not failed_swap else time.perf_counter()
        while os.path.exists(f"/proc/{old['pid']}"):
            await asyncio.sleep(0.02)
        t_drained = time.perf_counter()
        await asyncio.sleep(args.after_seconds)
        load_average = round(os.getloadavg()[0], 1)  # other work on the machine shares its CPUs: say how much
        load.stop = True
        await asyncio.gather(*clients)
    before = _window(load.streams, t_before, t_swap)
    during = _window(load.streams, t_swap, t_drained)
    return {"before": before, "during_swap": during, "swap_load_s": t_switch - t_swap, "drain_s": t_drained - t_switch,
            "swap_error": failed_swap, "failed": sum(not s.timing.success for s in load.streams),
            "errors": sorted({s.timing.error for s in load.streams if s.timing.error})[:5],
            "requests": len(load.streams), "load_average_1m": load_average}


async def _client(streams, prompt: BenchPrompt, load: Load) -> None:
    while not load.stop:
        start = time.perf_counter()
        load.streams.append(Stream(start, await send_completion(streams, NAME, prompt)))


async def _entries(http, admin: dict) -> dict[str, dict]:
    data = (await http.get("/admin/models", headers=admin)).json()["data"]
    return {(e["name"] if e["state"] != "draining" else e["name"] + "@draining"): e for e in data}


async def _entry(http, admin: dict, name: str) -> dict:
    return (await _entries(http, admin))[name]


async def _until(done, http, admin: dict) -> float:
    while not done(await _entries(http, admin)):
        await asyncio.sleep(0.05)
    return time.perf_counter()


def _window(streams: list[Stream], start: float, end: float) -> dict:
    """Tokens served in [start, end) by anyone, and the requests that started in it."""
    times = sorted(t for s in streams for t in s.token_times if start <= t < end)
    edges = [start, *times, end]
    started = [s for s in streams if start <= s.start < end]
    ttfts = [s.timing.ttft * 1000 for s in started if s.timing.ttft > 0]
    return {"seconds": round(end - start, 2), "tokens": len(times),
            "tokens_per_s": round(len(times) / (end - start), 1) if end > start else 0.0,
            "longest_gap_ms": round(max(b - a for a, b in itertools.pairwise(edges)) * 1000, 1),
            "requests_started": len(started),
            "ttft_p50_ms": round(percentile(ttfts, 50), 1) if ttfts else None,
            "ttft_p99_ms": round(percentile(ttfts, 99), 1) if ttfts else None,
            "failed": sum(not s.timing.success for s in started)}


def markdown(results: dict) -> str:
    rows = [("window", "seconds", "tokens/s", "longest gap (ms)", "TTFT p50 (ms)", "TTFT p99 (ms)", "requests",
             "failed")]
    for name in ("before", "during_swap"):
        w = results[name]
        rows.append((name.replace("_", " "), w["seconds"], w["tokens_per_s"], w["longest_gap_ms"], w["ttft_p50_ms"],
                     w["ttft_p99_ms"], w["requests_started"], w["failed"]))
    table = "\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in rows)
    header, body = table.split("\n", 1)
    return (f"{header}\n|{'---|' * len(rows[0])}\n{body}\n\nswap: new core ready after {results['swap_load_s']:.1f} s, "
            f"old core drained and exited {results['drain_s']:.1f} s later; {results['failed']} of "
            f"{results['requests']} requests failed; load average {results['load_average_1m']}")
