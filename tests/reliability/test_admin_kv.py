"""GET /admin/kv: the engine core checks its KV cache and counts the pages, for the admin key only."""

from __future__ import annotations

import httpx
import pytest

from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow

USER, ADMIN = "user-key-kv-1", "admin-key-kv-1"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_admin_kv")
    write_model_dir(path, "llama", seed=7)
    proc = start_server(path, "--served-model-name", "tiny", "--kv-cache-memory", "16MiB", "--max-model-len", "128",
                        "--api-key", USER, "--admin-api-key", ADMIN)
    yield proc
    assert proc.stop() == 0, proc.log()


def kv(server, key=ADMIN) -> httpx.Response:
    return httpx.get(f"{server.base_url}/admin/kv", headers={"Authorization": f"Bearer {key}"}, timeout=10)


def test_idle_the_pages_are_free_or_cached_and_add_up(server):
    before = kv(server).json()
    assert before["integrity"] == "ok" and before["integrity_error"] is None
    assert before["num_in_use"] == before["num_locked"] == before["num_running"] == before["num_waiting"] == 0
    r = httpx.post(f"{server.base_url}/v1/completions", headers={"Authorization": f"Bearer {USER}"}, timeout=60,
                   json={"prompt": "a prompt long enough to fill some pages of four tokens", "max_tokens": 8})
    assert r.status_code == 200, r.text
    after = kv(server).json()
    assert after["num_pages"] == after["num_free"] + after["num_cached"] + after["num_in_use"]
    assert after["num_in_use"] == 0 and after["num_cached"] > 0  # the prompt's pages stay cached, held by no one
    assert after["integrity"] == "ok"


def test_a_user_key_is_refused_and_no_key_is_unauthenticated(server):
    assert kv(server, USER).status_code == 403
    assert httpx.get(f"{server.base_url}/admin/kv").status_code == 401
