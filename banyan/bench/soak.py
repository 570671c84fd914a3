"""`banyan bench soak`: a real `banyan serve` held under random streamed traffic for a while, then a disconnect storm;
the figures an operator asks for before trusting a server (docs/reliability.md).

    start the server (an admin key of its own: GET /admin/kv)  ->  greedy references, each request alone
    soak:  `streams` clients send requests back to back for `minutes` (soak_traffic.py: the mix and the checks),
           while a sampler records every few seconds the server's and the engine core's RSS, open fds and
           threads, and /admin/kv (integrity checked, pages in use, running, waiting)
    storm: `storm_clients` clients open streams at once and drop them at random points, mid-prefill and
           mid-stream; then the engine must go idle with 0 pages in use, and a greedy request still answers its
           reference
    report: JSON (every figure, met or not) + markdown + an SVG plot (soak_report.py)

Process figures come from /proc (Linux).
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from banyan.bench.soak_traffic import Outcome, Planned, Traffic, check_stream, greedy_body
from banyan.config import EngineConfig

RSS_GROWTH_GOAL = 0.05  # after warm-up (RELIABILITY G3)
IDLE_TIMEOUT = 30.0  # seconds the engine may take to go idle after the storm
FD_SETTLE_S = 5.0  # seconds the idle sample waits for the server's fd count to stop moving


@dataclass(frozen=True)
class SoakConfig:
    streams: int = 64
    """Clients, each sending streamed requests one after another."""
    minutes: float = 1.0
    """How long the soak runs."""
    disconnect_rate: float = 0.1
    """Share of soak requests whose client leaves at a random point."""
    storm_clients: int = 1000
    """Clients of the disconnect storm after the soak (0: no storm)."""
    sample_seconds: float = 2.0
    """Time between two samples of the processes and the KV cache."""
    warmup_fraction: float = 0.2
    """Share of the soak before the RSS baseline is taken."""
    traffic_seed: int = 0
    """Seed of the random requests."""
    faults: bool = False
    """Then, each on a server of its own under load: SIGKILL the engine core, SIGTERM the server, saturate its
    tokenizer threads (soak_faults.py)."""


@dataclass
class Probe:
    """Reads the server's process and its engine core's (/proc), and the cache through GET /admin/kv."""

    server_pid: int
    admin_headers: dict

    async def sample(self, http, started: float) -> dict:
        """The processes, then /admin/kv (`kv_error` instead when it did not answer)."""
        sample = {"t": round(time.monotonic() - started, 2)}
        for name, pid in (("server", self.server_pid), ("core", self.core_pid())):
            sample |= {f"{name}_{k}": v for k, v in process_stats(pid).items()}
        try:
            sample |= await self.kv(http)
        except Exception as e:  # noqa: BLE001 - recorded: a figure of its own
            sample["kv_error"] = f"{type(e).__name__}: {e}"[:200]
        return sample

    async def kv(self, http) -> dict:
        asked = time.monotonic()
        r = await http.get("/admin/kv", headers=self.admin_headers, timeout=60)
        if r.status_code != 200:
            raise RuntimeError(f"/admin/kv answered {r.status_code} after {time.monotonic() - asked:.1f} s: {r.text[:120]}")
        kv = r.json()
        return {"kv_in_use": kv["num_in_use"], "kv_pages": kv["num_pages"], "running": kv["num_running"],
                "waiting": kv["num_waiting"], "integrity": kv["integrity"]}

    def core_pid(self) -> int | None:
        children = child_pids(self.server_pid)
        return children[0] if children else None


def process_stats(pid: int | None) -> dict:
    """RSS bytes, open file descriptors and threads of a process (empty if it is gone)."""
    if pid is None:
        return {}
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        fields = dict(line.split(":", 1) for line in status if ":" in line)
        return {"rss": int(fields["VmRSS"].split()[0]) * 1024, "threads": int(fields["Threads"]),
                "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except (OSError, KeyError, ValueError):
        return {}


def child_pids(pid: int) -> list[int]:
    children = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            children += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        pass
    return children


# -- one request ------------------------------------------------------------------------------------
async def send(http, planned: Planned, references: list[str | None]) -> Outcome:
    """Send one planned request, leave where it says, and check what came back whole."""
    import httpx

    outcome = Outcome()
    try:
        async with http.stream("POST", planned.path, json=planned.body) as r:
            outcome.status = r.status_code
            if r.status_code != 200:
                outcome.error_code = _error_code(await r.aread())
                return outcome
            if planned.leave_after_events == 0:  # mid-prefill: gone before the first token
                await asyncio.sleep(planned.leave_after_ms / 1000)
                outcome.left = True
                return outcome
            lines = []
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
                if planned.leave_after_events is not None and len(lines) >= planned.leave_after_events:
                    outcome.left = True
                    return outcome
        outcome.problems, outcome.error_code, outcome.completion_tokens = check_stream(planned, lines, references)
    except httpx.HTTPError as e:
        outcome.transport_error = f"{type(e).__name__}: {e}"[:200]
    return outcome


def _error_code(body: bytes) -> str:
    import json

    try:
        error = json.loads(body)["error"]
        return error.get("code") or error.get("type") or "?"
    except (ValueError, KeyError, TypeError):
        return "unparsable error body"


async def references(http, prompts: list[str]) -> list[str | None]:
    """Each greedy prompt's text, asked alone (non-streamed) before any load."""
    texts = []
    for prompt in prompts:
        r = await http.post("/v1/completions", json=greedy_body(prompt))
        texts.append(r.json()["choices"][0]["text"] if r.status_code == 200 else None)
    return texts


# -- the soak -----------------------------------------------------------------------------------------
async def soak(http, config: SoakConfig, probe: Probe, traffic: Traffic, refs: list[str | None]) -> dict:
    started = time.monotonic()
    samples: list[dict] = [await probe.sample(http, started)]  # the idle baseline
    stop_at = time.monotonic() + config.minutes * 60
    outcomes: list[Outcome] = []

    async def client() -> None:
        while time.monotonic() < stop_at:
            outcomes.append(await send(http, traffic.next(), refs))

    async def sampler() -> None:
        while time.monotonic() < stop_at:
            await asyncio.sleep(config.sample_seconds)
            samples.append(await probe.sample(http, started))

    sampling = asyncio.ensure_future(sampler())
    await asyncio.gather(*(client() for _ in range(config.streams)))
    sampling.cancel()
    samples.append(await settled_sample(probe, http, started))  # after the last request: idle
    return {"duration_s": round(time.monotonic() - started, 1), **traffic_figures(outcomes),
            **resource_figures(samples, config.warmup_fraction * config.minutes * 60), "samples": samples}


def traffic_figures(outcomes: list[Outcome]) -> dict:
    whole = [o for o in outcomes if not o.left]
    lost = [o for o in whole if o.transport_error or (o.status == 200 and any("[DONE]" in p for p in o.problems))]
    mangled = [o for o in whole if o.problems and o not in lost]
    by_status: dict[str, int] = {}
    for o in outcomes:
        by_status[str(o.status)] = by_status.get(str(o.status), 0) + 1
    error_events: dict[str, int] = {}  # error events mid-stream, and refusals (status and code)
    for o in whole:
        if o.error_code:
            key = o.error_code if o.status == 200 else f"{o.status} {o.error_code}"
            error_events[key] = error_events.get(key, 0) + 1
    return {"requests": len(outcomes), "left_on_purpose": len(outcomes) - len(whole),
            "checked": sum(1 for o in whole if o.status == 200 and not o.error_code and not o.transport_error),
            "lost": len(lost), "mangled": len(mangled), "http_5xx": sum(1 for o in outcomes if (o.status or 0) >= 500),
            "status_counts": by_status, "error_events": error_events,
            "completion_tokens": sum(o.completion_tokens for o in whole),
            "examples": [p for o in mangled for p in o.problems][:10] + [o.transport_error for o in lost][:10]}


def resource_figures(samples: list[dict], warmup_s: float) -> dict:
    """Under load (every sample but the first and the last, taken idle before and after the soak): RSS growth after
    warm-up (the last quarter's mean against the first sample after warm-up), fds and threads (the first sample under
    load, the last, the most); then the idle values, the fds and threads against the baseline before the soak."""
    loaded = [s for s in samples[1:-1] if s["t"] >= warmup_s and "server_rss" in s] or samples[-1:]
    figures = {"integrity_failures": sum(1 for s in samples if s.get("integrity") == "broken"),
               "kv_unanswered": [f"{s['t']} s: {s['kv_error']}" for s in samples if "kv_error" in s]}
    for proc in ("server", "core"):
        rss = [s[f"{proc}_rss"] for s in loaded if f"{proc}_rss" in s]
        if not rss:
            continue
        tail = rss[-max(1, len(rss) // 4):]
        figures[f"{proc}_rss_mib"] = {"first": _mib(rss[0]), "max": _mib(max(rss)), "idle": _mib(samples[-1].get(f"{proc}_rss", 0))}
        figures[f"{proc}_rss_growth"] = round(sum(tail) / len(tail) / rss[0] - 1, 4)
        for what in ("fds", "threads"):
            values = [s[f"{proc}_{what}"] for s in loaded if f"{proc}_{what}" in s]
            figures[f"{proc}_{what}"] = {"baseline": samples[0].get(f"{proc}_{what}"), "first": values[0],
                                        "last": values[-1], "max": max(values), "idle": samples[-1].get(f"{proc}_{what}")}
    return figures


def _mib(num_bytes: int) -> float:
    return round(num_bytes / 2**20, 1)


# -- the storm ----------------------------------------------------------------------------------------
async def storm(http, clients: int, probe: Probe, seed: int, reference: tuple[str, str | None]) -> dict:
    """`clients` streams opened at once and dropped at random points; then idle, 0 pages in use, and a normal answer."""
    rng = random.Random(seed ^ 0x570)
    traffic = Traffic(seed, disconnect_rate=0.0)
    plans = []
    for _ in range(clients):
        planned = traffic.next()
        planned.leave_after_events = 0 if rng.random() < 0.4 else rng.randint(1, 20)
        planned.leave_after_ms = rng.uniform(0, 50)
        plans.append(planned)
    started = time.monotonic()
    outcomes = await asyncio.gather(*(send(http, p, [None] * len(traffic.greedy)) for p in plans))
    dropped_s = time.monotonic() - started
    idle_s, kv = await wait_idle(probe, http)
    prompt, expected = reference
    after = await http.post("/v1/completions", json=greedy_body(prompt))
    answered = after.status_code == 200 and (expected is None or after.json()["choices"][0]["text"] == expected)
    return {"clients": clients, "seconds": round(dropped_s, 1), "idle_after_s": idle_s,
            "statuses": {str(s): sum(1 for o in outcomes if o.status == s) for s in {o.status for o in outcomes}},
            "transport_errors": sum(1 for o in outcomes if o.transport_error),
            "kv_in_use_after": kv["kv_in_use"], "integrity_after": kv["integrity"], "next_request_ok": answered}


async def settled_sample(probe: Probe, http, started: float) -> dict:
    """The idle sample: once the engine is idle and the server's fd count has stopped moving (sockets of clients
    that left at the very end close a moment after their last byte; a leaked fd stays), at most FD_SETTLE_S."""
    await wait_idle(probe, http)
    deadline, last = time.monotonic() + FD_SETTLE_S, None
    while time.monotonic() < deadline:
        fds = process_stats(probe.server_pid).get("fds")
        if fds == last:
            break
        last = fds
        await asyncio.sleep(0.5)
    return await probe.sample(http, started)


async def wait_idle(probe: Probe, http) -> tuple[float | None, dict]:
    """Seconds until nothing runs or waits and no page is in use (None: not within IDLE_TIMEOUT), and the last
    /admin/kv."""
    started, kv = time.monotonic(), {"kv_in_use": None, "integrity": "not answered"}
    while True:
        try:
            kv = await probe.kv(http)
        except Exception:  # noqa: BLE001 - a server too busy to answer yet: ask again
            pass
        else:
            if kv["running"] == kv["waiting"] == kv["kv_in_use"] == 0:
                return round(time.monotonic() - started, 2), kv
        if time.monotonic() - started > IDLE_TIMEOUT:
            return None, kv
        await asyncio.sleep(0.1)


# -- the whole run ------------------------------------------------------------------------------------
def run_soak(engine: EngineConfig, config: SoakConfig, server_flags: list[str] | None = None,
             on_progress: Callable[[str], None] = print) -> dict:
    """Start a server, soak it, storm it; the results with every figure and whether it met its goal."""
    from banyan.bench.launcher import banyan_serve_cmd, free_port, launched_process

    admin_key = "soak-admin-" + secrets.token_hex(8)
    port = free_port()
    cmd = banyan_serve_cmd(engine, port) + ["--admin-api-key", admin_key, *(server_flags or [])]
    with launched_process(cmd, port, ready_timeout=600) as (base_url, proc):
        probe = Probe(proc.pid, {"Authorization": f"Bearer {admin_key}"})
        results = asyncio.run(_run(base_url, config, probe, on_progress))
    results["exit_status"] = proc.returncode
    if config.faults:
        from banyan.bench.soak_faults import disk_full, kill_core, slow_reader, terminate, text_pool

        on_progress("faults: SIGKILL of the engine core, SIGTERM of the server, the text pool saturated, a full disk, "
                    "clients that never read")
        results["faults"] = {"kill_core": _on_own_server(engine, kill_core),
                             "terminate": _on_own_server(engine, terminate, "--shutdown-timeout", "60"),
                             "text_pool": _on_own_server(engine, text_pool),
                             "disk_full": _on_own_server(engine, disk_full, output="/dev/full"),
                             "slow_reader": _on_own_server(engine, slow_reader)}
    results["goals"] = goals(results)
    return results


def _on_own_server(engine: EngineConfig, fault, *flags: str, output: str | None = None) -> dict:
    from banyan.bench.launcher import banyan_serve_cmd, free_port, launched_process

    port = free_port()
    cmd = banyan_serve_cmd(engine, port) + list(flags)
    with launched_process(cmd, port, ready_timeout=600, output=output) as (base_url, proc):
        return asyncio.run(fault(base_url, proc))


async def _run(base_url: str, config: SoakConfig, probe: Probe, on_progress) -> dict:
    import httpx

    # no kept-alive connections: after the soak the server's fds must be back at its idle baseline
    limits = httpx.Limits(max_connections=max(config.streams, config.storm_clients) + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as http:
        traffic = Traffic(config.traffic_seed, config.disconnect_rate)
        refs = await references(http, traffic.greedy)
        on_progress(f"soak: {config.streams} streams for {config.minutes:g} min")
        results = {"config": asdict(config), "soak": await soak(http, config, probe, traffic, refs)}
        if config.storm_clients:
            on_progress(f"storm: {config.storm_clients} clients dropping their streams")
            results["storm"] = await storm(http, config.storm_clients, probe, config.traffic_seed, (traffic.greedy[0], refs[0]))
    return results


def goals(results: dict) -> dict[str, bool]:
    """Each figure of RELIABILITY.md (G2, G3, G7) scaled to this run: met or not."""
    s = results["soak"]
    met = {"0 lost": s["lost"] == 0, "0 mangled": s["mangled"] == 0, "0 5xx": s["http_5xx"] == 0,
           "0 error events": not any(" " not in key for key in s["error_events"]),
           "KV integrity at every sample": s["integrity_failures"] == 0, "/admin/kv answered every sample": not s["kv_unanswered"]}
    for proc in ("server", "core"):
        if f"{proc}_rss_growth" in s:
            met[f"{proc} RSS growth <= 5%"] = s[f"{proc}_rss_growth"] <= RSS_GROWTH_GOAL
            fds, threads = s[f"{proc}_fds"], s[f"{proc}_threads"]  # threads: pools start on first use (grammar)
            met[f"{proc} fds back to baseline idle"] = fds["idle"] <= fds["baseline"] + 2
            met[f"{proc} threads flat after warm-up"] = threads["max"] <= threads["first"] + 2 >= threads["idle"]
    if "storm" in results:
        st = results["storm"]
        met |= {"storm: idle again, 0 pages in use": st["idle_after_s"] is not None and st["kv_in_use_after"] == 0,
                "storm: integrity ok": st["integrity_after"] == "ok", "storm: next request answers": st["next_request_ok"]}
    for name, figures in results.get("faults", {}).items():
        met[f"fault: {name}"] = figures["ok"]
    return met
