"""Batch-1 decode on a CPU with every decoder layer in one C call (banyan/runner/cpu_step.py) against the module path,
side by side in one process.

    python benchmarks/cpu_decode_step.py [--model smollm2-135m-instruct] [--threads 1] [--rounds 6] [--tokens 64]

One engine; each round decodes the same greedy request (a 128-token random prompt, prefix caching off) once with
`runner.cpu_step` and once without (the module path: nine ctypes calls a layer from Python), alternating which goes
first. Per run: decode tokens/s after the first token, and the process's CPU time a token (which waiting for a
core does not count: on a shared machine it moves far less than wall time). Prints medians and the per-round
ratios, and whether every run produced the same tokens (it must: the same kernels in the same order).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from banyan import LLM, SamplingParams


def decode(engine, prompt: list[int], tokens: int) -> tuple[float, float, tuple[int, ...]]:
    """(tokens/s after the first token, CPU ms a token, the tokens) of one greedy request alone."""
    engine.add_request(f"bench-{random.random()}", prompt, SamplingParams(temperature=0, max_tokens=tokens,
                                                                       ignore_eos=True))
    out = [t for delta in engine.step() for t in delta.new_token_ids]
    wall, cpu, steps = time.perf_counter(), time.process_time(), 0
    while engine.has_unfinished_requests():
        out += [t for delta in engine.step() for t in delta.new_token_ids]
        steps += 1
    return steps / (time.perf_counter() - wall), (time.process_time() - cpu) / steps * 1e3, tuple(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    llm = LLM(args.model, num_threads=args.threads, enable_prefix_caching=False)
    runner = llm.engine.runner
    if runner.cpu_step is None:
        raise SystemExit("the one-call step does not serve this model or machine (see banyan/runner/cpu_step.py)")
    sides = {"module path": None, "one C call": runner.cpu_step}
    rng = random.Random(0)
    prompt = [rng.randrange(100, llm.engine.arch.vocab_size) for _ in range(128)]
    decode(llm.engine, prompt, 8)  # warm-up
    runs, outputs = {name: [] for name in sides}, set()
    for r in range(args.rounds):
        for name in sides if r % 2 == 0 else reversed(sides):
            runner.cpu_step = sides[name]
            rate, cpu_ms, tokens = decode(llm.engine, prompt, args.tokens)
            runs[name].append((rate, cpu_ms))
            outputs.add(tokens)
    for name, values in runs.items():
        print(f"{name:12s} decode tok/s median {statistics.median(v[0] for v in values):6.1f}, "
              f"CPU ms a token {statistics.median(v[1] for v in values):5.2f}  (rounds: {[round(v[0], 1) for v in values]})")
    pairs = list(zip(runs["one C call"], runs["module path"]))
    print(f"one call / module path: wall {statistics.median(a[0] / b[0] for a, b in pairs):.2f}x, CPU time a token "
          f"{statistics.median(b[1] / a[1] for a, b in pairs):.2f}x fewer; the same tokens in every run: {len(outputs) == 1}")


if __name__ == "__main__":
    main()
