"""One JSON document per run, with a stable schema, and its markdown table.

    {"schema_version": 1, "bench": "throughput", "created": "...", "command": [...],
     "machine": {"cpu": "...", "num_cpus": 2}, "config": {...}, "results": {...}}
Results hold numbers or {mean, median, p90, p99} dicts; units are in the key names (_ms, _s, _bytes).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

from banyan.kernels.cpu_features import isa

SCHEMA_VERSION = 1


def make_report(bench: str, config: dict, results: dict) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "bench": bench,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": sys.argv,
        "machine": machine(),
        "config": config,
        "results": results,
    }


def machine() -> dict:
    return {"cpu": cpu_model(), "isa": isa(), "num_cpus": os.cpu_count(), "platform": platform.platform()}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def markdown_table(report: dict) -> str:
    rows = [f"| {report['bench']} | value |", "|---|---|"]
    where = report.get("machine")
    if where:  # CPU timings depend on the vector ISA: every report names it
        rows.append(f"| machine | {where['cpu']}, {where.get('isa', 'ISA not recorded')}, {where['num_cpus']} CPUs |")
    for key, value in report["results"].items():
        if isinstance(value, dict):
            cells = ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
            rows.append(f"| {key} | {cells} |")
        else:
            rows.append(f"| {key} | {_fmt(value)} |")
    return "\n".join(rows)


def emit(report: dict, output_json: str | None, table: str | None = None) -> None:
    """Print the table (markdown_table's unless one is given); write the JSON when a path is given."""
    print(table or markdown_table(report))
    if output_json:
        with open(output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


def _fmt(value) -> str:
    return f"{value:,.2f}" if isinstance(value, float) else str(value)
