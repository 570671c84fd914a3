"""`banyan bench deadlines`: goodput under overload, --scheduling-policy slo against fcfs, side by side.

    1. capacity: a fcfs server under `calibration_concurrency` closed-loop clients for `calibration_s`: completed
       requests per second, the load this machine sustains for the workload (random prompts of input_len tokens,
       output_len tokens each, ignore_eos)
    2. for each load factor (1.5 and 3 by default), for fcfs then slo (each on a fresh server, the same seeded
       arrivals): Poisson arrivals at factor x capacity for `duration_s`, every request with a TTFT target of
       ttft_slo_ms (the server's --default-ttft-slo-ms); TTFT measured by the client, from send to the first token
    3. per run: goodput = requests whose first token came within the target / requests sent (a refused one counts
       as missed), refusals (503, and how fast they came), and the requests admitted yet late by more than 50% (a
       client gives up on a request with no first token after give_up_after_s, as real clients time out: late)

The client runs on the same machine as the server: keep the rates modest (a 2-vCPU box: a few dozen per second).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from dataclasses import dataclass

from banyan.bench.metrics import percentile
from banyan.config import EngineConfig

POLICIES = ("fcfs", "slo")


@dataclass(frozen=True)
class DeadlineBenchConfig:
    input_len: int = 128
    """Prompt tokens of every request (random ids)."""
    output_len: int = 32
    """Tokens generated per request (ignore_eos)."""
    ttft_slo_ms: float = 2000.0
    """The time-to-first-token target of every request."""
    load_factors: str = "1.5,3"
    """Arrival rates, as multiples of the measured capacity (comma-separated)."""
    duration_s: float = 60.0
    """Seconds of arrivals per run."""
    calibration_concurrency: int = 32
    """Closed-loop clients while the capacity is measured."""
    calibration_s: float = 30.0
    """Seconds the capacity is measured for."""
    workload_seed: int = 0
    """Seed of the prompts and the arrivals."""
    give_up_after_s: float = 10.0
    """A client gives up on a request whose first token has not come this many seconds after it was sent, as real
    clients time out (it counts as late; 0: wait for every request, however long)."""


@dataclass
class Sent:
    status: int | None = None
    ttft: float | None = None  # seconds, send to the first token
    answered_after: float | None = None  # seconds until the status line (a refusal's speed)
    error_code: str | None = None  # an error event in the stream (slo_unattainable: refused by the core after a 200)
    gave_up: bool = False  # no first token within give_up_after_s: the client hung up


async def _one(http, body: dict, give_up_after: float | None = None) -> Sent:
    sent, start = Sent(), time.monotonic()
    try:
        async with asyncio.timeout(give_up_after) as patience:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                sent.status, sent.answered_after = r.status_code, time.monotonic() - start
                async for line in r.aiter_lines():
                    if line.startswith('data: {"error"'):
                        sent.error_code = json.loads(line[6:])["error"].get("code")
                    elif sent.ttft is None and line.startswith("data: {") and '"text"' in line:
                        sent.ttft = time.monotonic() - start
                        patience.reschedule(None)  # it started: read it to the end
    except TimeoutError:
        sent.gave_up = True
    except Exception:  # noqa: BLE001 - a transport failure is a request that missed
        pass
    return sent


def _prompts(cfg: DeadlineBenchConfig, vocab_size: int, count: int) -> list[list[int]]:
    rng = random.Random(cfg.workload_seed)
    return [[rng.randrange(10, vocab_size) for _ in range(cfg.input_len)] for _ in range(count)]


def _body(prompt: list[int], cfg: DeadlineBenchConfig) -> dict:
    return {"prompt": prompt, "max_tokens": cfg.output_len, "ignore_eos": True, "temperature": 0.0, "stream": True}


async def _closed_loop(base_url: str, cfg: DeadlineBenchConfig, prompts: list[list[int]]) -> float:
    """Completed requests per second under calibration_concurrency clients."""
    import httpx

    done, stop_at = 0, time.monotonic() + cfg.calibration_s
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        async def client(i: int) -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                sent = await _one(http, _body(prompts[(i + done) % len(prompts)], cfg))
                done += sent.status == 200
        start = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(cfg.calibration_concurrency)))
        return done / (time.monotonic() - start)


async def _open_loop(base_url: str, cfg: DeadlineBenchConfig, prompts: list[list[int]], rate: float) -> list[Sent]:
    import httpx

    rng = random.Random(cfg.workload_seed + 1)
    at, arrivals = 0.0, []  # the same seconds for every policy at this rate
    while at < cfg.duration_s:
        arrivals.append(at)
        at += rng.expovariate(rate)
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        tasks, start = [], time.monotonic()
        for i, at in enumerate(arrivals):  # on the clock: a client slowed by the server's CPU use catches up
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            tasks.append(asyncio.ensure_future(_one(http, _body(prompts[i % len(prompts)], cfg),
                                                    cfg.give_up_after_s or None)))
        return list(await asyncio.gather(*tasks))


def summarize(sent: list[Sent], slo_s: float) -> dict:
    served = [s for s in sent if s.status == 200 and s.ttft is not None]
    refused = [s for s in sent if s.status in (429, 503)]
    ttfts = [s.ttft for s in served]
    return {"sent": len(sent), "served": len(served), "refused": len(refused),
            "met": sum(1 for t in ttfts if t <= slo_s), "goodput": round(sum(1 for t in ttfts if t <= slo_s) / len(sent), 3),
            "admitted_late_by_over_50pct": sum(1 for t in ttfts if t > 1.5 * slo_s)
            + sum(1 for s in sent if s.gave_up and s.status == 200),
            "gave_up": sum(1 for s in sent if s.gave_up),
            "ttft_p50_s": round(percentile(ttfts, 50), 2) if ttfts else None,
            "ttft_p99_s": round(percentile(ttfts, 99), 2) if ttfts else None,
            "refusal_p99_ms": round(1000 * percentile([s.answered_after for s in refused], 99), 1) if refused else None,
            "refused_in_stream": sum(1 for s in sent if s.status == 200 and s.error_code == "slo_unattainable"),
            "other": sum(1 for s in sent if s.status == 200 and s.ttft is None and s.error_code != "slo_unattainable"
                         and not s.gave_up)}


def run_deadlines(engine: EngineConfig, cfg: DeadlineBenchConfig, on_progress=print) -> dict:
    from banyan.bench.launcher import banyan_serve_cmd, free_port, launched
    from banyan.checkpoint import open_checkpoint

    prompts = _prompts(cfg, open_checkpoint(engine.model.model).arch.vocab_size, 256)

    def served_by(policy: str):
        sched = dataclasses.replace(engine.scheduler, policy=policy, default_ttft_slo_ms=cfg.ttft_slo_ms)
        port = free_port()
        return launched(banyan_serve_cmd(engine.replace(scheduler=sched), port), port, ready_timeout=600)

    with served_by("fcfs") as base_url:
        capacity = asyncio.run(_closed_loop(base_url, cfg, prompts))
    on_progress(f"deadlines: capacity {capacity:.2f} requests/s")
    runs = []
    for factor in (float(f) for f in cfg.load_factors.split(",")):
        for policy in POLICIES:
            with served_by(policy) as base_url:
                sent = asyncio.run(_open_loop(base_url, cfg, prompts, factor * capacity))
            runs.append({"load_factor": factor, "policy": policy, "rate": round(factor * capacity, 2),
                         **summarize(sent, cfg.ttft_slo_ms / 1000)})
            on_progress(f"deadlines: {json.dumps(runs[-1])}")
    return {"capacity_rps": round(capacity, 3), "runs": runs}


def markdown(results: dict, cfg: DeadlineBenchConfig) -> str:
    lines = [f"Capacity {results['capacity_rps']} requests/s ({cfg.input_len} prompt + {cfg.output_len} output tokens); "
             f"TTFT target {cfg.ttft_slo_ms:g} ms; {cfg.duration_s:g} s of Poisson arrivals per run; clients give up "
             f"after {cfg.give_up_after_s:g} s without a first token.", "",
             "| load | policy | sent | served | refused: 503 / in stream | met | goodput | slo / fcfs | admitted, late > 50% | "
             "given up | TTFT p50 / p99 (s) | refusal p99 (ms) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fcfs = {r["load_factor"]: r["goodput"] for r in results["runs"] if r["policy"] == "fcfs"}
    for r in results["runs"]:
        ratio = f"{r['goodput'] / fcfs[r['load_factor']]:.1f}x" if r["policy"] == "slo" and fcfs.get(r["load_factor"]) else ""
        lines.append(f"| {r['load_factor']:g}x | {r['policy']} | {r['sent']} | {r['served']} | {r['refused']} / "
                     f"{r.get('refused_in_stream', r.get('other', 0))} | {r['met']} | "
                     f"{r['goodput']:.0%} | {ratio} | {r['admitted_late_by_over_50pct']} | {r.get('gave_up', 0)} | "
                     f"{r['ttft_p50_s']} / "
                     f"{r['ttft_p99_s']} | {r['refusal_p99_ms'] or ''} |")
    return "\n".join(lines) + "\n"
