"""The admin routes see every process of a parallel model: two data-parallel replicas, each a tensor-parallel pair
(a core and its worker), behind one `banyan serve`. GET /admin/models counts each replica's worker in its
memory_bytes; POST /start_profile and /stop_profile reach every replica's core, each writing its own trace."""

from __future__ import annotations

import json

import httpx
import pytest

from banyan.server.model_memory import process_tree, resident_bytes
from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow

ADMIN = {"Authorization": "Bearer admin-key"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("parallel_admin")
    write_model_dir(model_dir, "llama", seed=2)
    profile_dir = tmp_path_factory.mktemp("profiles")
    proc = start_server(model_dir, "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--num-threads", "1",
                        "--kv-cache-memory", "4MiB", "--admin-api-key", "admin-key", "--profile-dir", str(profile_dir))
    proc.profile_dir = profile_dir
    yield proc
    assert proc.stop() == 0, proc.log()


def admin_entry(server) -> dict:
    return httpx.get(f"{server.base_url}/admin/models", headers=ADMIN, timeout=10).json()["data"][0]


def complete(server, prompt: str) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": prompt, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text


def test_memory_bytes_counts_each_replicas_tensor_parallel_worker(server):
    entry = admin_entry(server)
    for replica in entry["replicas"]:
        core, *workers = process_tree(replica["pid"])
        assert len(workers) == 1  # its rank 1
        assert replica["memory_bytes"] > resident_bytes(core) + 0.8 * resident_bytes(workers[0])  # RSS moves a bit
    assert entry["memory_bytes"] >= 0.9 * sum(r["memory_bytes"] for r in entry["replicas"])


def test_profiling_reaches_every_replica_each_into_its_own_trace(server):
    assert httpx.post(f"{server.base_url}/start_profile", headers=ADMIN, timeout=60).json() == {"profiling": True}
    for i in range(4):  # the router spreads them (equal prompts would stay on one replica: cache-aware)
        complete(server, f"request {i} " * (i + 1))
    stopped = httpx.post(f"{server.base_url}/stop_profile", headers=ADMIN, timeout=120).json()
    paths = next(iter(stopped["replica_traces"].values()))
    pids = [r["pid"] for r in admin_entry(server)["replicas"]]
    assert len(paths) == 2 and stopped["trace"] == paths[0]
    for path, pid in zip(paths, pids, strict=True):
        assert path.startswith(f"{server.profile_dir}/banyan-core-{pid}-")  # its own core's file
        assert json.loads(open(path).read())["traceEvents"]
    again = httpx.post(f"{server.base_url}/stop_profile", headers=ADMIN, timeout=60)
    assert again.status_code == 409 and again.json()["error"]["code"] == "profiler_state"
