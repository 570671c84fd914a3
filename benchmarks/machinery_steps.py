"""Where a step of the engine's machinery goes: the zero-cost model's overhead run (`banyan bench overhead`) timed
phase by phase in one process, and the greedy argmax kernel against torch's blocked pass, interleaved.

    python benchmarks/machinery_steps.py [--num-threads 2] [--rounds 4] [--batch-size 256]

The run is the overhead bench's (random 32-token prompts, 128 greedy output tokens each with ignore_eos, after a
warm-up at the same size), driven step by step as `LLM.generate` drives it, each phase timed: `schedule`, the
runner's `execute` (of which `sampler`: one pass over the step's [batch, 49,152] float32 logits), the scheduler's
`update`, `make_delta` for every advanced request, and the `OutputProcessor` (detokenizer, stop strings). Prints
the medians over the rounds in ms a step, and the argmax pass alone at 256 x 49,152 (medians of 30 alternating
calls). For the effect of a change, run it on two checkouts in turn (PYTHONPATH=each), several times: the machine
is shared, so compare the ratios of runs side by side, never one run's absolute numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from banyan.bench.offline import generate_all
from banyan.bench.workloads import random_prompts
from banyan.bench.zero_cost_runner import ZeroCostRunner
from banyan.config_args import add_engine_args, engine_config
from banyan.engine.engine import make_delta
from banyan.frontend.llm import LLM, collections_paused
from banyan.kernels.cpu_argmax import argmax_for, argmax_in_blocks
from banyan.sampling_params import SamplingParams
from banyan.text.output_processor import OutputProcessor

PHASES = ("schedule", "execute", "sampler", "update", "make_delta", "output")


def timed_run(llm: LLM, batch: int, input_len: int, output_len: int, seed: int) -> tuple[float, dict[str, float]]:
    """(output tok/s, seconds a step by phase) of one batch generated to the end."""
    engine, processor = llm.engine, OutputProcessor(llm.tokenizer)
    params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=output_len, ignore_eos=True)
    for prompt in random_prompts(batch, input_len, output_len, engine.arch.vocab_size, seed=seed):
        llm._add(processor, {"prompt_token_ids": prompt.prompt_token_ids}, params, 0)
    spent, steps, start = dict.fromkeys(PHASES, 0.0), 0, time.perf_counter()
    with collections_paused():
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            step = engine.scheduler.schedule()
            t1, sampler = time.perf_counter(), engine.runner.sampler_seconds
            result = engine.runner.execute(step)
            t2 = time.perf_counter()
            advanced = engine.scheduler.update(step, result)
            t3 = time.perf_counter()
            deltas = [make_delta(request) for request in advanced]
            t4 = time.perf_counter()
            engine.abort_requests(processor.process(deltas))
            t5 = time.perf_counter()
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, engine.runner.sampler_seconds - sampler, t3 - t2,
                                               t4 - t3, t5 - t4)):
                spent[phase] += seconds
            steps += 1
    return batch * output_len / (time.perf_counter() - start), {k: v / steps for k, v in spent.items()}


def argmax_pass(batch: int, vocab: int, calls: int = 30) -> tuple[float, float]:
    """Median ms of (the kernel, torch's blocked pass) over the same logits, calls alternating."""
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    kernel = argmax_for(logits)
    ways = [kernel or argmax_in_blocks, argmax_in_blocks]
    times: list[list[float]] = [[], []]
    for _ in range(calls):
        for i, way in enumerate(ways):
            start = time.perf_counter()
            way(logits)
            times[i].append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_args(parser)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    config = engine_config(args)
    batch = args.batch_size
    config = dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, max_num_seqs=batch,
        max_num_batched_tokens=max(config.scheduler.max_num_batched_tokens, batch * args.input_len)))
    llm = LLM.from_config(config, runner_factory=ZeroCostRunner)
    try:
        vocab = llm.engine.arch.vocab_size
        generate_all(llm, random_prompts(batch, args.input_len, 2, vocab, seed=1), 0.0, use_tqdm=False)  # warm-up
        runs = [timed_run(llm, batch, args.input_len, args.output_len, seed=2 + r) for r in range(args.rounds)]
    finally:
        llm.engine.close()
    rates = [rate for rate, _ in runs]
    print(f"threads {torch.get_num_threads()}, batch {batch}: output tok/s median {statistics.median(rates):,.0f} "
          f"(best {max(rates):,.0f}) over {len(runs)} rounds")
    for phase in PHASES:
        print(f"  {phase:10s} {statistics.median(spent[phase] for _, spent in runs) * 1e3:6.2f} ms a step")
    kernel, blocks = argmax_pass(batch, vocab)
    print(f"argmax of {batch} x {vocab} float32: kernel {kernel:.2f} ms, torch in blocks {blocks:.2f} ms "
          f"({blocks / kernel:.2f}x)")


if __name__ == "__main__":
    main()
