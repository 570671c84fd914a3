"""`banyan bench router` reads each replica's counters off /metrics as the server writes them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from banyan.bench.router import markdown, parse_replica_counters
from banyan.distributed.router import Router
from banyan.ipc.dp_client import ReplicaHealth
from banyan.ipc.messages import EngineStats
from banyan.server.replica_metrics import ReplicaCollector


class FakeReplica:
    def __init__(self, hits: int):
        self.stats = EngineStats(num_running=1, num_waiting=0, kv_usage=0.5, num_pages=8, num_free_pages=4,
                                 prefix_query_tokens=100, prefix_hit_tokens=hits, num_preemptions=0, time=0.0,
                                 num_steps=3)


class FakeClient:
    """What ReplicaCollector reads of a DataParallelClient: its replicas, their health and its router."""

    def __init__(self):
        self.replicas = [FakeReplica(40), FakeReplica(60)]
        self.health = [ReplicaHealth(), ReplicaHealth("restarting", restarts=1, failed_starts=2)]
        self.router = Router("cache_aware", 2, 4, 64)
        self.router.choose(None, list(range(16)), [0, 0], [True, True])

    def alive(self):
        return [True, False]


def test_the_bench_reads_what_the_collector_writes():
    registry = CollectorRegistry()
    registry.register(ReplicaCollector(FakeClient(), "m"))
    counters = parse_replica_counters(generate_latest(registry).decode())
    assert counters["queries"] == [100.0, 100.0] and counters["hits"] == [40.0, 60.0]
    assert counters["routed"] == [1.0, 0.0] and counters["router_hit_rate"] == 0.0
    result = {"prefix_hit_rate": 0.5, "ttft_ms": {"median": 12.0, "p99": 30.0}, "request_throughput": 2.0,
              "output_throughput": 9.5, "requests_per_replica": [3, 5]}
    assert "| cache_aware | 0.50 | 12 | 30 | 2.00 | 9.5 | 3/5 |" in markdown({"cache_aware": result})
