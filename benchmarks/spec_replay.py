"""Batch-1 speculation on this machine by step counts (banyan/bench/spec_replay.py): record the workload's greedy
outputs once, measure the step-time curve once, then replay every configuration and the two ceilings.

    python benchmarks/spec_replay.py --workload code-edit --num-prompts 48 --num-threads 2
    python benchmarks/spec_replay.py --workload copy --num-prompts 8 --output-len 64 --methods ngram

Prints the curve (median of interleaved rounds of ModelRunner.time_forward at the outputs' mean context), the
prefill's share of the plain run's time (the same prompts with max_tokens=1 against the full run, their prefixes
cached as in the rounds of `banyan bench speculative`, so an estimate of what it would show: 1 / (share + (1 - share)
/ ratio)), and per configuration the
decode's speed-up, the steps by drafts, and the mean accepted length; for a proposer that tells its evidence, also
the best fixed k for each evidence bucket in hindsight (bucket:k), between the controller and best k. Same outputs
and curve: the same numbers every run: the curve moves between runs on a shared machine (t(4) / t(1) 1.47-1.70 in three runs on a 2-vCPU
Zen 3), so judge a change to a proposer or the controller on one recording (--save, then --load).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from banyan import LLM, SamplingParams
from banyan.bench.code_edits import code_edit_prompts
from banyan.bench.spec_replay import Trace, replay, replay_best_k, replay_copy_oracle, replay_hindsight_evidence_k
from banyan.bench.speculative import copy_prompts
from banyan.kernels import cpu_gemv
from banyan.spec.config import SpeculativeConfig
from banyan.spec.proposer import make_proposer


def record(llm: LLM, prompts) -> tuple[list[Trace], float, float]:
    """Greedy outputs (speculation off) and the seconds of the full run and of its prefills alone."""
    def run(max_tokens=None):
        params = [SamplingParams(temperature=0.0, max_tokens=max_tokens or p.output_len, ignore_eos=p.ignore_eos)
                  for p in prompts]
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p.prompt_token_ids} for p in prompts], params, use_tqdm=False)
        return outs, time.perf_counter() - start

    run(1)  # warm-up
    outs, full = run()
    _, prefill = run(1)
    traces = [Trace(p.prompt_token_ids, list(o.outputs[0].token_ids), p.output_len) for p, o in zip(prompts, outs)]
    return traces, full, prefill


def step_curve(llm: LLM, counts: list[int], context: int, rounds: int = 30) -> dict[int, float]:
    runner = llm.engine.runner
    for _ in range(3):
        for n in counts:
            runner.time_forward(n, context)
    times = {n: [] for n in counts}
    for _ in range(rounds):
        for n in counts:
            times[n].append(runner.time_forward(n, context))
    return {n: statistics.median(v) for n, v in times.items()}


def interpolated(curve: dict[int, float]):
    points = sorted(curve.items())

    def seconds(n: int) -> float:
        for (a, ta), (b, tb) in zip(points, points[1:]):
            if a <= n <= b:
                return ta + (tb - ta) * (n - a) / (b - a)
        (a, ta), (b, tb) = points[-2], points[-1]
        return tb + (tb - ta) * (n - b) / (b - a)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("code-edit", "copy"), default="code-edit")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=64, help="copy: tokens each rewrite generates")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed (which texts, which edits)")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--methods", default="ngram,suffix")
    parser.add_argument("--policies", default="adaptive,fixed")
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--save", help="write the recording (outputs, curve, prefill share) to this JSON file")
    parser.add_argument("--load", help="replay a recording --save wrote: no model, the same curve (compare changes)")
    args = parser.parse_args()
    max_k = args.num_speculative_tokens

    if args.load:
        saved = json.loads(Path(args.load).read_text())
        traces = [Trace(**t) for t in saved["traces"]]
        curve, share, context = {int(n): t for n, t in saved["curve"].items()}, saved["prefill_share"], saved["context"]
        setting = saved["setting"]
    else:
        llm = LLM(num_threads=args.num_threads, kv_cache_memory="128MiB", max_num_seqs=1)
        prompts = (code_edit_prompts(llm.tokenizer, args.num_prompts, seed=args.seed) if args.workload == "code-edit"
                   else copy_prompts(llm, args.num_prompts, args.output_len, seed=args.seed))
        traces, full, prefill = record(llm, prompts)
        context = round(statistics.mean(len(t.prompt) + len(t.output) / 2 for t in traces))
        curve = step_curve(llm, list(range(1, max_k + 2)) + [2 * max_k + 2], context)
        share = prefill / full
        isa = cpu_gemv.builds_for_this_cpu()[0]
        setting = f"{args.workload} (seed {args.seed}), {args.num_threads} threads, {isa}"
        if args.save:
            Path(args.save).write_text(json.dumps({"traces": [dataclasses.asdict(t) for t in traces], "curve": curve,
                                                   "prefill_share": share, "context": context, "setting": setting}))
    seconds = interpolated(curve)
    print(f"{setting}: {len(traces)} prompts, {sum(len(t.output) for t in traces)} output tokens; context {context}; "
          f"prefill {share:.0%} of the plain run")
    print("step time (tokens: ms): " + ", ".join(f"{n}: {t * 1e3:.2f}" for n, t in sorted(curve.items())))
    print("| configuration | decode speed-up | with prefill (estimate) | mean accepted length | steps by drafts |")
    print("|---|---|---|---|---|")

    def row(label, result):
        overall = 1.0 / (share + (1.0 - share) / result.ratio)
        steps = " ".join(f"{k}:{n}" for k, n in sorted(result.steps.items()))
        print(f"| {label} | {result.ratio:.3f}x | {overall:.3f}x | {result.mean_accepted_len:.2f} | {steps} |")

    suffix_fresh = {"suffix_decoding_max_cached_requests": 0}  # each request from its own text, as a new one
    for method in (m.strip() for m in args.methods.split(",") if m.strip()):
        extra = suffix_fresh if method == "suffix" else {}
        for policy in (p.strip() for p in args.policies.split(",") if p.strip()):
            config = SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": max_k, "policy": policy,
                                                  **extra})
            row(f"{method}-{policy}", replay(traces, config, seconds))
        config = SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": max_k, **extra})

        def make(method=method, config=config):
            return make_proposer(method, **config.proposer_options())

        if hasattr(make(), "propose_with_evidence"):
            result, ks = replay_hindsight_evidence_k(traces, make, max_k, seconds)
            chosen = " ".join(f"{b}:{k}" for b, k in ks.items())
            row(f"{method}, k per evidence bucket in hindsight ({chosen})", result)
        row(f"{method}, best k (ceiling)", replay_best_k(traces, make(), max_k, seconds))
    row("copy oracle (ceiling)", replay_copy_oracle(traces, max_k, seconds))


if __name__ == "__main__":
    main()
