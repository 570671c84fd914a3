"""The engine core in its own process, through EngineClient: same outputs, aborts free pages, bad
requests fail alone, and a crashed, wedged or killed core is noticed within seconds.

Each client runs a real core subprocess on a tiny random Llama (CPU). Healthy-path tests share one
client on one module-wide event loop; every fault test starts its own.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from banyan.config import CacheConfig, EngineConfig, ModelConfig
from banyan.engine.engine import Engine
from banyan.ipc.client import EngineClient, EngineDeadError, RequestError
from banyan.ipc.messages import AddRequest
from banyan.sampling_params import SamplingParams
from tests.factories import write_model_dir

NUM_PAGES = 64  # of 4 tokens: 256 tokens of cache, while the model allows 512
PROMPT_LENGTHS = [3, 9, 17, 30]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    write_model_dir(path, "llama", seed=1)
    return path


def make_config(path: Path) -> EngineConfig:
    # Prefix caching off: a finished request's pages go back to the free list, so that "returns to
    # the idle baseline" is exact (with it on, they would stay cached in the tree).
    return EngineConfig(
        model=ModelConfig(model=str(path), device="cpu", num_threads=1),
        cache=CacheConfig(block_size=4, num_pages=NUM_PAGES, enable_prefix_caching=False),
    )


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def client(loop, model_dir):
    client = loop.run_until_complete(EngineClient.start(make_config(model_dir)))
    yield client
    loop.run_until_complete(client.shutdown())


def request(request_id: str, prompt: list[int], max_tokens: int = 12, **kw) -> AddRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return AddRequest(request_id, prompt, params, arrival_time=time.time())


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(length)]


async def collect(client: EngineClient, req: AddRequest) -> tuple[list[int], str]:
    tokens, reason = [], None
    async for delta in client.generate(req):
        tokens += delta.new_token_ids
        reason = delta.finish_reason
    return tokens, reason


async def collect_deltas(client: EngineClient, req: AddRequest) -> list:
    return [delta async for delta in client.generate(req)]


async def eventually(condition, timeout: float = 5.0) -> float:
    """Wait until condition() holds; returns the seconds it took."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def idle(client: EngineClient) -> bool:
    """The core reports nothing running and every page free (stats sent after the last request ended)."""
    s = client.stats
    return client.num_in_flight == 0 and s.num_running == s.num_waiting == 0 and s.num_free_pages == NUM_PAGES


# -- healthy path ----------------------------------------------------------------------------------
def test_ready_describes_the_engine(loop, client):
    assert client.info.architecture == "LlamaForCausalLM"
    assert (client.info.num_pages, client.info.page_size, client.info.device) == (NUM_PAGES, 4, "cpu")
    loop.run_until_complete(asyncio.sleep(0.3))  # a heartbeat or two
    assert client.stats.num_pages == NUM_PAGES
    assert client.is_alive() and client.is_making_progress(wedge_timeout=1)


def test_concurrent_greedy_equals_in_process_engine(loop, client, model_dir):
    prompts = [prompt_of(n, seed=n) for n in PROMPT_LENGTHS]
    engine = Engine(make_config(model_dir))
    expected = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, request(str(i), p, logprobs=2).sampling_params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            expected[delta.request_id] += delta.new_logprobs

    async def run():
        streams = (collect_deltas(client, request(f"g{i}", p, logprobs=2)) for i, p in enumerate(prompts))
        return await asyncio.gather(*streams)

    for i, deltas in enumerate(loop.run_until_complete(run())):
        got = [lp for d in deltas for lp in d.new_logprobs]
        assert [d.new_token_ids[0] for d in deltas] == [lp.token_id for lp in expected[str(i)]]
        assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in expected[str(i)]], abs=1e-4)
        assert all(len(lp.top) == 2 for lp in got)
        assert deltas[-1].finish_reason == "length" and deltas[0].queue_time is not None
    assert client.num_in_flight == 0


def test_abort_break_and_cancel_free_pages(loop, client):
    async def run():
        await eventually(lambda: idle(client))
        # 1. abort(): the stream ends with finish_reason "abort"
        stream = client.generate(request("a1", prompt_of(10), max_tokens=200))
        got = [await anext(stream), await anext(stream)]
        await client.abort(["a1"])
        got += [delta async for delta in stream]
        assert got[-1].finish_reason == "abort" and len(got) < 200
        await eventually(lambda: idle(client))
        # 2. the consumer breaks out early: the request is aborted in the core
        async for delta in client.generate(request("a2", prompt_of(10), max_tokens=200)):
            break
        await eventually(lambda: client.num_in_flight == 0)  # the loop closes the dropped generator
        await eventually(lambda: idle(client))
        # 3. the consuming task is cancelled (an HTTP client disconnected)
        first = asyncio.Event()

        async def consume():
            async for _ in client.generate(request("a3", prompt_of(10), max_tokens=200)):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await eventually(lambda: idle(client))

    loop.run_until_complete(asyncio.wait_for(run(), 30))


def test_bad_requests_fail_alone(loop, client):
    async def run():
        good = asyncio.create_task(collect(client, request("ok", prompt_of(8), max_tokens=20)))
        with pytest.raises(RequestError) as too_big:  # 10 + 300 tokens > 256 tokens of cache
            await collect(client, request("big", prompt_of(10), max_tokens=300))
        with pytest.raises(RequestError) as out_of_vocab:
            await collect(client, request("vocab", [5, 6, 10**6]))
        with pytest.raises(RequestError) as too_long:
            await collect(client, request("long", prompt_of(600)))
        tokens, reason = await good
        return too_big.value, out_of_vocab.value, too_long.value, tokens, reason

    too_big, out_of_vocab, too_long, tokens, reason = loop.run_until_complete(asyncio.wait_for(run(), 30))
    assert (too_big.status, too_big.type, too_big.code) == (400, "invalid_request_error", "request_too_large")
    assert (out_of_vocab.status, out_of_vocab.param) == (400, "prompt")
    assert (too_long.status, too_long.code) == (400, "context_length_exceeded")
    assert len(tokens) == 20 and reason == "length"
    assert client.is_alive() and client.num_in_flight == 0


def test_duplicate_request_id_is_refused(loop, client):
    async def run():
        first = client.generate(request("dup", prompt_of(5), max_tokens=50))
        await anext(first)
        with pytest.raises(RequestError) as dup:
            await collect(client, request("dup", prompt_of(5)))
        await first.aclose()
        return dup.value

    assert loop.run_until_complete(asyncio.wait_for(run(), 30)).param == "request_id"


# -- faults: each starts its own core --------------------------------------------------------------
def run_with_core(model_dir: Path, scenario, fault: str | None = None, timeout: float = 60):
    async def run():
        client = await EngineClient.start(make_config(model_dir), fault=fault)
        try:
            return await scenario(client)
        finally:
            await client.shutdown(timeout=5)

    return asyncio.run(asyncio.wait_for(run(), timeout))


def test_step_failure_fails_every_stream_and_exits_nonzero(model_dir):
    deaths = []

    async def scenario(client: EngineClient):
        client.on_death.append(deaths.append)
        started = time.monotonic()
        results = await asyncio.gather(
            *(collect(client, request(f"r{i}", prompt_of(6, i), max_tokens=50)) for i in range(3)),
            return_exceptions=True,
        )
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert time.monotonic() - started < 5
        await eventually(lambda: client.returncode is not None)
        assert client.returncode == 1 and not client.is_alive()
        with pytest.raises(EngineDeadError):
            await collect(client, request("late", prompt_of(6)))

    run_with_core(model_dir, scenario, fault="raise-after-steps=3")
    assert len(deaths) == 1 and "injected fault at step 3" in deaths[0]


def test_wedged_core_stops_making_progress(model_dir):
    async def scenario(client: EngineClient):
        stream = asyncio.create_task(collect(client, request("w", prompt_of(6), max_tokens=20)))
        took = await eventually(lambda: not client.is_making_progress(wedge_timeout=1), timeout=4)
        assert took > 0.5 and client.is_alive()  # alive, but stuck in its sleeping step
        tokens, _ = await stream  # the sleep ends and the core carries on
        assert len(tokens) == 20 and client.is_making_progress(wedge_timeout=1)

    run_with_core(model_dir, scenario, fault="sleep-after-steps=5:2.5")


def test_sigkill_fails_streams_and_cleans_up(model_dir):
    async def scenario(client: EngineClient):
        stream = client.generate(request("k", prompt_of(6), max_tokens=200))
        await anext(stream)
        os.kill(client.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert time.monotonic() - killed < 1.5
        assert not client.is_alive() and client.returncode == -signal.SIGKILL
        await client.shutdown()
        await client.shutdown()  # idempotent
        assert not os.path.exists(client.ipc_dir)
        with pytest.raises(ChildProcessError):  # reaped: no zombie left
            os.waitpid(client.pid, os.WNOHANG)

    run_with_core(model_dir, scenario)


def test_start_failure_reports_the_core_error(tmp_path):
    async def run():
        with pytest.raises(EngineDeadError) as e:
            await EngineClient.start(make_config(tmp_path / "no-such-model"))
        return str(e.value)

    message = asyncio.run(asyncio.wait_for(run(), 60))
    assert "no-such-model" in message


def test_sigterm_to_the_core_is_left_to_the_server(model_dir):
    async def scenario(client: EngineClient):
        stream = client.generate(request("t", prompt_of(6), max_tokens=200))
        await anext(stream)
        os.kill(client.pid, signal.SIGTERM)  # as a process-group signal would: the server drains first
        await asyncio.sleep(0.1)
        assert client.is_alive()
        await client.shutdown()  # the server's Shutdown ends what still runs (with "abort")
        deltas = [delta async for delta in stream]
        assert deltas[-1].finish_reason in ("abort", "length")
        assert client.returncode == 0 and not client.is_alive()

    run_with_core(model_dir, scenario)


ORPHAN_SERVER = """
import asyncio, sys
import msgspec
from banyan.config import EngineConfig
from banyan.ipc.client import EngineClient

async def main():
    client = await EngineClient.start(msgspec.json.decode(sys.argv[1], type=EngineConfig))
    print(client.pid, client.ipc_dir, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


ORPHAN_SERVER_WHILE_LOADING = """
import asyncio, sys, tempfile
import msgspec
from banyan.config import EngineConfig
from banyan.ipc.client import EngineClient

async def main():
    client = EngineClient(msgspec.json.decode(sys.argv[1], type=EngineConfig), tempfile.mkdtemp(), sys.argv[2])
    print(client.pid, client.ipc_dir, flush=True)  # not waiting for Ready: the core is loading
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.parametrize("stage", ["ready", "loading"])
def test_core_exits_when_its_server_is_killed(model_dir, stage):
    config = msgspec.json.encode(make_config(model_dir)).decode()
    script = [ORPHAN_SERVER, config] if stage == "ready" else [ORPHAN_SERVER_WHILE_LOADING, config, "sleep-while-loading=60"]
    server = subprocess.Popen([sys.executable, "-c", *script], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, cwd=Path(__file__).parents[2])  # fmt: skip
    try:
        pid, ipc_dir = server.stdout.readline().decode().split()
        assert os.path.exists(ipc_dir)
        if stage == "loading":  # the core's log comes through its server: wait until it is loading
            assert any(b"while loading" in line for line in server.stderr), "the core never started loading"
    finally:
        server.kill()
        server.wait()
    deadline = time.monotonic() + 5
    while process_running(int(pid)):
        assert time.monotonic() < deadline, "the orphaned core is still running"
        time.sleep(0.05)
    assert not os.path.exists(ipc_dir)  # it removed the dead server's sockets


def test_core_outlives_the_thread_that_started_it(model_dir):
    # Linux sends the parent-death signal when the *thread* that started the core ends: not a death.
    loop, started = asyncio.new_event_loop(), []
    thread = threading.Thread(target=lambda: started.append(loop.run_until_complete(EngineClient.start(make_config(model_dir)))))
    thread.start()
    thread.join()  # Ready came (the core's signal was set long before), then the thread ended
    client = started[0]

    async def still_serving():
        await asyncio.sleep(0.5)
        return await collect(client, request("t", prompt_of(4), max_tokens=3))

    try:
        tokens, reason = loop.run_until_complete(asyncio.wait_for(still_serving(), 30))
        assert len(tokens) == 3 and reason == "length" and client.is_alive()
    finally:
        loop.run_until_complete(client.shutdown())
        loop.close()


def process_running(pid: int) -> bool:
    """True while the process exists and is not a zombie (an orphan is reaped by init, not by us)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"
