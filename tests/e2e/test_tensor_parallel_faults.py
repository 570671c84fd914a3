"""A tensor-parallel worker that dies or hangs: the engine fails within the collective timeout, in-flight
requests get an error, a server exits non-zero, and no process outlives it (no zombie, no orphan)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from banyan import LLM, SamplingParams
from banyan.errors import WorkerError
from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_faults")
    write_model_dir(path, "llama", seed=5)
    return path


@pytest.mark.parametrize("split, fault, message", [
    ("tensor_parallel_size", "exit-at-step=3", r"worker rank 1 \(exit status 3\) died"),
    ("tensor_parallel_size", "hang-at-step=3", "waited past --distributed-timeout"),
    ("pipeline_parallel_size", "hang-at-step=3", "waited past --distributed-timeout"),
])
def test_a_worker_that_dies_or_hangs_fails_the_engine(model_dir, split, fault, message):
    llm = LLM(str(model_dir), num_threads=1, worker_fault=fault, distributed_timeout=2.0, **{split: 2})
    workers = llm.engine.runner.workers
    started = time.monotonic()
    with pytest.raises(WorkerError, match=message):
        llm.generate(["The quick brown fox"] * 3, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - started < 30  # the 2 s timeout, not a hang
    assert all(proc.returncode is not None for proc in workers.procs)  # reaped: no zombie, no orphan


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_a_killed_worker_errors_the_stream_and_the_server_exits_nonzero(model_dir):
    # The core sleeps 2 s in its third step: the stream is still running when the worker is killed.
    server = start_server(model_dir, "--tensor-parallel-size", "2", "--distributed-timeout", "5",
                          "--kv-cache-memory", "4MiB", "--fault", "sleep-after-steps=3:2")
    try:
        (core,) = children(server.proc.pid)
        (worker,) = children(core)
        body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(worker, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2]
        assert server.proc.wait(timeout=30) not in (0, None)
        deadline = time.monotonic() + 10
        while (alive(core) or alive(worker)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(core) and not alive(worker)
    finally:
        server.stop(signal.SIGKILL)
