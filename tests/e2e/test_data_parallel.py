"""Data parallel: two engine cores behind one client and its router, on a multi-tenant workload (several long
system prompts, many users each); and a server with two replicas, one of which dies and is restarted."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time

import httpx
import pytest

from banyan.config_args import config_from_kwargs
from banyan.ipc.dp_client import DataParallelClient
from banyan.ipc.messages import AddRequest
from banyan.sampling_params import SamplingParams
from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow

TENANTS, SYSTEM_TOKENS, QUESTION_TOKENS, ROUNDS = 5, 48, 8, 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dp_llama")
    write_model_dir(path, "llama", seed=6)
    return path


def multi_tenant_prompts(vocab: int = 384) -> list[list[int]]:
    """ROUNDS rounds in which each tenant's next user asks a question after the tenant's system prompt.

    Each replica's cache (48 pages of 4 tokens) holds three system prompts (12 pages each) and the running
    requests; five do not fit. Round robin sends every tenant to both replicas, so each cycles through five
    system prompts and LRU evicts each before its turn comes again; cache-aware keeps each tenant on one."""
    rng = random.Random(1)
    systems = [[rng.randrange(3, vocab) for _ in range(SYSTEM_TOKENS)] for _ in range(TENANTS)]
    return [system + [rng.randrange(3, vocab) for _ in range(QUESTION_TOKENS)]
            for _ in range(ROUNDS) for system in systems]


async def serve_workload(model_dir, policy: str, prompts, concurrency: int = 4):
    """(prefix hit rate over the prompts' tokens, requests per replica)."""
    config = config_from_kwargs(dict(model=str(model_dir), num_threads=1, block_size=4, num_pages=48,
                                     data_parallel_size=2, router_policy=policy))
    client = await DataParallelClient.start(config)
    cached, slots = [0] * len(prompts), asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with slots:
            request = AddRequest(f"r{i}", prompts[i], SamplingParams(max_tokens=2, ignore_eos=True), time.time())
            async for delta in client.generate(request):
                cached[i] = delta.num_cached_tokens

    try:
        for start in range(0, len(prompts), concurrency):  # in order: each batch of users after the one before
            await asyncio.gather(*(one(i) for i in range(start, min(start + concurrency, len(prompts)))))
        return sum(cached) / sum(map(len, prompts)), list(client.router.stats.per_replica)
    finally:
        await client.shutdown()


def test_cache_aware_routing_hits_the_prefix_cache_3x_more_than_round_robin(model_dir):
    prompts = multi_tenant_prompts()
    rr_hit_rate, _ = asyncio.run(serve_workload(model_dir, "round_robin", prompts))
    ca_hit_rate, per_replica = asyncio.run(serve_workload(model_dir, "cache_aware", prompts))
    assert ca_hit_rate >= 3 * rr_hit_rate and ca_hit_rate > 0.5, (rr_hit_rate, ca_hit_rate)
    assert min(per_replica) >= 0.25 * len(prompts)  # no replica starved


def children(pid: int) -> list[int]:
    return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]


def replica_series(base_url: str, name: str) -> list[float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    found = re.findall(rf'^banyan:{name}{{[^}}]*replica="(\d+)"}} (\S+)$', text, re.MULTILINE)
    return [float(v) for _, v in sorted(found)]


def test_a_server_with_two_replicas_serves_reports_each_and_survives_losing_one(model_dir):
    server = start_server(model_dir, "--data-parallel-size", "2", "--kv-cache-memory", "4MiB")
    try:
        for i in range(4):
            r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 3}, timeout=60)
            assert r.status_code == 200, r.text
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        assert 'banyan:dp_replica_up{model_name="' in metrics and 'replica="1"} 1.0' in metrics
        assert "banyan:dp_router_prefix_hit_rate" in metrics and "banyan:dp_router_requests_total" in metrics
        cores = children(server.proc.pid)
        assert len(cores) == 2
        os.kill(cores[0], signal.SIGKILL)
        answered = [httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "after", "max_tokens": 2},
                               timeout=60).status_code for _ in range(4)]
        assert answered == [200] * 4  # the router stopped sending to the dead replica
        assert server.proc.poll() is None
        deadline = time.monotonic() + 300  # a new core takes the dead one's place
        while replica_series(server.base_url, "dp_replica_up") != [1.0, 1.0] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert replica_series(server.base_url, "dp_replica_up") == [1.0, 1.0]
        before = replica_series(server.base_url, "dp_router_requests_total")
        for i in range(4):  # new prompts: the router sends some to the new core (its tree is the smallest)
            assert httpx.post(f"{server.base_url}/v1/completions", json={"prompt": f"back {i} " * 4, "max_tokens": 2},
                              timeout=60).status_code == 200
        assert replica_series(server.base_url, "dp_router_requests_total")[0] > before[0]
        assert len(children(server.proc.pid)) == 2  # the dead core reaped, its replacement running
    finally:
        assert server.stop() == 0
