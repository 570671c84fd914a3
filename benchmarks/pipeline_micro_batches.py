"""Pipeline parallel with micro-batches (stages overlap) against one batch in flight, side by side in one process.

    python benchmarks/pipeline_micro_batches.py [--model smollm2-135m-instruct] [--stages 2] [--requests 8]
                                                [--prompt-len 128] [--tokens 16] [--rounds 25] [--threads 1]

Four engines live at once, each rank one thread: one process (PP=1); PP=`stages` by default (one micro-batch per
stage when each gets MIN_MICRO_BATCH_TOKENS, so prefill steps are cut and decode steps are not); PP=`stages` always
cut into one micro-batch per stage (stage k runs micro-batch m while stage k+1 runs m-1); and PP=`stages` with one
micro-batch (the whole batch goes through one stage after another: every stage but one idles). An engine not running waits on a socket, costing no
CPU. Each round gives every engine the same batch of greedy requests (random prompts, prefix caching off), in an
order that rotates from round to round (many short rounds: on a shared machine the load moves within seconds); per
run: prefill tokens/s (prompt tokens until every request has its first token) and decode tokens/s after that.
Prints medians, the medians and ranges of the per-round ratios against one batch in flight, and which engines gave
the same tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from banyan import LLM, SamplingParams


def run_batch(engine, prompts: list[list[int]], tokens: int) -> tuple[float, float, tuple]:
    """(prefill: prompt tokens/s until every request has its first token; decode: tokens/s after that; every
    request's tokens) of one batch."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ids = [f"bench-{random.random()}" for _ in prompts]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    out = {rid: [] for rid in ids}
    start, decode_from, decoded = time.perf_counter(), None, 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out[delta.request_id] += delta.new_token_ids
            decoded += len(delta.new_token_ids) if decode_from is not None else 0
        if decode_from is None and all(out.values()):
            decode_from = time.perf_counter()
    end = time.perf_counter()
    prefill = sum(map(len, prompts)) / (decode_from - start)
    return prefill, decoded / (end - decode_from), tuple(tuple(out[r]) for r in ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    common = dict(num_threads=args.threads, enable_prefix_caching=False, dtype="float32",
                  kv_cache_memory=256 << 20)
    pp = dict(common, pipeline_parallel_size=args.stages)
    engines = {  # the baseline last
        "PP=1": LLM(args.model, **common).engine,
        f"PP={args.stages}, default": LLM(args.model, **pp).engine,
        f"PP={args.stages}, always {args.stages} micro-b.": LLM(args.model, pipeline_micro_batches=args.stages,
                                                                 **pp).engine,
        f"PP={args.stages}, 1 batch in flight": LLM(args.model, pipeline_micro_batches=1, **pp).engine,
    }
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    names = list(engines)
    for engine in engines.values():
        run_batch(engine, prompts[:2], 4)  # warm-up
    runs, outputs = {name: [] for name in names}, {}  # tokens -> the runs that gave them
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            prefill, decode, tokens = run_batch(engines[name], prompts, args.tokens)
            runs[name].append((prefill, decode))
            outputs.setdefault(tokens, set()).add(name)
    base = runs[names[-1]]
    for name, values in runs.items():
        prefill = [a[0] / b[0] for a, b in zip(values, base)]
        decode = [a[1] / b[1] for a, b in zip(values, base)]
        print(f"{name:30s} prefill tok/s median {statistics.median(v[0] for v in values):7.1f} "
              f"(x{statistics.median(prefill):.2f} one batch in flight's, rounds {min(prefill):.2f}-{max(prefill):.2f})"
              f"  decode tok/s median {statistics.median(v[1] for v in values):6.1f} "
              f"(x{statistics.median(decode):.2f}, rounds {min(decode):.2f}-{max(decode):.2f})")
    # A GGUF model's Q4/Q8 layers run banyan's compact kernel up to 8 rows and a float16 copy above (quantization/
    # linear.py): a micro-batch of 8 decode rows takes the other kernel than the whole 16, and a near-tie flips.
    # The tiny float32 models of tests/e2e/test_tensor_parallel.py give equal tokens and logprobs everywhere.
    print("engines giving each set of tokens:", [sorted(group) for group in outputs.values()])
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
