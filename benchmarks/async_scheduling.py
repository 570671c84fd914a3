"""Async scheduling against the plain step, side by side in one process, and the host's share of a plain step.

    python benchmarks/async_scheduling.py [--model smollm2-135m-instruct] [--batches 1,16,64] [--prompt-len 32]
                                          [--tokens 32] [--rounds 7] [--threads 1]

Two engines of the same model live at once: plain, and --async-scheduling. Each round gives both the same batch of
greedy requests (random prompts, prefix caching off), in an order that alternates from round to round; per run:
output tokens/s, arrival to last token. Prints the medians, the median and range of the
per-round ratios async / plain, and whether both gave the same tokens.

The host's share: in the plain engine's decode steps, the time outside `runner.execute` (schedule, update, deltas)
and, inside it, before the forward (`_prepare`: the batch's host lists to tensors). On a GPU both run while the
device idles unless the next step is launched before this one is read, which is what async scheduling does; on a
CPU the host is the device, so the ratio measures only its cost (each token is read one step later, and a request
that ends on EOS or a stop token computes one row in vain).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from banyan import LLM, SamplingParams


class StepClock:
    """Seconds of each decode step: in all, in runner.execute, in its _prepare (wrapping the engine's own methods)."""

    def __init__(self, engine):
        self.engine, self.parts = engine, []
        runner = engine.runner
        execute, prepare = runner.execute, runner._prepare
        self.inside = {"execute": 0.0, "prepare": 0.0}

        def timed(name, fn):
            def call(*args):
                started = time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    self.inside[name] += time.perf_counter() - started
            return call

        runner.execute, runner._prepare = timed("execute", execute), timed("prepare", prepare)

    def step(self):
        self.inside = {"execute": 0.0, "prepare": 0.0}
        started = time.perf_counter()
        deltas = self.engine.step()
        self.parts.append((time.perf_counter() - started, self.inside["execute"], self.inside["prepare"]))
        return deltas


def run_batch(engine, step, prompts: list[list[int]], tokens: int) -> tuple[float, tuple, int]:
    """(output tokens/s from the requests' arrival to the last token, every request's tokens, decode steps: those
    after every request had its first token) of one batch. Not the decode rate alone: async scheduling reports
    each token one step later, which would move the decode window's start past a step already computed."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ids = [f"bench-{random.random()}" for _ in prompts]
    started = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    out = {rid: [] for rid in ids}
    decode_steps = 0
    while engine.has_unfinished_requests():
        decode_steps += all(out.values())
        for delta in step():
            out[delta.request_id] += delta.new_token_ids
    rate = sum(map(len, out.values())) / (time.perf_counter() - started)
    return rate, tuple(tuple(out[r]) for r in ids), decode_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    common = dict(num_threads=args.threads, enable_prefix_caching=False, dtype="float32", kv_cache_memory=512 << 20,
                  max_num_seqs=max(int(b) for b in args.batches.split(",")))
    plain = LLM(args.model, **common).engine
    overlapped = LLM(args.model, async_scheduling=True, **common).engine
    clock = StepClock(plain)
    vocab = plain.arch.vocab_size
    for batch in (int(b) for b in args.batches.split(",")):
        rates, same, decode = {"plain": [], "async": []}, True, []
        for r in range(args.rounds):
            rng = random.Random(r)
            prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
            order = [("plain", plain, clock.step), ("async", overlapped, overlapped.step)]
            outputs = {}
            for name, engine, step in order if r % 2 == 0 else order[::-1]:
                rate, outputs[name], decode_steps = run_batch(engine, step, prompts, args.tokens)
                rates[name].append(rate)
                if name == "plain":
                    decode += clock.parts[-decode_steps:]
            same &= outputs["plain"] == outputs["async"]
        ratios = [a / p for a, p in zip(rates["async"], rates["plain"])]
        total = statistics.median(t for t, _, _ in decode)
        outside = statistics.median(t - e for t, e, _ in decode)
        prepare = statistics.median(p for _, _, p in decode)
        print(f"batch {batch}: plain {statistics.median(rates['plain']):.1f} tok/s, async "
              f"{statistics.median(rates['async']):.1f} tok/s, async/plain median {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f}), same tokens: {same}; plain decode step {total * 1e3:.2f} ms, "
              f"outside execute {outside * 1e3:.2f} ms, _prepare {prepare * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
