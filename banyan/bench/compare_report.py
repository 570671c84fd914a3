"""The report of one `banyan bench compare`: results JSON, a markdown page, PNG plots.

    OUT_DIR/NAME.json   results.make_report's document; "results" holds
                        {"runs": [{scenario, engine, concurrency, metrics, error}], "goals": [...],
                         "skipped": {peer: why}, "stage_seconds": {engine: wall s}}; serving runs'
                        metrics keep per-request "samples"
    OUT_DIR/NAME.md     the goals with their ratios, then one row per run
    OUT_DIR/NAME-*.png  plots.py's figures, when matplotlib is installed
"""

from __future__ import annotations

import json
import math
from pathlib import Path

RUN_COLUMNS = ("scenario", "engine", "streams", "output tok/s", "req/s", "TTFT p50 / p99 ms", "ITL p50 / p99 ms",
               "decode tok/s", "failed")


def write_report(report: dict, out_dir: Path, name: str) -> list[Path]:
    """Write the JSON, the markdown and the plots; returns the paths written."""
    from banyan.bench.plots import write_plots

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(json_safe(report), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    md_path.write_text(markdown(report) + "\n", encoding="utf-8")
    streams = report["config"]["compare"]["streams"]
    return [json_path, md_path, *write_plots(report["results"]["runs"], streams, out_dir, name)]


def markdown(report: dict) -> str:
    results, where = report["results"], report["machine"]
    lines = [f"# banyan bench compare: {report['config']['compare']['name']}", "",
             f"Machine: {where['cpu']} ({where.get('isa', 'ISA not recorded')}), {where['num_cpus']} CPUs; "
             f"{report['created']}.", "",
             "Command: `" + " ".join(report["command"]) + "`", "", "## Goals", "",
             "| goal | banyan | judged against | best baseline | its value | ratio | target | met |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [_goal_row(goal) for goal in results["goals"]]
    lines += ["", "## Runs", "", "| " + " | ".join(RUN_COLUMNS) + " |", "|" + "---|" * len(RUN_COLUMNS)]
    lines += [_run_row(run) for run in results["runs"]]
    lines += ["", "Wall time per engine, model loads and server starts included: "
              + ", ".join(f"{label} {s:.0f} s" for label, s in results["stage_seconds"].items()) + "."]
    if results["skipped"]:
        lines += ["", "## Not measured", ""] + [f"- {peer}: {why}" for peer, why in results["skipped"].items()]
    return "\n".join(lines)


def _goal_row(goal: dict) -> str:
    target = "1x" if goal.get("absolute") else f"{goal['target']:g}x"  # an absolute goal: its value over the target
    against = _judged_against(goal)
    if goal["met"] is None:
        return f"| {goal['goal']} | {_num(goal['banyan'])} | {against} | | | | {target} | not judged: {goal['note']} |"
    met = "**met**" if goal["met"] else "not met"
    if goal["note"]:
        met += f" ({goal['note']})"
    return (f"| {goal['goal']} | {_num(goal['banyan'])} | {against} | {goal['baseline']} | "
            f"{_num(goal['baseline_value'])} | {goal['ratio']:.2f}x | {target} | {met} |")


def _judged_against(goal: dict) -> str:
    """The peers the goal names, each marked by whether this run measured it."""
    if goal.get("absolute"):
        return "target"
    measured = set(goal.get("judged_against", ()))
    return ", ".join(name if name in measured else f"~~{name}~~ (not measured)" for name in goal.get("baselines", ()))


def peer_failures(report: dict) -> list[str]:
    """Why the run is incomplete: each peer asked for that was skipped, each run that failed."""
    results = report["results"]
    problems = [f"{peer} skipped: {why}" for peer, why in results["skipped"].items()]
    for run in results["runs"]:
        if run["error"]:
            problems.append(f"{run['engine']} {run['scenario']} failed: {run['error']}")
        elif run["metrics"].get("failed"):
            problems.append(f"{run['engine']} {run['scenario']}: {run['metrics']['failed']} failed requests")
    return problems


def _run_row(run: dict) -> str:
    head = f"| {run['scenario']} | {run['engine']} | {run['concurrency'] or ''} |"
    if run["error"]:
        return head + f" failed: {run['error']} |" + " |" * (len(RUN_COLUMNS) - 4)
    m = run["metrics"]
    decode = m.get("decode_tokens_per_s")
    decode = decode["median"] if isinstance(decode, dict) else decode  # batch-1 in process: over iterations
    cells = [_num(m.get("output_throughput")), _num(m.get("request_throughput")), _pair(m.get("ttft_ms")),
             _pair(m.get("itl_ms")), _num(decode), str(m.get("failed", 0))]
    return head + " " + " | ".join(cells) + " |"


def _pair(dist: dict | None) -> str:
    """median / p99 (or max, for the few batch-1 iterations)."""
    if not dist:
        return ""
    return f"{_num(dist.get('median'))} / {_num(dist.get('p99', dist.get('max')))}"


def _num(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.1f}" if abs(value) < 1000 else f"{value:,.0f}"


def json_safe(value):
    """NaN (an empty distribution) becomes null: JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
