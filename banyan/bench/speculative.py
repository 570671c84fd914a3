"""`banyan bench speculative`: the same prompts with speculation off and on, side by side in one process.

One LLM per configuration (off, then each method x policy), all loaded before timing. Each round runs
every configuration once on the same prompts, starting one further along each round, so that load on
a shared machine falls on all of them alike:

    round 0:  off    ngram  suffix
    round 1:  ngram  suffix off
    round 2:  suffix off    ngram
Output tok/s sums tokens and seconds over the rounds; `ratio` is that over the `off` configuration's, and
`ratio_median` the median over rounds of each round's tok/s over off's in the same round: the machine's speed
drifts by more than speculation's effect at many streams (configurations doing the same work differed by 3-8% in
sums over 5 rounds), and a round's pair ran within seconds of each other.
With --request-rate, each run replays the same seeded Poisson arrivals instead (banyan.bench.arrivals), and each
configuration also reports TTFT / TPOT / end-to-end latency over all its rounds' requests, `e2el_ratio` being its
mean end-to-end latency over off's (below 1: faster), and `cpu_ratio`, its output tokens per second of this
process's CPU time over off's: on a machine shared with other work a run descheduled for a while loses wall time
but not CPU time, so that ratio is the steadier measure of what speculation saves.
Acceptance comes from the engine's Speculator counters (SpecStats), read after the warm-up and at the end:
    acceptance_per_pos[j] = accepted_per_pos[j] / num_drafts    (P(draft j+1 accepted), per verification)
    mean_accepted_len     = 1 + num_accepted_tokens / num_drafts (tokens a verifying step emits)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time

from banyan.bench.arrivals import poisson_offsets, run_arrivals
from banyan.bench.code_edits import code_edit_prompts
from banyan.bench.metrics import percentile, summarize
from banyan.bench.offline import generate_all
from banyan.bench.workloads import BenchPrompt, random_prompts
from banyan.config import EngineConfig
from banyan.frontend.llm import LLM
from banyan.spec.config import SpeculativeConfig, json_object
from banyan.spec.speculator import SpecStats
from banyan.text.tokenizer import encode_chat

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk.",
    "He carried a brass lantern, a notebook and a flask of strong black tea.",
    "From the gallery he could see the fishing boats returning to the harbour.",
    "Each boat had a name painted on its bow in white or yellow letters.",
    "He wrote the names down in the order the boats passed the breakwater.",
    "On calm nights the sea was silver and the gulls slept on the rocks.",
    "On stormy nights the waves broke over the pier and the glass rattled.",
    "In spring the keeper painted the railings and oiled the great lens.",
    "In autumn he counted the migrating geese and noted the wind direction.",
    "Visitors sometimes asked whether he was lonely, and he always said no.",
    "The village baker sent up fresh bread with the supply boat on Fridays.",
    "When the keeper retired, his notebooks filled three long wooden shelves.",
)
"""Plain sentences the copy workload draws from: nothing to download, the same on every machine."""

DEFAULT_OUTPUT_LEN = 64
"""Tokens each copy and random prompt generates when --output-len is not given."""

INSTRUCTION = "Rewrite the following text exactly as it is, word for word, with no comments:\n\n"


def copy_prompts(llm: LLM, num_prompts: int, output_len: int, *, sentences: int = 8, seed: int = 0) -> list[BenchPrompt]:
    """Input-grounded prompts: "rewrite this text", the text a seeded choice of PASSAGE's sentences, chat-templated
    so that an instruct model copies it. output_len is exact (ignore_eos); keep it near the text's length."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        text = " ".join(rng.sample(PASSAGE, min(sentences, len(PASSAGE))))
        _, ids = encode_chat(llm.tokenizer, [{"role": "user", "content": INSTRUCTION + text}], add_generation_prompt=True)
        prompts.append(BenchPrompt(ids, output_len))
    return prompts


def spec_configs(methods: list[str], policies: list[str], num_speculative_tokens: int | None,
                 draft_model: str | None = None, draft_quantization: str | None = None,
                 suffix_options: dict | None = None) -> dict[str, SpeculativeConfig | None]:
    """Label -> speculative config: `off` first, then every method with every policy (num_speculative_tokens None:
    each config's own default, SpeculativeConfig's)."""
    configs: dict[str, SpeculativeConfig | None] = {"off": None}
    for method in methods:
        extra = {"model": draft_model, "quantization": draft_quantization} if method == "draft_model" else {}
        if method == "suffix":
            extra = dict(suffix_options or {})
        for policy in policies:
            cap = {} if num_speculative_tokens is None else {"num_speculative_tokens": num_speculative_tokens}
            configs[f"{method}-{policy}"] = SpeculativeConfig.from_dict({"method": method, "policy": policy, **cap,
                                                                         **extra})
    return configs


def run_speculative(config: EngineConfig, args) -> tuple[dict, dict]:
    """Every configuration on the workload, `args.rounds` rounds after a warm-up; results per label."""
    if args.temperature is None:  # greedy copies and edits; sampled random prompts do not fall into repeating loops
        args.temperature = 0.0 if args.workload in ("copy", "code-edit") else 1.0
    suffix_options = getattr(args, "suffix_options", None)
    configs = spec_configs(_names(args.methods), _names(args.policies), args.num_speculative_tokens,
                           getattr(args, "draft_model", None), getattr(args, "draft_quantization", None),
                           json_object("suffix_options", suffix_options) if suffix_options else None)
    llms = {label: LLM.from_config(_with(config, spec, args.batch_size)) for label, spec in configs.items()}
    try:
        prompts = _workload(next(iter(llms.values())), args)
        rate = getattr(args, "request_rate", math.inf)
        if math.isinf(rate):
            results = side_by_side(llms, prompts, args.rounds, args.temperature)
        else:
            offsets = poisson_offsets(len(prompts), rate, seed=args.workload_seed)
            results = side_by_side_arrivals(llms, prompts, offsets, args.rounds, args.temperature)
    finally:
        for llm in llms.values():
            llm.engine.close()
    bench = {k: getattr(args, k, None) for k in ("workload", "num_prompts", "copy_sentences", "input_len", "output_len",
                                                 "batch_size", "rounds", "methods", "policies", "num_speculative_tokens",
                                                 "draft_model", "draft_quantization", "suffix_options",
                                                 "temperature", "workload_seed")}
    bench["request_rate"] = str(getattr(args, "request_rate", math.inf))  # inf is not JSON
    return {"engine": dataclasses.asdict(config), "bench": bench}, results


def side_by_side(llms: dict[str, LLM], prompts: list[BenchPrompt], rounds: int, temperature: float) -> dict:
    """Warm each LLM up on the prompts, then time `rounds` rotations over them (the module docstring)."""
    before = _warm_up(llms, prompts, temperature)
    tokens = dict.fromkeys(llms, 0)
    seconds = dict.fromkeys(llms, 0.0)
    per_round: dict[str, list[float]] = {label: [] for label in llms}  # each round's tok/s
    for _, label in _rotations(list(llms), rounds):
        start = time.perf_counter()
        run = generate_all(llms[label], prompts, temperature, use_tqdm=False)
        elapsed = time.perf_counter() - start
        seconds[label] += elapsed
        tokens[label] += run["total_output_tokens"]
        per_round[label].append(run["total_output_tokens"] / elapsed)
    base = next(iter(tokens.values())) / next(iter(seconds.values()))
    base_rounds = next(iter(per_round.values()))
    results = {}
    for label, llm in llms.items():
        rate = tokens[label] / seconds[label]
        paired = [mine / off for mine, off in zip(per_round[label], base_rounds)]
        results[label] = {"output_throughput": rate, "ratio": rate / base, "elapsed_s": seconds[label],
                          "round_ratios": paired, "ratio_median": percentile(paired, 50),
                          "total_output_tokens": tokens[label], **_acceptance(before[label], _counters(llm))}
    return results


def side_by_side_arrivals(llms: dict[str, LLM], prompts: list[BenchPrompt], offsets: list[float], rounds: int,
                          temperature: float) -> dict:
    """As side_by_side, each run the arrival schedule `offsets` (banyan.bench.arrivals) instead of one batch."""
    before = _warm_up(llms, prompts, temperature)
    timings = {label: [] for label in llms}
    seconds, cpu_seconds = dict.fromkeys(llms, 0.0), dict.fromkeys(llms, 0.0)
    for r, label in _rotations(list(llms), rounds):
        cpu_start = time.process_time()
        run, elapsed = run_arrivals(llms[label].engine, prompts, offsets, temperature, tag=f"round{r}")
        cpu_seconds[label] += time.process_time() - cpu_start
        timings[label] += run
        seconds[label] += elapsed
    summaries = {label: summarize(timings[label], seconds[label]) for label in llms}
    base = next(iter(summaries.values()))
    base_per_cpu = base["total_output_tokens"] / next(iter(cpu_seconds.values()))
    results = {}
    for label, llm in llms.items():
        summary = summaries[label]
        per_cpu = summary["total_output_tokens"] / cpu_seconds[label]
        results[label] = {**summary, "ratio": summary["output_throughput"] / base["output_throughput"],
                          "e2el_ratio": summary["e2el_ms"]["mean"] / base["e2el_ms"]["mean"],
                          "elapsed_s": seconds[label], "cpu_s": cpu_seconds[label], "output_per_cpu_s": per_cpu,
                          "cpu_ratio": per_cpu / base_per_cpu, **_acceptance(before[label], _counters(llm))}
    return results


def markdown(results: dict) -> str:
    """One row per configuration: tok/s, ratio, mean accepted length, acceptance per position."""
    if "e2el_ms" in next(iter(results.values()), {}):
        return _latency_markdown(results)
    rows = ["| configuration | output tok/s | vs off | vs off, median of rounds (range) | mean accepted length "
            "| acceptance per position |", "|---|---|---|---|---|---|"]
    for label, r in results.items():
        accept = " / ".join(f"{a:.2f}" for a in r.get("acceptance_per_pos", [])) or "-"
        length = f"{r['mean_accepted_len']:.2f}" if "mean_accepted_len" in r else "-"
        paired = r["round_ratios"]
        rounds = f"{r['ratio_median']:.2f}x ({min(paired):.2f}-{max(paired):.2f})"
        rows.append(f"| {label} | {r['output_throughput']:.1f} | {r['ratio']:.2f}x | {rounds} | {length} | {accept} |")
    return "\n".join(rows)


def _latency_markdown(results: dict) -> str:
    """With arrivals: tok/s and latency (mean / p50 / p99 in ms) beside acceptance."""
    rows = ["| configuration | output tok/s | vs off | tok per CPU-s vs off | E2E mean / p50 / p99 | E2E vs off "
            "| TPOT mean / p50 / p99 | TTFT mean | mean accepted length | acceptance per position |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        accept = " / ".join(f"{a:.2f}" for a in r.get("acceptance_per_pos", [])) or "-"
        length = f"{r['mean_accepted_len']:.2f}" if "mean_accepted_len" in r else "-"
        e2el, tpot = r["e2el_ms"], r["tpot_ms"]
        rows.append(f"| {label} | {r['output_throughput']:.1f} | {r['ratio']:.2f}x | {r['cpu_ratio']:.2f}x "
                    f"| {e2el['mean']:.0f} / {e2el['median']:.0f} / {e2el['p99']:.0f} | {r['e2el_ratio']:.2f}x "
                    f"| {tpot['mean']:.1f} / {tpot['median']:.1f} / {tpot['p99']:.1f} | {r['ttft_ms']['mean']:.0f} "
                    f"| {length} | {accept} |")
    return "\n".join(rows)


def _warm_up(llms: dict[str, LLM], prompts: list[BenchPrompt], temperature: float) -> dict[str, SpecStats | None]:
    """One untimed batch of the prompts on each LLM; the speculation counters after it."""
    for llm in llms.values():
        generate_all(llm, prompts, temperature, use_tqdm=False)
    return {label: _counters(llm) for label, llm in llms.items()}


def _rotations(labels: list[str], rounds: int):
    """(round, label) in run order: every label once a round, each round starting one label further along."""
    for r in range(rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            yield r, label


def _acceptance(before: SpecStats | None, after: SpecStats | None) -> dict:
    """The speculator's counters over the timed rounds (none for `off`)."""
    if after is None:
        return {}
    timed = after.since(before)
    drafts, draft_tokens, accepted = timed.num_drafts, timed.num_draft_tokens, timed.num_accepted_tokens
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "accepted_per_pos": timed.accepted_per_pos,
        "acceptance_per_pos": [n / drafts if drafts else 0.0 for n in timed.accepted_per_pos],
        "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_accepted_len": 1 + accepted / drafts if drafts else 1.0,
    }


def _counters(llm: LLM) -> SpecStats | None:
    """A copy of the engine's speculation counters; None with speculation off."""
    speculator = llm.engine.speculator
    return None if speculator is None else speculator.stats.copy()


def _workload(llm: LLM, args) -> list[BenchPrompt]:
    """copy: greedy rewrites of a given text; code-edit: greedy edits of a given module (code_edits); random: random
    tokens, sampled at temperature 1 (nothing to copy); mixed: copy and random interleaved, half each, each with its
    own temperature."""
    if args.workload == "code-edit":
        return code_edit_prompts(llm.tokenizer, args.num_prompts, seed=args.workload_seed, max_tokens=args.output_len)
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    copy = copy_prompts(llm, args.num_prompts, output_len, sentences=args.copy_sentences, seed=args.workload_seed)
    rand = random_prompts(args.num_prompts, args.input_len, output_len, llm.engine.arch.vocab_size,
                          seed=args.workload_seed)
    if args.workload != "mixed":
        return copy if args.workload == "copy" else rand
    half = args.num_prompts // 2
    copies = [dataclasses.replace(p, temperature=0.0) for p in copy[: args.num_prompts - half]]
    randoms = [dataclasses.replace(p, temperature=1.0) for p in rand[:half]]
    return [p for pair in itertools.zip_longest(copies, randoms) for p in pair if p is not None]


def _with(config: EngineConfig, spec: SpeculativeConfig | None, batch_size: int) -> EngineConfig:
    scheduler = dataclasses.replace(config.scheduler, max_num_seqs=batch_size)
    return dataclasses.replace(config, scheduler=scheduler, speculative=spec)


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]

