"""A burst of requests that share a system prompt nobody has cached yet: the shared-prefix wait on and off.

    python benchmarks/shared_prefix_burst.py [--requests 32] [--system-tokens 1024] [--max-tokens 8]
                                             [--rounds 2] [--num-threads 1] [--no-http] [--no-offline]

--requests prompts arrive at once, each a fresh ~--system-tokens system prompt (sentences from bench's passage,
a new one per round so that neither side finds it cached; the same prompts on both sides) and a question of its
own. Two sides, the same engine
settings but --shared-prefix-wait-tokens: 0 (before: each request computes the system prompt) and the default 32
(after: one computes it, the others wait for its pages). Offline: two `LLM`s in this process, `LLM.generate` of the
burst; HTTP: two `banyan serve` processes, the burst sent at once through the `openai` client (one thread per
request). After a warm-up burst of 4 on each side, rounds alternate which side goes first; medians. Reported per side: the wall time of the burst and the
prompt tokens the engine computed (prompt tokens less those served by the prefix cache).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from banyan.bench.lang import context_text
from banyan.bench.launcher import banyan_serve_cmd, free_port, launched
from banyan.config_args import config_from_kwargs, parse_size
from banyan.frontend.llm import LLM
from banyan.sampling_params import SamplingParams

SIDES = {"before (wait off)": 0, "after (wait 32)": 32}


def burst(tokenizer, args, seed: int, requests: int) -> list[str]:
    system = context_text(tokenizer, args.system_tokens, seed)
    return [f"{system}\n\nQuestion {i}: what does the keeper write about the {i}th night?" for i in range(requests)]


def offline_run(llm: LLM, prompts: list[str], args) -> tuple[float, int, int]:
    """Seconds, prompt tokens, prompt tokens computed."""
    before = llm.engine.stats()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.engine.stats()
    queried = after.prefix_query_tokens - before.prefix_query_tokens
    return seconds, queried, queried - (after.prefix_hit_tokens - before.prefix_hit_tokens)


def http_run(base_url: str, prompts: list[str], args) -> tuple[float, int, int]:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=3600, max_retries=0)
    model = client.models.list().data[0].id

    def one(prompt: str):
        return client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens,
                                         temperature=0.0, extra_body={"ignore_eos": True}).usage

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        usages = list(pool.map(one, prompts))
    seconds = time.perf_counter() - start
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    return seconds, prompt_tokens, prompt_tokens - sum(u.prompt_tokens_details.cached_tokens for u in usages)


def side_by_side(run, args, tokenizer, label: str) -> dict:
    """run(side, prompts) -> (seconds, prompt tokens, computed); interleaved rounds after one warm-up each (a burst
    of 4)."""
    rows = {side: [] for side in SIDES}
    for r in range(args.rounds + 1):
        order = list(SIDES) if r % 2 == 0 else list(SIDES)[::-1]
        prompts = burst(tokenizer, args, 1000 + r, args.requests if r else 4)  # the same on both sides (2 engines)
        for side in order:
            result = run(side, prompts)
            if r > 0:  # round 0 warms each side up
                rows[side].append(result)
            print(f"{label} round {r} {side}: {result[0]:.2f} s, {result[2]} of {result[1]} prompt tokens computed",
                  flush=True)
    summary = {side: {"median_s": statistics.median(x[0] for x in runs), "seconds": [x[0] for x in runs],
                      "prompt_tokens": runs[0][1], "computed": [x[2] for x in runs]} for side, runs in rows.items()}
    before, after = (summary[side]["median_s"] for side in SIDES)
    print(f"{label}: before / after = {before / after:.2f}x", flush=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--kv-cache-memory", type=parse_size, default="2GiB")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the step's token budget")
    parser.add_argument("--no-http", action="store_true")
    parser.add_argument("--no-offline", action="store_true")
    parser.add_argument("--out", default="", help="write the results as JSON here")
    args = parser.parse_args()
    settings = {"num_threads": args.num_threads, "kv_cache_memory": args.kv_cache_memory,
                "max_num_batched_tokens": args.max_num_batched_tokens}
    results = {"args": vars(args)}
    llms = {side: LLM(**settings, shared_prefix_wait_tokens=wait) for side, wait in SIDES.items()}
    tokenizer = next(iter(llms.values())).tokenizer
    if not args.no_offline:
        results["offline"] = side_by_side(lambda side, prompts: offline_run(llms[side], prompts, args), args,
                                          tokenizer, "LLM.generate")
    llms.clear()
    if not args.no_http:
        with contextlib.ExitStack() as stack:
            urls = {side: stack.enter_context(server(settings, wait)) for side, wait in SIDES.items()}
            results["http"] = side_by_side(lambda side, prompts: http_run(urls[side], prompts, args), args,
                                           tokenizer, "HTTP")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


def server(settings: dict, wait: int):
    """`banyan serve` with these settings and --shared-prefix-wait-tokens wait (a context manager: its base URL)."""
    port = free_port()
    config = config_from_kwargs({**settings, "shared_prefix_wait_tokens": wait})
    return launched(banyan_serve_cmd(config, port), port, ready_timeout=600)


if __name__ == "__main__":
    main()
