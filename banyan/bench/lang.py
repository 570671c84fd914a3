"""`banyan bench lang`: banyan.lang programs, each measurement a ratio of two runs side by side in one process.

    fork      a ~1k-token context forked into 8 branches of 64 tokens: bl.Engine with the prefix cache
              off vs on (each run gets a context of its own, so the cache-on run computes it once too)
    batch     64 short chat programs: one by one (run in a loop) vs run_batch, on one engine
    http      the same programs (context, select, gen) on one `banyan serve`: bl.OpenAICompatible
              (echo + logprobs scoring, no banyan-only field) vs bl.RuntimeEndpoint

Each timed round runs both sides of a measurement, alternating which goes first, after one warm-up of each.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable

import banyan.lang as bl
from banyan.bench.launcher import banyan_serve_cmd, free_port, launched
from banyan.bench.speculative import PASSAGE
from banyan.config import EngineConfig
from banyan.frontend.llm import LLM

GOALS = {"fork": 3.0, "batch": 5.0}
OPTIONS = ["the keeper", "the baker", "the visitors", "the gulls"]


@bl.function
def forked(s, context: str, branches: int, tokens: int):
    s += context
    forks = s.fork(branches)
    for i, f in enumerate(forks):
        f += f"\n\nQuestion {i + 1}: what happens next?\n" + bl.gen("answer", max_tokens=tokens, ignore_eos=True)
    forks.join()


@bl.function
def short(s, index: int, tokens: int):
    s += bl.user(f"Question {index}: name a colour and say why you like it.")
    s += bl.assistant(bl.gen("answer", max_tokens=tokens, ignore_eos=True))


@bl.function
def scored(s, context: str, tokens: int):
    s += bl.user(context + "\n\nWho wrote the notebooks?")
    s += bl.assistant("It was " + bl.select("who", choices=OPTIONS) + ". " + bl.gen("why", max_tokens=tokens,
                                                                                      ignore_eos=True))


def context_text(tokenizer, num_tokens: int, seed: int) -> str:
    """Sentences drawn from PASSAGE (seeded) until the text has at least num_tokens tokens."""
    rng, text = random.Random(seed), f"Log {seed}."
    while len(tokenizer.encode(text)) < num_tokens:
        text += " " + rng.choice(PASSAGE)
    return text


def run_lang(config: EngineConfig, args) -> tuple[dict, dict]:
    results = {}
    cached = LLM.from_config(config)
    uncached_config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_prefix_caching=False))
    on, off = bl.Engine(llm=cached), bl.Engine(llm=LLM.from_config(uncached_config))
    try:
        seeds = iter(range(args.workload_seed, args.workload_seed + 10_000))

        def fork_run(backend):
            text = context_text(cached.tokenizer, args.context_tokens, next(seeds))
            return lambda: _check([forked.run(text, args.branches, args.branch_tokens, temperature=args.temperature,
                                              backend=backend)])

        results["fork"] = side_by_side({"cache off": lambda: fork_run(off), "cache on": lambda: fork_run(on)},
                                       args.rounds)
        batch = [{"index": i, "tokens": args.program_tokens} for i in range(args.num_programs)]
        one_by_one = lambda: lambda: _check([short.run(**kw, temperature=args.temperature, backend=on)  # noqa: E731
                                             for kw in batch])
        together = lambda: lambda: _check(short.run_batch(batch, temperature=args.temperature, backend=on))  # noqa: E731
        results["batch"] = side_by_side({"one by one": one_by_one, "run_batch": together}, args.rounds)
    finally:
        on.close()
        off.close()
    if not args.no_http:
        results["http"] = _http(config, args, cached.tokenizer)
    labels = {"fork": f"{args.context_tokens}-token context, {args.branches} forks x {args.branch_tokens} tokens",
              "batch": f"{args.num_programs} short programs x {args.program_tokens} tokens",
              "http": f"{args.http_programs} programs: {args.http_context_tokens}-token context, select, gen"}
    for key, result in results.items():
        result["label"] = labels[key]
    return {"engine": dataclasses.asdict(config), "bench": _settings(args)}, results


def _http(config: EngineConfig, args, tokenizer) -> dict:
    port = free_port()
    with launched(banyan_serve_cmd(config, port), port, ready_timeout=600) as base_url:
        runtime, generic = bl.RuntimeEndpoint(base_url), bl.OpenAICompatible(f"{base_url}/v1", select_mode="logprobs")
        seeds = iter(range(args.workload_seed + 20_000, args.workload_seed + 30_000))

        def programs(backend):
            batch = [{"context": context_text(tokenizer, args.http_context_tokens, next(seeds)),
                      "tokens": args.program_tokens} for _ in range(args.http_programs)]
            return lambda: _check(scored.run_batch(batch, temperature=args.temperature, backend=backend))

        try:
            return side_by_side({"OpenAICompatible": lambda: programs(generic),
                                 "RuntimeEndpoint": lambda: programs(runtime)}, args.rounds)
        finally:
            runtime.close()
            generic.close()


def side_by_side(sides: dict[str, Callable[[], Callable[[], None]]], rounds: int) -> dict:
    """Seconds per side over `rounds` timed rounds (after a warm-up of each), alternating which runs first;
    each side is a factory of one run (its inputs made before the clock starts). ratio = first / second."""
    labels = list(sides)
    for label in labels:
        sides[label]()()
    seconds = dict.fromkeys(labels, 0.0)
    for r in range(rounds):
        for label in labels if r % 2 == 0 else labels[::-1]:
            run = sides[label]()
            started = time.perf_counter()
            run()
            seconds[label] += time.perf_counter() - started
    baseline, measured = labels
    return {"baseline": baseline, "measured": measured, "baseline_s": seconds[baseline] / rounds,
            "measured_s": seconds[measured] / rounds, "ratio": seconds[baseline] / seconds[measured]}


def markdown(results: dict) -> str:
    rows = ["| measurement | baseline | s | banyan.lang | s | ratio | goal |", "|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        goal = f">= {GOALS[key]:.0f}x" if key in GOALS else "reported"
        rows.append(f"| {r['label']} | {r['baseline']} | {r['baseline_s']:.2f} | {r['measured']} | "
                    f"{r['measured_s']:.2f} | {r['ratio']:.2f}x | {goal} |")
    return "\n".join(rows)


def _check(states: list) -> None:
    """A benchmark of failed programs would measure nothing: raise the first error."""
    for state in states:
        if state.error() is not None:
            raise state.error()


def _settings(args) -> dict:
    names = ("context_tokens", "branches", "branch_tokens", "num_programs", "program_tokens", "http_programs",
             "http_context_tokens", "rounds", "temperature", "workload_seed", "no_http")
    return {name: getattr(args, name) for name in names}
