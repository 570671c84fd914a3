"""Faults injected into a loaded `banyan serve` (RELIABILITY G6), as figures: `banyan bench soak --faults` reports
them, tests/reliability asserts them.

    kill_core:  `streams` long streams running, the engine core SIGKILLed: every stream must end with an error event
                and [DONE] within 5 s, /health answer 503 (or the server be gone), the server exit non-zero in 10 s
    terminate:  `streams` 48-token streams, the server SIGTERMed: in-flight streams drain (finish_reason, [DONE]), new
                requests get 503, the server exits 0
    disk_full:  the server's stdout and stderr on a full disk (/dev/full: every log line, the audit log's included,
                fails with ENOSPC): it starts, `streams` streams and plain requests are answered, a bad request gets
                its 400, /health 200, and SIGTERM still ends it with 0
    slow_reader: `readers` clients open long streams and never read them (a 4 KiB receive buffer): for `seconds` the
                server's resident memory stays within its buffer cap (what the kernel's socket buffers do not hold
                waits in at most --max-buffered-events events a stream, then the stream is aborted), while other
                clients are answered as usual
    text_pool:  the server's tokenizer/template threads saturated (`big` prompts of 2 MB without a space, each
                tokenized up to the render time cap): every one answered 200, 400 or 503, /health stays fast (p99 of
                its latency meanwhile), and a normal request queued behind them is answered, or refused with 503
                when no worker frees up in time (never a 400 blaming its prompt)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

from banyan.bench.soak import child_pids

ERRORED_WITHIN = 5.0
EXIT_WITHIN = 10.0
LONG = {"prompt": "tell me a long story", "max_tokens": 200, "ignore_eos": True, "stream": True}


async def _stream_until_end(http, started: asyncio.Event, body: dict) -> tuple[str, float]:
    """How the stream ended ('error', a finish_reason, or 'cut': no [DONE]) and when (monotonic)."""
    end = "cut"
    async with http.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            started.set()
            if line == "data: [DONE]":
                return end if end != "cut" else "no finish_reason", time.monotonic()
            event = json.loads(line[6:])
            if "error" in event:
                end = "error"
            elif event.get("choices") and event["choices"][0].get("finish_reason"):
                end = event["choices"][0]["finish_reason"]
    return "cut", time.monotonic()


async def _load(http, streams: int, max_tokens: int) -> tuple[list[asyncio.Task], asyncio.Event]:
    """`streams` streams of max_tokens each, once the first of them has a token."""
    started = asyncio.Event()
    body = LONG | {"max_tokens": max_tokens}
    tasks = [asyncio.ensure_future(_stream_until_end(http, started, body)) for _ in range(streams)]
    await asyncio.wait_for(started.wait(), 120)
    return tasks, started


async def kill_core(base_url: str, server: subprocess.Popen, streams: int = 8) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        tasks, _ = await _load(http, streams, max_tokens=200)
        core = child_pids(server.pid)[0]
        killed = time.monotonic()
        os.kill(core, signal.SIGKILL)
        ends = await asyncio.gather(*tasks, return_exceptions=True)
        try:
            health = (await http.get("/health", timeout=5)).status_code
        except httpx.HTTPError:
            health = None  # already gone
    exit_status = await _exit_status(server, killed)
    ended = [e for e in ends if isinstance(e, tuple)]
    return {"streams": streams, "ended_with_error": sum(1 for how, _ in ended if how == "error"),
            "errored_within_s": round(max((t for _, t in ended), default=killed) - killed, 2),
            "health_after": health, "exit_status": exit_status[0], "exited_within_s": exit_status[1],
            "ok": len(ended) == streams and all(how == "error" for how, _ in ended) and health in (503, None)
            and max(t for _, t in ended) - killed <= ERRORED_WITHIN and exit_status[0] not in (0, None)
            and exit_status[1] <= EXIT_WITHIN}


async def terminate(base_url: str, server: subprocess.Popen, streams: int = 8) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        tasks, _ = await _load(http, streams, max_tokens=48)
        signalled = time.monotonic()
        server.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        try:
            refused = (await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=5)).status_code
        except httpx.HTTPError:
            refused = None
        ends = await asyncio.gather(*tasks, return_exceptions=True)
    exit_status = await _exit_status(server, signalled, timeout=120)
    finished = [how for how, _ in (e for e in ends if isinstance(e, tuple))]
    return {"streams": streams, "finished": {how: finished.count(how) for how in set(finished)},
            "new_request_status": refused, "exit_status": exit_status[0], "exited_after_s": exit_status[1],
            "ok": len(finished) == streams and all(how in ("length", "abort") for how in finished)
            and refused == 503 and exit_status[0] == 0}


async def disk_full(base_url: str, server: subprocess.Popen, streams: int = 8) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        tasks, _ = await _load(http, streams, max_tokens=16)
        plain = [(await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})).status_code
                 for _ in range(4)]
        bad = (await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": -1})).status_code
        ends = await asyncio.gather(*tasks, return_exceptions=True)
        health = (await http.get("/health")).status_code
    signalled = time.monotonic()
    server.send_signal(signal.SIGTERM)
    exit_status = await _exit_status(server, signalled, timeout=60)
    finished = [how for how, _ in (e for e in ends if isinstance(e, tuple))]
    return {"streams": streams, "finished": {how: finished.count(how) for how in set(finished)},
            "plain_statuses": plain, "bad_request_status": bad, "health": health, "exit_status": exit_status[0],
            "ok": finished == ["length"] * streams and plain == [200] * 4 and bad == 400 and health == 200
            and exit_status[0] == 0}


SLOW_READER_RSS_GROWTH = 64 << 20
"""Bytes the server may grow by while its slow readers' streams back up: their buffered events (at most
--max-buffered-events each, a few hundred bytes an event) and allocator slack; a leak per token grows past it."""


async def slow_reader(base_url: str, server: subprocess.Popen, readers: int = 4, seconds: float = 30.0) -> dict:
    import socket

    import httpx

    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"prompt": "tell me a long story", "ignore_eos": True, "stream": True}).encode()  # to the context's end
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sockets = []
    for _ in range(readers):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window stays small
        s.connect((host, int(port)))
        s.sendall(head + body)
        sockets.append(s)
    before, peak, answered, started = _rss(server.pid), 0, [], time.monotonic()
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            while time.monotonic() - started < seconds:
                r = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
                answered.append(r.status_code)
                peak = max(peak, _rss(server.pid) - before)
                await asyncio.sleep(0.5)
    finally:
        for s in sockets:
            s.close()
    return {"readers": readers, "seconds": seconds, "rss_growth_mib": round(peak / 2**20, 1),
            "other_requests": {str(c): answered.count(c) for c in set(answered)},
            "ok": peak <= SLOW_READER_RSS_GROWTH and bool(answered) and set(answered) == {200}}


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _exit_status(proc: subprocess.Popen, since: float, timeout: float = EXIT_WITHIN + 5) -> tuple[int | None, float]:
    while proc.poll() is None and time.monotonic() - since < timeout:
        await asyncio.sleep(0.05)
    return proc.poll(), round(time.monotonic() - since, 2)


async def text_pool(base_url: str, server: subprocess.Popen, big: int = 6) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        heavy = [asyncio.ensure_future(http.post("/v1/completions", json={"prompt": "a" * 2_000_000, "max_tokens": 1}))
                 for _ in range(big)]
        await asyncio.sleep(0.5)  # the pool is busy now
        normal = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4}))
        health = []
        while not all(t.done() for t in heavy):
            asked = time.monotonic()
            health.append(((await http.get("/health", timeout=30)).status_code, time.monotonic() - asked))
            await asyncio.sleep(0.05)
        statuses = [t.result().status_code for t in heavy]
        normal_status = (await normal).status_code
    latencies = sorted(t for _, t in health)
    p50, p99 = (latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else None for q in (0.5, 0.99))
    return {"big_prompts": big, "statuses": {str(c): statuses.count(c) for c in set(statuses)},
            "normal_request_status": normal_status, "health_checks": len(health),
            "health_p50_ms": round(1000 * p50, 1) if p50 is not None else None,
            "health_p99_ms": round(1000 * p99, 1) if p99 is not None else None,
            "ok": set(statuses) <= {200, 400, 503} and normal_status in (200, 503) and all(c == 200 for c, _ in health)
            and (p99 is None or p99 < 0.1)}
