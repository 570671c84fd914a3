"""The admin routes see every process of a parallel model: two data-parallel replicas, each a tensor-parallel pair
(a core and its worker), behind one `banyan serve`. GET /admin/models counts each replica's worker in its
memory_bytes."""

from __future__ import annotations

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
    proc = start_server(model_dir, "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--num-threads", "1",
                        "--kv-cache-memory", "4MiB", "--admin-api-key", "admin-key")
    yield proc
    assert proc.stop() == 0, proc.log()


def admin_entry(server) -> dict:
    return httpx.get(f"{server.base_url}/admin/models", headers=ADMIN, timeout=10).json()["data"][0]


def test_memory_bytes_counts_each_replicas_tensor_parallel_worker(server):
    entry = admin_entry(server)
    for replica in entry["replicas"]:
        core, *workers = process_tree(replica["pid"])
        assert len(workers) == 1  # its rank 1
        assert replica["memory_bytes"] > resident_bytes(core) + 0.8 * resident_bytes(workers[0])  # RSS moves a bit
    assert entry["memory_bytes"] >= 0.9 * sum(r["memory_bytes"] for r in entry["replicas"])
