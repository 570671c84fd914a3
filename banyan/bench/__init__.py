"""`banyan bench`: measure banyan (and, later, its peers) under named workloads.

    workloads.py         prompts: random, shared-prefix
    metrics.py           latency math: percentiles, TTFT / ITL / TPOT / E2E, goodput
    offline.py           throughput, latency and overhead, in-process through LLM / Engine
    zero_cost_runner.py  a model runner double that returns fixed logits instantly
    serve.py             an asyncio load generator for any OpenAI-compatible server
    results.py           one JSON per run (schema_version) and a markdown table
"""
