"""Where run_batch's time goes: the engine steps each side takes, and what one step costs at each batch size.

    python benchmarks/lang_run_batch_steps.py [--programs 64] [--tokens 16] [--calls 1] [--rounds 3]
                                              [--num-threads 1] [--batch-sizes 1,8,16,32,64]

Two parts, in one process on one bl.Engine (the default model):
- sides: the programs of `banyan bench lang`'s batch row (a user turn, a gen of --tokens; with --calls > 1,
  further user turns each with its own gen) one by one, with run_batch as before the loop gathered its
  callers (gather_quiet_s = 0), and with run_batch as it is; interleaved rounds (the order reversed every
  other round), medians. Each run reports its engine steps and their mean batch.
- steps (--batch-sizes): the median decode step at each batch size (run_batch of that many programs). The
  run_batch ratio cannot exceed programs x t(1) / t(programs) (run_batch takes --tokens steps of the full
  batch; one by one takes programs x --tokens steps of one), whatever the frontend does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import banyan.lang as bl  # noqa: E402
from banyan.frontend.llm import LLM  # noqa: E402


@bl.function
def turns(s, index: int, tokens: int, calls: int):
    s += bl.user(f"Question {index}: name a colour and say why you like it.")
    s += bl.assistant(bl.gen("answer", max_tokens=tokens, ignore_eos=True))
    for c in range(1, calls):
        s += bl.user("And another?")
        s += bl.assistant(bl.gen(f"more{c}", max_tokens=tokens, ignore_eos=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--calls", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--batch-sizes", default="", help="comma-separated; empty: skip the step costs")
    args = parser.parse_args()
    engine = bl.Engine(llm=LLM(num_threads=args.num_threads))
    steps: list[tuple[int, float]] = []  # (requests held, seconds) per engine step
    time_steps(engine.llm.engine, steps)
    try:
        compare_sides(engine, steps, args)
        if args.batch_sizes:
            step_costs(engine, steps, [int(n) for n in args.batch_sizes.split(",")], args.tokens)
    finally:
        engine.close()


def time_steps(core, steps: list) -> None:
    step = core.step

    def timed():
        held, started = len(core.scheduler.running) + len(core.scheduler.waiting), time.perf_counter()
        out = step()
        steps.append((held, time.perf_counter() - started))
        return out

    core.step = timed


def compare_sides(engine: bl.Engine, steps: list, args) -> None:
    batch = [{"index": i, "tokens": args.tokens, "calls": args.calls} for i in range(args.programs)]

    def batched(quiet_s: float):
        def run():
            engine.loop.gather_quiet_s = quiet_s
            return turns.run_batch(batch, temperature=1.0, backend=engine)
        return run

    sides = {"one by one": lambda: [turns.run(**kw, temperature=1.0, backend=engine) for kw in batch],
             "run_batch, no gather": batched(0.0), "run_batch": batched(engine.loop.gather_quiet_s)}
    for run in sides.values():  # warm-up: the prompts' pages cached for every side alike
        run()
    seconds = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            steps.clear()
            started = time.perf_counter()
            states = sides[name]()
            seconds[name].append(time.perf_counter() - started)
            assert all(s.error() is None for s in states)
            held = [n for n, _ in steps]
            print(f"round {r} {name}: {seconds[name][-1]:.2f} s, {len(steps)} steps, "
                  f"mean batch {sum(held) / len(held):.1f}, first steps {held[:3]}", flush=True)
    base = statistics.median(seconds["one by one"])
    for name, values in seconds.items():
        print(f"{name}: median {statistics.median(values):.2f} s, one by one / this "
              f"{base / statistics.median(values):.2f}x")


def step_costs(engine: bl.Engine, steps: list, sizes: list[int], tokens: int) -> None:
    costs = {}
    for n in sizes:
        steps.clear()
        turns.run_batch([{"index": i, "tokens": tokens, "calls": 1} for i in range(n)], temperature=1.0,
                        backend=engine)
        costs[n] = statistics.median([s for held, s in steps[1:] if held == n])  # decode steps of the full batch
        print(f"batch {n:3d}: decode step {costs[n] * 1e3:7.1f} ms, {costs[n] * 1e3 / n:6.1f} ms a token, "
              f"{costs[n] / costs[sizes[0]]:5.1f}x the batch-{sizes[0]} step", flush=True)
    if 1 in costs:
        top = max(costs)
        print(f"run_batch of {top} vs one by one can reach at most {top * costs[1] / costs[top]:.2f}x")


if __name__ == "__main__":
    main()
