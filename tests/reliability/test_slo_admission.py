"""Deadline-aware scheduling over HTTP: under --scheduling-policy slo a request the queue would make miss its
targets is refused at once with 503 slo_unattainable and Retry-After, streamed or not; one that can make it runs.

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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_slo")
    write_model_dir(path, "llama", seed=8)
    proc = start_server(path, "--served-model-name", "tiny", "--kv-cache-memory", "16MiB", "--max-model-len", "128",
                        "--scheduling-policy", "slo", "--max-num-seqs", "1", *SLOW)
    yield proc
    assert proc.stop() == 0, proc.log()


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
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
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
    r = httpx.post(f"{server.base_url}/v1/completions", json=body(slo), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("slo."), r.text
