"""Per-replica series on /metrics when the server runs data-parallel replicas (--data-parallel-size N), read
from the DataParallelClient at scrape time (nothing counted twice):

    banyan:dp_replica_up{replica}                       1 while the replica's core lives
    banyan:dp_replica_restarts_total{replica}           new cores that took the place of a dead one
    banyan:dp_replica_failed_starts_total{replica}      new cores that failed before they were ready (retried)
    banyan:dp_replica_num_requests_running{replica}     its running / waiting requests, KV usage, prefix cache
    banyan:dp_replica_num_requests_waiting{replica}
    banyan:dp_replica_kv_cache_usage_perc{replica}
    banyan:dp_replica_prefix_cache_queries_total{replica}, ..._hits_total{replica}
    banyan:dp_router_requests_total{replica}            requests the router sent there
    banyan:dp_router_prefix_hit_rate                    routed prompt tokens its trees predicted cached
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from banyan.ipc.dp_client import DataParallelClient

PER_REPLICA = [  # (name, kind, help, EngineStats field)
    ("dp_replica_num_requests_running", "gauge", "Requests in model execution on this replica.", "num_running"),
    ("dp_replica_num_requests_waiting", "gauge", "Requests waiting on this replica.", "num_waiting"),
    ("dp_replica_kv_cache_usage_perc", "gauge", "This replica's KV cache usage (1 = full).", "kv_usage"),
    ("dp_replica_prefix_cache_queries", "counter", "Prompt tokens this replica looked up in its prefix cache.",
     "prefix_query_tokens"),
    ("dp_replica_prefix_cache_hits", "counter", "Of those, tokens found cached.", "prefix_hit_tokens"),
]


class ReplicaCollector(Collector):
    def __init__(self, client: DataParallelClient, model_name: str):
        self.client, self.model_name = client, model_name

    def collect(self):
        labels = ["model_name", "replica"]
        up = GaugeMetricFamily("banyan:dp_replica_up", "1 while this data-parallel replica's core lives.", labels=labels)
        families = {name: (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(f"banyan:{name}", doc,
                                                                                          labels=labels)
                    for name, kind, doc, _ in PER_REPLICA}
        routed = CounterMetricFamily("banyan:dp_router_requests", "Requests the router sent to this replica.",
                                     labels=labels)
        restarts = CounterMetricFamily("banyan:dp_replica_restarts", "New cores that took the place of this "
                                       "replica's dead one.", labels=labels)
        failed = CounterMetricFamily("banyan:dp_replica_failed_starts", "New cores for this replica that failed "
                                     "before they were ready.", labels=labels)
        router = self.client.router
        for index, (replica, alive) in enumerate(zip(self.client.replicas, self.client.alive())):
            key = [self.model_name, str(index)]
            up.add_metric(key, 1.0 if alive else 0.0)
            restarts.add_metric(key, self.client.health[index].restarts)
            failed.add_metric(key, self.client.health[index].failed_starts)
            routed.add_metric(key, router.stats.per_replica[index])
            if replica.stats is not None:
                for name, _, _, field in PER_REPLICA:
                    families[name].add_metric(key, float(getattr(replica.stats, field)))
        hit_rate = GaugeMetricFamily("banyan:dp_router_prefix_hit_rate", "Routed prompt tokens the router's trees "
                                     f"predicted cached on the chosen replica (policy {router.policy}).",
                                     labels=["model_name"])
        hit_rate.add_metric([self.model_name], router.stats.hit_rate)
        yield from [up, restarts, failed, *families.values(), routed, hit_rate]
