"""`banyan bench router`: data-parallel replicas behind one server, each --router-policy on the same multi-tenant
workload, one server after the other: prefix-cache hit rate, TTFT p50/p99, throughput, requests per replica.

The workload is bench's shared-prefix one: --num-groups tenants, each a --system-prompt-len system prompt, and
--prompts-per-group users each, who ask an --input-len question (random token ids). --order rounds sends the
users round by round, tenant after tenant (how a round of users arrives); --order random shuffles them. Give the
replicas a cache that holds some tenants but not all (--kv-cache-memory): that is where routing matters. With a
cache that holds every tenant on every replica, any policy hits after each replica has seen each prompt once.

The hit rate is the replicas' own: prefix-cache hit tokens / looked-up prompt tokens, from /metrics
(banyan:dp_replica_prefix_cache_*), read before and after the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import re

from banyan.bench.launcher import banyan_serve_cmd, free_port, launched
from banyan.bench.serve import run_serve
from banyan.bench.workloads import shared_prefix_prompts
from banyan.checkpoint import open_checkpoint
from banyan.config import EngineConfig, ParallelConfig

READY_TIMEOUT = 900.0


def run_router(config: EngineConfig, args) -> tuple[dict, dict]:
    vocab = open_checkpoint(config.model.model).arch.vocab_size
    prompts = shared_prefix_prompts(args.num_groups, args.prompts_per_group, args.system_prompt_len, args.input_len,
                                    args.output_len, vocab, seed=args.workload_seed)
    if args.order == "random":
        random.Random(args.workload_seed).shuffle(prompts)
    replicas = max(2, config.parallel.data_parallel_size)  # --data-parallel-size; 2 unless more are asked
    results = {}
    for policy in args.policies.split(","):
        parallel = dataclasses.replace(config.parallel, data_parallel_size=replicas, router_policy=policy)
        served = config.replace(parallel=parallel)
        port = free_port()
        with launched(banyan_serve_cmd(served, port), port, ready_timeout=READY_TIMEOUT) as base_url:
            before = replica_counters(base_url)
            summary = asyncio.run(run_serve(base_url, None, prompts, concurrency=args.concurrency,
                                            request_rate=float("inf"), slos={}, progress=not args.no_progress))
            after = replica_counters(base_url)
        queries = sum(after["queries"]) - sum(before["queries"])
        hits = sum(after["hits"]) - sum(before["hits"])
        summary["prefix_hit_rate"] = hits / queries if queries else 0.0
        summary["requests_per_replica"] = [a - b for a, b in zip(after["routed"], before["routed"])]
        summary["router_predicted_hit_rate"] = after["router_hit_rate"]
        results[policy] = summary
    config_out = {"engine": dataclasses.asdict(config), "data_parallel_size": replicas,
                  "workload": {k: getattr(args, k) for k in ("num_groups", "prompts_per_group", "system_prompt_len",
                                                             "input_len", "output_len", "order", "concurrency")}}
    return config_out, results


def replica_counters(base_url: str) -> dict[str, list[float] | float]:
    """Per replica: prefix-cache queries and hits, requests routed; and the router's predicted hit rate."""
    import httpx

    return parse_replica_counters(httpx.get(f"{base_url}/metrics", timeout=30).text)


def parse_replica_counters(text: str) -> dict[str, list[float] | float]:
    def series(name: str) -> list[float]:
        found = re.findall(rf'^banyan:{name}\{{[^}}]*replica="(\d+)"[^}}]*\}} (\S+)$', text, re.MULTILINE)
        return [float(v) for _, v in sorted(found, key=lambda kv: int(kv[0]))]

    rate = re.search(r"^banyan:dp_router_prefix_hit_rate\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return {"queries": series("dp_replica_prefix_cache_queries_total"),
            "hits": series("dp_replica_prefix_cache_hits_total"),
            "routed": series("dp_router_requests_total"),
            "router_hit_rate": float(rate.group(1)) if rate else 0.0}


def markdown(results: dict) -> str:
    rows = ["| policy | prefix hit rate | TTFT p50 ms | TTFT p99 ms | req/s | output tok/s | requests per replica |",
            "|---|---|---|---|---|---|---|"]
    for policy, r in results.items():
        rows.append(f"| {policy} | {r['prefix_hit_rate']:.2f} | {r['ttft_ms']['median']:.0f} | "
                    f"{r['ttft_ms']['p99']:.0f} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
                    f"{'/'.join(str(int(n)) for n in r['requests_per_replica'])} |")
    return "\n".join(rows)


def add_router_args(parser) -> None:
    parser.add_argument("--policies", default="cache_aware,round_robin,least_load", help="comma-separated, run in turn")
    parser.add_argument("--num-groups", type=int, default=5, help="tenants, each with its own system prompt")
    parser.add_argument("--prompts-per-group", type=int, default=8, help="users per tenant")
    parser.add_argument("--system-prompt-len", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=32, help="each user's question")
    parser.add_argument("--output-len", type=int, default=16, help="generated tokens (ignore_eos)")
    parser.add_argument("--order", choices=("rounds", "random"), default="rounds")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
