"""In-process benchmarks: throughput and overhead through `LLM.generate`, latency through the Engine.

Each returns (config, results) for results.make_report; the CLI prints and saves them.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from banyan.bench.metrics import peak_rss_bytes
from banyan.bench.workloads import BenchPrompt, make_workload, random_prompts, turns
from banyan.bench.zero_cost_runner import ZeroCostRunner
from banyan.config import EngineConfig
from banyan.frontend.llm import LLM
from banyan.sampling_params import SamplingParams


def run_throughput(config: EngineConfig, args) -> tuple[dict, dict]:
    """Offline requests/s and tokens/s, every prompt submitted at once (vLLM's benchmark_throughput)."""
    start_rss = peak_rss_bytes()
    llm = LLM.from_config(config)
    prompts = make_workload(args.workload, args, llm.engine.arch.vocab_size, encode=llm.tokenizer.encode)
    results = generate_all(llm, prompts, args.temperature, use_tqdm=not args.no_progress)
    results["peak_rss_bytes"] = peak_rss_bytes()
    results["peak_rss_before_load_bytes"] = start_rss
    return _config(config, args), results


def run_overhead(config: EngineConfig, args) -> tuple[dict, dict]:
    """Tokens/s of the machinery around a model that costs nothing (ZeroCostRunner), at batch size."""
    results = overhead_results(config, args.batch_size, args.input_len, args.output_len, args.temperature,
                               args.workload_seed, progress=not args.no_progress)
    return _config(config, args), results


def overhead_results(config: EngineConfig, batch_size: int, input_len: int, output_len: int, temperature: float,
                     seed: int = 0, progress: bool = True) -> dict:
    """The zero-cost model's run: batch_size prompts at once, after a warm-up at the same size."""
    config = dataclasses.replace(
        config,
        scheduler=dataclasses.replace(config.scheduler, max_num_seqs=batch_size,
                                      max_num_batched_tokens=max(config.scheduler.max_num_batched_tokens,
                                                                 batch_size * input_len)),
    )
    llm = LLM.from_config(config, runner_factory=ZeroCostRunner)
    try:
        vocab = llm.engine.arch.vocab_size
        warm_up = random_prompts(batch_size, input_len, 2, vocab, seed=seed + 1)  # no prefix shared with the run
        generate_all(llm, warm_up, temperature, use_tqdm=False)
        runner = llm.engine.runner
        runner.sampler_seconds = 0.0
        results = generate_all(llm, random_prompts(batch_size, input_len, output_len, vocab, seed=seed),
                               temperature, use_tqdm=progress)
    finally:
        llm.engine.close()
    results["steps_per_s"] = output_len / results["elapsed_s"]
    results["sampler_s"] = runner.sampler_seconds
    rest = results["elapsed_s"] - runner.sampler_seconds
    results["output_throughput_without_sampler"] = results["total_output_tokens"] / rest if rest > 0 else 0.0
    return results


def run_latency(config: EngineConfig, args) -> tuple[dict, dict]:
    """Batch 1: time to first token and decode tokens/s, over --num-iters runs after one warm-up."""
    llm = LLM.from_config(config)
    engine = llm.engine
    prompts = random_prompts(args.num_iters + 1, args.input_len, args.output_len, engine.arch.vocab_size,
                             seed=args.workload_seed)
    results = latency_runs(engine, prompts, args.temperature)
    results["peak_rss_bytes"] = peak_rss_bytes()
    return _config(config, args), results


def latency_runs(engine, prompts: list[BenchPrompt], temperature: float) -> dict:
    """TTFT, decode tokens/s and E2E of each prompt alone in the engine, the first a warm-up. The
    prompts differ, so that none finds the one before in the prefix cache."""
    runs = [_one_request(engine, f"latency-{i}", prompt, temperature) for i, prompt in enumerate(prompts)][1:]
    ttfts, decode_rates, e2es = zip(*runs)
    return {
        "ttft_ms": _stats([t * 1000 for t in ttfts]),
        "decode_tokens_per_s": _stats(list(decode_rates)),
        "e2el_ms": _stats([t * 1000 for t in e2es]),
    }


def generate_all(llm: LLM, prompts: list[BenchPrompt], temperature: float, use_tqdm: bool) -> dict:
    """Submit every prompt at once (multi-turn: every conversation's next turn at once) and time it."""
    start = time.perf_counter()
    output_tokens = sum(_generate_turn(llm, batch, temperature, use_tqdm) for batch in turns(prompts))
    elapsed = time.perf_counter() - start
    return throughput(prompts, output_tokens, elapsed)


def throughput(prompts: list[BenchPrompt], output_tokens: int, elapsed: float) -> dict:
    """The offline report of one run: counts and rates."""
    input_tokens = sum(len(p.prompt_token_ids) for p in prompts)
    return {
        "num_requests": len(prompts),
        "elapsed_s": elapsed,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(prompts) / elapsed,
        "input_throughput": input_tokens / elapsed,
        "output_throughput": output_tokens / elapsed,
        "total_token_throughput": (input_tokens + output_tokens) / elapsed,
    }


def _generate_turn(llm: LLM, prompts: list[BenchPrompt], temperature: float, use_tqdm: bool) -> int:
    inputs = [{"prompt_token_ids": p.prompt_token_ids} for p in prompts]
    params = [SamplingParams(temperature=temperature if p.temperature is None else p.temperature, top_p=1.0,
                             max_tokens=p.output_len, ignore_eos=p.ignore_eos, structured_outputs=p.structured_outputs)
              for p in prompts]
    outputs = llm.generate(inputs, params, use_tqdm=use_tqdm)
    return sum(len(c.token_ids) for o in outputs for c in o.outputs)


def _one_request(engine, request_id: str, prompt: BenchPrompt, temperature: float) -> tuple[float, float, float]:
    """(TTFT s, decode tokens/s after the first token, E2E s) of one request alone in the engine."""
    params = SamplingParams(temperature=temperature, max_tokens=prompt.output_len, ignore_eos=prompt.ignore_eos)
    start = time.perf_counter()
    engine.add_request(request_id, prompt.prompt_token_ids, params)
    first = None
    tokens = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += len(delta.new_token_ids)
            if first is None and delta.new_token_ids:
                first = time.perf_counter()
    end = time.perf_counter()
    decode = (tokens - 1) / (end - first) if tokens > 1 and end > first else 0.0
    return first - start, decode, end - start


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "min": min(values), "max": max(values)}


def _config(config: EngineConfig, args) -> dict:
    bench_args = {k: v for k, v in vars(args).items() if k in BENCH_ARGS}
    return {"engine": dataclasses.asdict(config), "bench": bench_args}


BENCH_ARGS = ("workload", "input_len", "output_len", "num_prompts", "range_ratio", "prompts_per_group",
              "system_prompt_len", "num_turns", "sharegpt_path", "sharegpt_output_len", "workload_seed", "temperature",
              "batch_size", "num_iters")
