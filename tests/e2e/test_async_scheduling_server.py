"""`banyan serve --async-scheduling`: the engine core in its own process with a step in flight answers as the plain
offline engine (concurrent completions, a stop string in a stream), and a client that leaves mid-stream aborts its
request with its token in flight and leaks no page (docs/gpu.md, overlap scheduling)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from banyan import LLM, SamplingParams
from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow

ADMIN_KEY = "admin-async-0001"
PROMPTS = ["The quick brown fox", "def add(a, b):", "Radix trees share", "One two three"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_async")
    write_model_dir(path, "llama", seed=4)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    proc = start_server(model_dir, "--served-model-name", "tiny", "--kv-cache-memory", "64MiB", "--max-model-len", "256",
                        "--async-scheduling", "--admin-api-key", ADMIN_KEY)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), block_size=4, num_threads=1, max_model_len=256)


def test_concurrent_completions_equal_the_plain_engine(client, offline):
    def complete(i):
        return client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=6 + 3 * i, temperature=0).choices[0]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(complete, range(len(PROMPTS))))
    for i, choice in enumerate(got):
        want = offline.generate([PROMPTS[i]], SamplingParams(temperature=0, max_tokens=6 + 3 * i), use_tqdm=False)
        assert (choice.text, choice.finish_reason) == (want[0].outputs[0].text, want[0].outputs[0].finish_reason)


def test_a_stop_string_ends_the_stream_as_plain(client, offline):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = offline.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].text
    stop = full[4:7]
    want = offline.generate([PROMPTS[0]], params.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop],
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_client_that_leaves_mid_stream_leaks_no_page(server, client):
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i == 5:
                break  # gone with tokens still to come: the core aborts the request, its token in flight too
    assert client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=3, temperature=0).choices[0].text
    kv = httpx.get(f"{server.base_url}/admin/kv", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10).json()
    assert kv["integrity"] == "ok" and kv["num_in_use"] == 0 and kv["num_running"] == kv["num_waiting"] == 0, kv
