"""Data parallel: two engine cores behind one client and its router, on a multi-tenant workload (several long
system prompts, many users each); a server with two replicas, reported one by one, one of which dies and is
restarted after its first new core fails; and a replica whose new cores all fail, left down and routed around."""

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
from banyan.ipc import dp_client
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


ADMIN = {"Authorization": "Bearer admin-key"}


def admin_entry(base_url: str) -> dict:
    return httpx.get(f"{base_url}/admin/models", headers=ADMIN, timeout=10).json()["data"][0]


def test_a_server_reports_each_replica_and_survives_losing_one_whose_first_new_core_fails(model_dir):
    server = start_server(model_dir, "--data-parallel-size", "2", "--kv-cache-memory", "4MiB",
                          "--admin-api-key", "admin-key", "--fault", "fail-restarts=1")
    try:
        for i in range(4):
            r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 3}, timeout=60)
            assert r.status_code == 200, r.text
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        assert 'banyan:dp_replica_up{model_name="' in metrics and 'replica="1"} 1.0' in metrics
        assert "banyan:dp_router_prefix_hit_rate" in metrics and "banyan:dp_router_requests_total" in metrics
        kv = httpx.get(f"{server.base_url}/admin/kv", headers=ADMIN, timeout=10).json()
        assert [r["replica"] for r in kv["replicas"]] == [0, 1] and kv["integrity"] == "ok"
        for field in ("num_pages", "num_free", "num_cached", "num_in_use"):  # the totals are the replicas' sum
            assert kv[field] == sum(r[field] for r in kv["replicas"]), field
        assert all(r["num_pages"] > 0 and r["integrity"] == "ok" for r in kv["replicas"])
        entry = admin_entry(server.base_url)
        cores = children(server.proc.pid)
        assert sorted(r["pid"] for r in entry["replicas"]) == sorted(cores)
        assert all(r["memory_bytes"] > 100 << 20 for r in entry["replicas"])  # each core's RSS: torch and a model
        assert entry["memory_bytes"] >= sum(r["memory_bytes"] for r in entry["replicas"]) * 0.9  # both, not the first
        assert entry["kv_cache_tokens"] == sum(r["kv_cache_tokens"] for r in entry["replicas"]) == kv["num_pages"] * 4

        os.kill(entry["replicas"][0]["pid"], signal.SIGKILL)
        answered = [httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "after", "max_tokens": 2},
                               timeout=60).status_code for _ in range(4)]
        assert answered == [200] * 4  # the router stopped sending to the dead replica
        assert server.proc.poll() is None
        deadline = time.monotonic() + 300  # its first new core fails at start-up; the second, a second later, serves
        while replica_series(server.base_url, "dp_replica_up") != [1.0, 1.0] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert replica_series(server.base_url, "dp_replica_up") == [1.0, 1.0]
        assert replica_series(server.base_url, "dp_replica_failed_starts_total") == [1.0, 0.0]
        assert replica_series(server.base_url, "dp_replica_restarts_total") == [1.0, 0.0]
        replica = admin_entry(server.base_url)["replicas"][0]
        assert (replica["state"], replica["restarts"], replica["failed_starts"]) == ("up", 1, 1)
        assert "exited with status 1" in replica["last_error"]
        before = replica_series(server.base_url, "dp_router_requests_total")
        for i in range(4):  # new prompts: the router sends some to the new core (its tree is the smallest)
            assert httpx.post(f"{server.base_url}/v1/completions", json={"prompt": f"back {i} " * 4, "max_tokens": 2},
                              timeout=60).status_code == 200
        assert replica_series(server.base_url, "dp_router_requests_total")[0] > before[0]
        assert len(children(server.proc.pid)) == 2  # the dead core and the failed one reaped, the new one running
    finally:
        assert server.stop() == 0


def test_a_replica_whose_new_cores_all_fail_is_left_down_and_routed_around(model_dir):
    async def scenario() -> None:
        config = config_from_kwargs(dict(model=str(model_dir), num_threads=1, block_size=4, num_pages=48,
                                         data_parallel_size=2))
        client = await DataParallelClient.start(config, fault="fail-restarts=99", backoff=0.01)
        try:
            os.kill(client.replicas[0].pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while client.health[0].state != "down" and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            health = client.health[0]
            assert (health.state, health.restarts, health.failed_starts) == ("down", 0, dp_client.START_ATTEMPTS)
            assert client.alive() == [False, True] and client.is_alive()
            for i in range(4):
                request = AddRequest(f"r{i}", [5, 6, 7, i + 8], SamplingParams(max_tokens=2), time.time())
                assert [d async for d in client.generate(request)][-1].finish_reason is not None
            assert client.router.stats.per_replica[0] == 0  # every request went to the live replica
            assert children(os.getpid()) == [client.replicas[1].pid]  # no failed core left behind
        finally:
            await client.shutdown()

    asyncio.run(scenario())
