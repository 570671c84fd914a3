"""The reliability tier's short run (CI): `banyan bench soak` scaled down, and faults injected under load.

The long tier is the same code at full size (docs/reliability.md):
    banyan bench soak --streams 512 --minutes 60 --storm-clients 1000
Here: 48 streams for 24 s on a tiny random model, then a 200-client disconnect storm. Every correctness figure must
be met exactly; memory only as a gross-leak guard (the 5% goal needs a warm-up longer than CI can afford).
"""

from __future__ import annotations

import asyncio

import pytest

from banyan.bench.launcher import free_port, launched_process
from banyan.bench.soak import SoakConfig, run_soak
from banyan.bench.soak_faults import disk_full, kill_core, slow_reader, terminate
from banyan.config import CacheConfig, EngineConfig, ModelConfig
from tests.factories import write_model_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> EngineConfig:
    path = tmp_path_factory.mktemp("tiny_soak")
    write_model_dir(path, "llama", seed=11)
    return EngineConfig(model=ModelConfig(model=str(path), max_model_len=512, num_threads=1),
                        cache=CacheConfig(block_size=4, kv_cache_memory=64 << 20))


def test_a_short_soak_and_storm_lose_and_mangle_nothing(engine):
    results = run_soak(engine, SoakConfig(streams=48, minutes=0.4, storm_clients=200, sample_seconds=1.0),
                       on_progress=lambda _: None)
    soak, storm = results["soak"], results["storm"]
    assert soak["checked"] > 100, soak  # the checks ran on real answers
    # memory and the admin route's latency under load are figures of the long tier; here a gross-leak guard only
    correctness = {k: v for k, v in results["goals"].items() if "RSS" not in k and "/admin/kv" not in k}
    missed = [k for k, ok in correctness.items() if not ok]
    figures = {k: soak.get(k) for k in ("server_fds", "server_threads", "core_fds", "core_threads")}
    assert not missed, (missed, figures, soak["examples"], soak["error_events"], storm)
    assert soak["server_rss_growth"] < 0.25 and soak["core_rss_growth"] < 0.25, soak
    assert results["exit_status"] == 0


def served(engine: EngineConfig, *flags: str, output: str | None = None):
    from banyan.bench.launcher import banyan_serve_cmd

    port = free_port()
    return launched_process(banyan_serve_cmd(engine, port) + list(flags), port, ready_timeout=300, output=output)


def test_sigkill_of_the_core_under_load_errors_every_stream_and_exits_nonzero(engine):
    with served(engine) as (base_url, proc):
        figures = asyncio.run(kill_core(base_url, proc, streams=8))
    assert figures["ok"], figures


def test_sigterm_under_load_drains_then_exits_zero(engine):
    with served(engine, "--shutdown-timeout", "60") as (base_url, proc):
        figures = asyncio.run(terminate(base_url, proc, streams=8))
    assert figures["ok"], figures
    assert figures["finished"] == {"length": 8}  # drained: all ran to max_tokens within the timeout


def test_a_full_disk_for_logs_costs_no_request(engine):
    # every log line, the start-up banner and the audit log's included, fails with ENOSPC (the banner used to
    # end the server at start-up)
    with served(engine, output="/dev/full") as (base_url, proc):
        figures = asyncio.run(disk_full(base_url, proc, streams=4))
    assert figures["ok"], figures


@pytest.mark.long
def test_clients_that_never_read_cost_no_memory_growth(engine):
    with served(engine) as (base_url, proc):
        figures = asyncio.run(slow_reader(base_url, proc, readers=4, seconds=30))
    assert figures["ok"], figures
