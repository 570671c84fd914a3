"""The CPU KV pool without --kv-cache-memory: what /proc/meminfo and the cgroup limits say is free (read from files
written here, never the machine's own), the sizing arithmetic, the runner's pool and log line, the settings that
override it, and that processes sizing at once (replicas, ranks, the models of one server) never share out more
than there is."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from pathlib import Path

import pytest
import torch

from banyan import LLM
from banyan.config import EngineConfig, ModelConfig, ParallelConfig
from banyan.distributed import ray_cluster
from banyan.errors import InvalidParameterError
from banyan.engine.engine import Engine
from banyan.host_memory import CPU_KV_ENV, V1_UNLIMITED, HostMemory, read_host_memory
from banyan.runner import model_runner
from banyan.runner import memory
from banyan.runner.memory import CpuKVSizing, activation_bytes

GiB, MiB = 1 << 30, 1 << 20


def write_host(root: Path, available: int, total: int, cgroup: str = "0::/\n", files: dict | None = None):
    """A /proc (meminfo, self/cgroup) and a cgroup mount under root; `files`: cgroup file -> contents."""
    (root / "proc" / "self").mkdir(parents=True, exist_ok=True)
    (root / "proc" / "meminfo").write_text(f"MemTotal: {total // 1024} kB\nMemFree: 1 kB\n"
                                           f"MemAvailable: {available // 1024} kB\n")
    (root / "proc" / "self" / "cgroup").write_text(cgroup)
    for name, text in (files or {}).items():
        (root / "cg" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "cg" / name).write_text(text)
    return functools.partial(read_host_memory, proc=root / "proc", cgroup_root=root / "cg")


# -- what is free -------------------------------------------------------------------------------------------
def test_without_a_cgroup_limit_it_is_meminfo(tmp_path):
    host = write_host(tmp_path, 20 * GiB, 24 * GiB, files={"memory.max": "max\n", "memory.current": "123\n"})()
    assert host == HostMemory(20 * GiB, 24 * GiB, "MemAvailable")
    assert host.reserve == int(0.1 * 24 * GiB)  # 10% of the memory...
    assert HostMemory(GiB, 4 * GiB, "MemAvailable").reserve == GiB  # ...and at least 1 GiB


def test_a_v2_limit_leaves_its_limit_less_usage_less_inactive_file_cache(tmp_path):
    host = write_host(tmp_path, 20 * GiB, 24 * GiB, files={
        "memory.max": f"{4 * GiB}\n", "memory.current": f"{3 * GiB}\n",
        "memory.stat": f"anon {2 * GiB}\ninactive_file {GiB}\nactive_file 0\n"})()
    assert (host.available, host.total) == (2 * GiB, 4 * GiB)
    assert host.limited_by.endswith("cg/memory.max - usage")


def test_a_v1_limit_on_a_parent_cgroup_counts_and_no_limit_is_none(tmp_path):
    host = write_host(tmp_path, 20 * GiB, 24 * GiB, cgroup="4:memory:/pods/pod1\n0::/\n", files={
        "memory/pods/pod1/memory.limit_in_bytes": f"{V1_UNLIMITED + 4096}\n",  # v1's "no limit"
        "memory/pods/pod1/memory.usage_in_bytes": f"{GiB}\n",
        "memory/pods/memory.limit_in_bytes": f"{8 * GiB}\n", "memory/pods/memory.usage_in_bytes": f"{5 * GiB}\n",
        "memory/pods/memory.stat": "inactive_file 999\ntotal_inactive_file 0\n"})()
    assert (host.available, host.total) == (3 * GiB, 8 * GiB) and "pods/memory.limit_in_bytes" in host.limited_by


def test_the_smallest_of_meminfo_v1_and_v2_wins(tmp_path):
    files = {"memory.max": f"{16 * GiB}", "memory.current": f"{GiB}",  # 15 GiB left
             "memory/memory.limit_in_bytes": f"{12 * GiB}", "memory/memory.usage_in_bytes": f"{GiB}"}  # 11 GiB
    read = write_host(tmp_path, 9 * GiB, 24 * GiB, cgroup="5:memory:/\n0::/\n", files=files)
    assert read() == HostMemory(9 * GiB, 12 * GiB, "MemAvailable")
    (tmp_path / "proc" / "meminfo").write_text(f"MemTotal: {24 * GiB // 1024} kB\nMemAvailable: {14 * GiB // 1024} kB\n")
    assert read().available == 11 * GiB and read().limited_by.endswith("memory.limit_in_bytes - usage")


def test_a_container_seeing_its_host_path_reads_its_own_mount(tmp_path):
    """/proc/self/cgroup names the container's cgroup from the host; the mount is the container's cgroup itself."""
    host = write_host(tmp_path, 20 * GiB, 24 * GiB, cgroup="0::/system.slice/docker-abc.scope\n",
                      files={"memory.max": f"{6 * GiB}", "memory.current": f"{GiB}"})()
    assert (host.available, host.total) == (5 * GiB, 6 * GiB)


# -- the arithmetic -----------------------------------------------------------------------------------------
HOST = HostMemory(available=20 * GiB, total=24 * GiB, limited_by="MemAvailable")  # reserve 2.4 GiB


def test_the_pool_is_what_is_left_after_weights_reserve_and_activations():
    sizing = CpuKVSizing(HOST, weights=GiB, activations=GiB // 2, pools=1, useful=100 * GiB)
    # available is read after this process's weights: 20 GiB + 1 - 2.4 reserve - 1 weights - 0.5 activations
    assert sizing.budget == sizing.share == 20 * GiB - HOST.reserve - GiB // 2
    line = sizing.describe()
    assert "20.00 GiB available (MemAvailable) of 24.00 GiB after the weights (1.00 GiB) - reserve 2.40 GiB" in line
    assert "activations 0.50 GiB = 17.10 GiB" in line and "capped" not in line
    two = CpuKVSizing(HOST, weights=GiB, activations=0, pools=2, useful=100 * GiB)
    assert two.budget == (21 * GiB - HOST.reserve) // 2 - GiB and "/ 2 pools on this host - weights 1.00" in two.describe()


def test_the_pool_is_capped_at_what_the_scheduler_can_fill():
    sizing = CpuKVSizing(HOST, weights=GiB, activations=0, pools=1, useful=3 * GiB)
    assert sizing.budget == 3 * GiB and "capped" in sizing.describe()


def test_a_model_that_leaves_nothing_gets_nothing():
    assert CpuKVSizing(HostMemory(GiB, 2 * GiB, "x"), weights=GiB, activations=GiB, pools=1, useful=GiB).budget == 0


@pytest.mark.parametrize("pools", [2, 3, 8])
def test_pools_sized_at_once_never_exceed_what_the_host_had(pools):
    """Each process reads after its own weights; the others' loads and pools may or may not be in yet."""
    host_free, weights, activations = 40 * GiB, 3 * GiB, GiB // 4
    reserve = HostMemory(0, host_free, "").reserve

    def sized(seen_before: int) -> int:  # what the host still had when this process read it
        host = HostMemory(seen_before - weights, host_free, "MemAvailable")
        return CpuKVSizing(host, weights, activations, pools, useful=1 << 50).budget

    first = sized(host_free)  # nobody else has loaded anything yet
    orders = {
        "everyone sees an empty host": [sized(host_free)] * pools,
        "one after the other": _one_after_the_other(sized, host_free, weights + activations, pools),
        "everyone sees the others' weights only": [sized(host_free - i * weights) for i in range(pools)],
    }
    for order, budgets in orders.items():
        assert sum(budgets) + pools * (weights + activations) <= host_free - reserve, order
    assert first * pools + pools * (weights + activations) == pytest.approx(host_free - reserve, abs=pools)


def _one_after_the_other(sized, free: int, per_process: int, pools: int) -> list[int]:
    budgets = []
    for _ in range(pools):
        budgets.append(sized(free))
        free -= per_process + budgets[-1]
    return budgets


# -- the runner ---------------------------------------------------------------------------------------------
@pytest.fixture
def tiny(tiny_llama_dir):
    return tiny_llama_dir


@pytest.fixture
def auto(monkeypatch):
    """No $BANYAN_CPU_KV_CACHE_MEMORY (the suite's conftest sets one): pools are sized from free memory."""
    monkeypatch.delenv(CPU_KV_ENV, raising=False)
    return monkeypatch


def tiny_llm(tiny, **kwargs) -> LLM:
    return LLM(str(tiny), device="cpu", block_size=4, num_threads=1, dtype="float32", **kwargs)


def test_a_large_host_fills_the_cap_and_logs_the_numbers(tiny, tmp_path, auto, caplog):
    auto.setattr(memory, "read_host_memory", write_host(tmp_path, 64 * GiB, 128 * GiB))
    with caplog.at_level(logging.INFO, logger=model_runner.__name__):
        runner = tiny_llm(tiny, max_num_seqs=8).engine.runner
    assert runner.num_pages * 4 == 8 * 512  # 8 requests of the full 512-token context: no more
    line = next(r.message for r in caplog.records if r.message.startswith("KV cache:"))
    assert "= 4096 tokens" in line and "64.00 GiB available (MemAvailable) of 128.00 GiB" in line
    assert "reserve 12.80 GiB" in line and "capped" in line


def test_a_small_host_gets_what_is_left(tiny, tmp_path, auto):
    runner = tiny_llm(tiny, num_pages=4).engine.runner  # only to read the shapes
    per_token, limits = runner.arch.kv_bytes_per_token(runner.kv_dtype.itemsize), runner.limits
    activations = activation_bytes(runner.arch, limits.max_num_batched_tokens, limits.max_num_seqs, runner.arch.vocab_size)
    free_after_weights = GiB + activations + 100 * 4 * per_token  # the 1 GiB reserve, activations, 100 pages
    auto.setattr(memory, "read_host_memory", write_host(tmp_path, free_after_weights, 2 * GiB))
    assert tiny_llm(tiny).engine.runner.num_pages == 100


def test_kv_cache_memory_wins_then_the_environment(tiny, tmp_path, auto):
    auto.setattr(memory, "read_host_memory", write_host(tmp_path, 64 * GiB, 128 * GiB))
    runner = tiny_llm(tiny, num_pages=4).engine.runner
    per_page = 4 * runner.arch.kv_bytes_per_token(runner.kv_dtype.itemsize)
    auto.setenv(CPU_KV_ENV, "1MiB")
    assert tiny_llm(tiny).engine.runner.num_pages == MiB // per_page
    assert tiny_llm(tiny, kv_cache_memory=2 * MiB).engine.runner.num_pages == 2 * MiB // per_page


def test_the_environment_size_is_capped_at_what_the_scheduler_can_fill(tiny, auto):
    auto.setenv(CPU_KV_ENV, "1GiB")  # thousands of full contexts of the tiny model: 8 can ever run
    assert tiny_llm(tiny, max_num_seqs=8).engine.runner.num_pages * 4 == 8 * 512
    assert tiny_llm(tiny, max_num_seqs=8, kv_cache_memory=64 * MiB).engine.runner.num_pages * 4 > 8 * 512  # asked for


def test_a_malformed_environment_size_is_named(tiny, auto):
    auto.setenv(CPU_KV_ENV, "lots")
    with pytest.raises(Exception, match=CPU_KV_ENV):
        tiny_llm(tiny)


def test_replicas_and_ranks_each_size_their_share(tiny):
    """The engine tells its runner how many pools this host sizes at once: data-parallel x tensor x pipeline."""
    seen = {}

    class Stop(Exception):
        pass

    def runner(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    for parallel, pools in [(ParallelConfig(data_parallel_size=3), 3),
                            (ParallelConfig(data_parallel_size=3, replicas_on_host=2), 2)]:  # one on another node
        config = EngineConfig(model=ModelConfig(model=str(tiny), device="cpu"), parallel=parallel)
        with pytest.raises(Stop):
            Engine(config, runner_factory=runner)
        assert seen["pools_on_host"] == pools
    assert ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2).processes == 8


# -- which processes share this host ------------------------------------------------------------------------
def test_local_processes_all_share_the_host():
    parallel = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    assert parallel.pools_on_host() == 8


def test_only_the_replicas_and_ranks_ray_put_on_this_node_count():
    spread = ParallelConfig(tensor_parallel_size=2, data_parallel_size=4, replicas_on_host=1)  # one replica a node
    assert spread.pools_on_host() == 2  # its own two ranks: not the 8 processes of the four replicas
    assert spread.pools_on_host(ranks_here=1) == 1  # and Ray put its worker on another node
    assert ParallelConfig(tensor_parallel_size=4, data_parallel_size=2).pools_on_host(ranks_here=3) == 6
    with pytest.raises(InvalidParameterError, match="replicas_on_host"):
        ParallelConfig(data_parallel_size=2, replicas_on_host=3)


@pytest.mark.parametrize("replicas, nodes, need, most", [
    (2, [{"CPU": 4}, {"CPU": 4}], {"CPU": 1}, 1),  # SPREAD: one per node
    (3, [{"CPU": 4}, {"CPU": 4}], {"CPU": 1}, 2),  # then round again
    (5, [{"CPU": 8}, {"CPU": 2}, {"CPU": 0}], {"CPU": 2}, 4),  # the head node holds none, the small one one
    (2, [{"CPU": 8}, {"CPU": 8, "GPU": 1}], {"CPU": 1, "GPU": 1}, 2),  # only one node has a GPU
    (3, [{"CPU": 1}], {"CPU": 2}, 3),  # no room anywhere yet: they may all land on the node that frees up
    (1, [], {"CPU": 1}, 1),
])
def test_ray_spreads_replicas_and_the_fullest_node_counts(replicas, nodes, need, most):
    assert ray_cluster.replicas_per_node(replicas, nodes, need) == most


def test_ranks_count_the_ranks_on_their_own_node():
    assert ray_cluster.ranks_sharing_node(["a", "a", "b", "a"]) == [3, 3, 1, 3]
    assert ray_cluster.ranks_sharing_node(["a"]) == [1]


def test_pools_sized_on_two_nodes_fill_each_nodes_memory_not_half_of_it():
    """Four ranks, two on each node: each sizes a quarter of its node's memory when it counts every rank (before), a
    half when it counts its node's ranks: the pools then use both nodes' memory and stay within it."""
    node_free, weights = 40 * GiB, 2 * GiB
    reserve = HostMemory(0, node_free, "").reserve
    nodes = ["a", "a", "b", "b"]
    for counted, filled in ((ray_cluster.ranks_sharing_node(nodes), 1.0), ([len(nodes)] * len(nodes), 0.5)):
        budgets = [CpuKVSizing(HostMemory(node_free - weights, node_free, "MemAvailable"), weights, 0, pools,
                               useful=1 << 50).budget for pools in counted]
        per_node = {n: sum(b + weights for b, m in zip(budgets, nodes) if m == n) for n in "ab"}
        assert all(used <= node_free - reserve for used in per_node.values())
        assert min(per_node.values()) / (node_free - reserve) == pytest.approx(filled, abs=0.01)


# -- the server ---------------------------------------------------------------------------------------------
def test_a_server_of_several_models_pins_each_cpu_pool_to_what_its_estimate_counts(tiny, auto):
    """Their cores start at once: none may size from the free memory the others are about to take."""
    from banyan.config import ServerConfig
    from banyan.server.model_memory import MemoryBudget
    from banyan.server.model_specs import ModelSpec, engine_from_args
    from banyan.server.models import ModelRegistry

    def never(*args):
        raise AssertionError("no core starts here")

    models = ModelRegistry(ServerConfig(), EngineConfig(), MemoryBudget(64 * GiB), never, never)
    spec = ModelSpec(("a",), engine_from_args(EngineConfig(), str(tiny), {}))
    alone = asyncio.run(models._accepted(spec, check_memory=False))  # one model, no budget: its core sizes it
    assert alone.spec.engine.cache.kv_cache_memory is None
    pinned = asyncio.run(models._accepted(spec))
    assert pinned.spec.engine.cache.kv_cache_memory == pinned.estimate.kv_cache == GiB
    auto.setenv(CPU_KV_ENV, "256MiB")
    assert asyncio.run(models._accepted(spec)).spec.engine.cache.kv_cache_memory == 256 * MiB
    given = ModelSpec(("b",), engine_from_args(EngineConfig(), str(tiny), {"kv_cache_memory": "32MiB"}))
    assert asyncio.run(models._accepted(given)).spec.engine.cache.kv_cache_memory == 32 * MiB


def _rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_cpu_pool_is_zeros_backed_by_memory_only_where_written():
    from banyan.runner.memory import lazily_zeroed

    before = _rss()
    pool = lazily_zeroed((16384, 16, 4, 64), torch.float32)  # 256 MiB
    assert pool.shape == (16384, 16, 4, 64) and pool.dtype == torch.float32 and pool.is_contiguous()
    assert _rss() - before < 16 * MiB  # nothing written, nothing resident: start-up costs no pass over the pool
    assert not pool[::97].any()  # zeros, as torch.zeros gives
    pool[:8192] = 1.0
    assert _rss() - before > 120 * MiB and pool.sum() == 8192 * 16 * 4 * 64
    assert lazily_zeroed((2, 3), torch.float8_e4m3fn).float().eq(0).all()
