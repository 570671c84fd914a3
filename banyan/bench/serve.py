"""An asyncio load generator for any OpenAI-compatible server (/v1/completions, streamed).

Requests go out at a fixed --concurrency or as a Poisson process at --request-rate (exponential
gaps between sends), each limited by the concurrency cap when both are given. Every response is
streamed; token counts come from the server's `usage` (stream_options.include_usage), else one
token per streamed chunk.

The client runs on the machine it measures, so it is built to cost little: aiohttp, whose streamed lines cost
43-47 us of CPU a token against httpx's 119-133 (16 streams against `banyan serve` on a 2-vCPU Zen 4; a run of 64
x 128/128 took 1.03-1.18 CPU-seconds of the client against 1.64-1.98), as vLLM's benchmark client does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time

from banyan.bench.metrics import RequestTiming, samples_ms, summarize
from banyan.bench.workloads import BenchPrompt, conversations


async def run_serve(base_url: str, model: str | None, prompts: list[BenchPrompt], *, concurrency: int | None,
                    request_rate: float, slos: dict[str, float], seed: int = 0, api_key: str | None = None,
                    timeout: float = 600.0, progress: bool = True, keep_samples: bool = False) -> dict:
    """Send every prompt, gather per-request timings, and summarize them (keep_samples: with the
    per-request values, for latency CDFs).

    A conversation's turns go one after the other, each sent when the one before has finished; a
    concurrency slot is held for a whole conversation, as one user would.
    """
    from tqdm import tqdm

    gate = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(seed)
    bar = tqdm(total=len(prompts), desc="Requests", unit="req", disable=not progress)
    async with stream_session(base_url, api_key, concurrency or len(prompts) or 1, timeout) as client:

        async def chain(turns: list[BenchPrompt]) -> list[RequestTiming]:
            timings = []
            async with gate or contextlib.nullcontext():
                for prompt in turns:
                    timings.append(await send_completion(client, model, prompt))
                    bar.update(1)
            return timings

        start = time.perf_counter()
        tasks = []
        for turns in conversations(prompts):
            tasks.append(asyncio.create_task(chain(turns)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        timings = [t for chained in await asyncio.gather(*tasks) for t in chained]
        duration = time.perf_counter() - start
    bar.close()
    summary = summarize(timings, duration, slos)
    summary["errors"] = sorted({t.error for t in timings if t.error})[:5]
    if keep_samples:
        summary["samples"] = samples_ms(timings)
    return summary


def stream_session(base_url: str, api_key: str | None = None, connections: int = 0, timeout: float = 600.0):
    """The aiohttp session send_completion streams over: at most `connections` at once (0: no limit), a fresh one
    per request (localhost: ~0.1 ms): a kept-alive one may be closed by the server just as the next request goes
    out on it (llama-server), failing that request for no fault of its engine."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return aiohttp.ClientSession(base_url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout),
                                 connector=aiohttp.TCPConnector(limit=connections, force_close=True))


async def send_completion(session, model: str | None, prompt: BenchPrompt) -> RequestTiming:
    """One streamed /v1/completions request over a stream_session, timed chunk by chunk."""
    body = {
        "prompt": prompt.prompt_token_ids,
        "max_tokens": prompt.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    if prompt.structured_outputs:
        body["structured_outputs"] = prompt.structured_outputs
    timing = RequestTiming(success=False, prompt_tokens=len(prompt.prompt_token_ids))
    chunks, usage, last = 0, None, None
    start = time.perf_counter()
    try:
        async with session.post("/v1/completions", json=body) as response:
            if response.status != 200:
                timing.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return timing
            async for line in response.content:  # one SSE line at a time, b"\n" included
                data = line[len(b"data:"):].strip() if line.startswith(b"data:") else None
                if not data or data == b"[DONE]":
                    continue
                event = json.loads(data)
                usage = event.get("usage") or usage
                if not any(_is_token(choice) for choice in event.get("choices") or ()):
                    continue  # usage only, or a closing chunk (a finish_reason, no text)
                now = time.perf_counter()
                if last is None:
                    timing.ttft = now - start
                else:
                    timing.itl.append(now - last)
                last = now
                chunks += 1
    except Exception as e:  # noqa: BLE001 - any transport error is a failed request, reported
        timing.error = f"{type(e).__name__}: {e}"
        return timing
    timing.e2el = time.perf_counter() - start
    if usage:
        timing.output_tokens = usage.get("completion_tokens", chunks)
        timing.prompt_tokens = usage.get("prompt_tokens", timing.prompt_tokens)
    else:
        timing.output_tokens = chunks
    timing.success = last is not None
    if not timing.success:
        timing.error = "no tokens streamed"
    return timing


def _is_token(choice: dict) -> bool:
    """A chunk that carries a token: some text, or none yet (a special token) without the finish."""
    return bool(choice.get("text")) or choice.get("finish_reason") is None
