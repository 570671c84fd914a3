"""Deadline-aware scheduling over HTTP: under --scheduling-policy slo a request the queue would make miss its
targets is refused at once with 503 slo_unattainable and Retry-After, streamed or not; one that can make it runs.
When one API key's own backlog is the cause (it holds more than its share of the requests in flight), the refusal
is 429 to that key, and a light key beside it is served.

Every step of this server sleeps 0.1 s first (--fault sleep-every-step), so the measured step time is at least
that on any machine: a 50 ms TTFT target (a first token needs a step) and a 20 ms TPOT target are out of reach,
a 10-minute one never is.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow

SLOW = "--fault", "sleep-every-step=0.1"
FLOOD, LIGHT = "key-slo-flood-0001", "key-slo-light-0001"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_slo")
    write_model_dir(path, "llama", seed=8)
    proc = start_server(path, "--served-model-name", "tiny", "--kv-cache-memory", "16MiB", "--max-model-len", "128",
                        "--scheduling-policy", "slo", "--max-num-seqs", "1", "--api-key", FLOOD, "--api-key", LIGHT,
                        *SLOW)
    yield proc
    assert proc.stop() == 0, proc.log()


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def body(slo: dict, stream: bool = False, max_tokens: int = 4) -> dict:
    return {"prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True, "slo": slo, "stream": stream}


async def refused_once_measured(http: httpx.AsyncClient, request: dict, deadline: float) -> httpx.Response:
    """Send `request` until the server has measured a queue and refuses it (it runs while nothing is measured)."""
    while time.monotonic() < deadline:
        r = await http.post("/v1/completions", json=request)
        if r.status_code == 503:
            return r
        assert r.status_code == 200, r.text
    raise AssertionError("never refused")


def test_unreachable_targets_are_refused_early_and_reachable_ones_served(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, headers=auth(LIGHT)) as http:
            # a queue behind one running request: the core measures steps and its pace
            backlog = [asyncio.ensure_future(http.post("/v1/completions", json=body({"ttft_ms": 600_000},
                                                                                     max_tokens=8)))
                       for _ in range(3)]
            deadline = time.monotonic() + 60
            tight = await refused_once_measured(http, body({"ttft_ms": 50}), deadline)
            tight_stream = await refused_once_measured(http, body({"ttft_ms": 50}, stream=True), deadline)
            slow_tokens = await refused_once_measured(http, body({"tpot_ms": 20}), deadline)
            relaxed = await http.post("/v1/completions", json=body({"ttft_ms": 600_000, "tpot_ms": 60_000}))
            return tight, tight_stream, slow_tokens, relaxed, await asyncio.gather(*backlog)

    tight, tight_stream, slow_tokens, relaxed, backlog = asyncio.run(run())
    for r in (tight, tight_stream, slow_tokens):
        error = r.json()["error"]
        assert (error["code"], error["type"]) == ("slo_unattainable", "server_error"), error
        assert int(r.headers["retry-after"]) >= 1
    assert "50 ms ttft" in tight.json()["error"]["message"]
    assert "20 ms tpot" in slow_tokens.json()["error"]["message"]
    assert relaxed.status_code == 200 and relaxed.json()["usage"]["completion_tokens"] == 4
    assert all(r.status_code == 200 for r in backlog)


@pytest.mark.parametrize("slo", [{"ttft_ms": 0}, {"ttft_ms": -5}, {"tpot_ms": "fast"}, {"ttft_ms": 1e12}])
def test_bad_targets_are_400_naming_the_field(server, slo):
    r = httpx.post(f"{server.base_url}/v1/completions", json=body(slo), timeout=30, headers=auth(LIGHT))
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("slo."), r.text


def test_a_key_flooding_the_queue_gets_429_and_a_light_key_is_served(server):
    """24 clients of one key and one of another send back to back; every request wants its first token within 5 s.
    One request runs at a time, for 2 steps of >= 0.1 s: a flood request waits behind ~24 others, >= 5 s, and is
    refused with 429 naming its key's share; the light key's request waits behind about one of the flood's turns
    and is served. On a machine too loaded for even that (steps near 1 s), the light key gets the server's 503
    now and then, never a 429."""
    request = {"prompt": "hello there", "max_tokens": 2, "ignore_eos": True, "slo": {"ttft_ms": 5000}}

    async def client(http: httpx.AsyncClient, key: str, until: float) -> list[httpx.Response]:
        answers = []
        while time.monotonic() < until:
            answers.append(await http.post("/v1/completions", json=request, headers=auth(key)))
            if answers[-1].status_code != 200:
                await asyncio.sleep(0.05)  # the refusals leave the engine the CPU's time
        return answers

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            until = time.monotonic() + 15
            flood = [client(http, FLOOD, until) for _ in range(24)]
            return await asyncio.gather(client(http, LIGHT, until), *flood)

    light, *flood = asyncio.run(run())
    flood = [r for answers in flood for r in answers]
    refused = [r for r in flood if r.status_code == 429]
    # 503 while the light key has nothing in flight (between two of its requests): the flood alone is the load
    assert refused and {r.status_code for r in flood} <= {200, 429, 503}, {r.status_code: r.text for r in flood}
    for r in refused:
        error = r.json()["error"]
        assert (error["code"], error["type"]) == ("slo_unattainable", "rate_limit_error"), error
        assert "more than its share" in error["message"] and int(r.headers["retry-after"]) >= 1
    served = [r for r in light if r.status_code == 200]
    assert len(served) >= 3 and {r.status_code for r in light} <= {200, 503}, [r.text for r in light]
