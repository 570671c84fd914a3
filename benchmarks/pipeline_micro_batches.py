"""Pipeline parallel with micro-batches (stages overlap) against one batch in flight, side by side in one process.

    python benchmarks/pipeline_micro_batches.py [--model smollm2-135m-instruct] [--stages 2] [--requests 8]
                                                [--prompt-len 128] [--tokens 32] [--rounds 5] [--threads 1]

Three engines live at once, each rank one thread: one process (PP=1), PP=`stages` with one micro-batch per stage
(stage k runs micro-batch m while stage k+1 runs m-1), and PP=`stages` with one micro-batch (the whole batch goes
through one stage after another: every stage but one idles). An engine not running waits on a socket, costing no
CPU. Each round gives every engine the same batch of greedy requests (random prompts, prefix caching off), in an
order that rotates from round to round; per run: output tokens/s over the whole batch (prefill included), and
decode tokens/s after every request's first token. Prints medians, the per-round ratios against one batch in
flight, and whether every engine produced the same tokens (they must: greedy, float32 stages).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from banyan import LLM, SamplingParams


def run_batch(engine, prompts: list[list[int]], tokens: int) -> tuple[float, float, tuple]:
    """(output tokens/s, decode tokens/s after the last first token, every request's tokens) of one batch."""
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
    return len(prompts) * tokens / (end - start), decoded / (end - decode_from), tuple(tuple(out[r]) for r in ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    common = dict(num_threads=args.threads, enable_prefix_caching=False, dtype="float32",
                  kv_cache_memory=256 << 20)
    engines = {
        "PP=1": LLM(args.model, **common).engine,
        f"PP={args.stages}, {args.stages} micro-batches": LLM(args.model, pipeline_parallel_size=args.stages,
                                                               **common).engine,
        f"PP={args.stages}, 1 batch in flight": LLM(args.model, pipeline_parallel_size=args.stages,
                                                    pipeline_micro_batches=1, **common).engine,
    }
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    names = list(engines)
    for engine in engines.values():
        run_batch(engine, prompts[:2], 4)  # warm-up
    runs, outputs = {name: [] for name in names}, {}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            total, decode, tokens = run_batch(engines[name], prompts, args.tokens)
            runs[name].append((total, decode))
            outputs.setdefault(tokens, []).append(name)
    for name, values in runs.items():
        print(f"{name:28s} tok/s median {statistics.median(v[0] for v in values):6.1f}  decode tok/s median "
              f"{statistics.median(v[1] for v in values):6.1f}  (rounds: {[round(v[0], 1) for v in values]})")
    base = runs[names[2]]
    for name in names[:2]:
        ratios = [a[0] / b[0] for a, b in zip(runs[name], base)]
        decode = [a[1] / b[1] for a, b in zip(runs[name], base)]
        print(f"{name} / one batch in flight: tok/s x{statistics.median(ratios):.2f} (rounds "
              f"{[round(x, 2) for x in ratios]}), decode x{statistics.median(decode):.2f}")
    print("same tokens everywhere:", len(outputs) == 1)
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
